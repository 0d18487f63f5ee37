"""Framework-independent machinery shared by every check: the finding vocabulary, the failure
policy, scheduling, read-back, statistics, events, logger scalars, and the monitor protocol.

Nothing here imports the monitors, the adapters, the report package or the package root.
"""
