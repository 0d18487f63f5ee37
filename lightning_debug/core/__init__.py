"""Framework-independent machinery shared by every check: scheduling, read-back, statistics,
events, logger scalars and the report."""
