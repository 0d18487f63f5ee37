"""What the memory area reads from :class:`~lightning_debug.config.DebugConfig`, typed and frozen::

    >>> from lightning_debug import DebugConfig
    >>> settings = MemorySettings.from_config(DebugConfig(memory_profiling_frequency=5, level="advanced"))
    >>> settings.frequency, settings.high_fraction, settings.phase_readings, settings.whole_run_history
    (5, 0.9, True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_debug.config import DebugConfig, DebugLevel, config_value, read_view


@dataclass(frozen=True)
class MemorySettings:
    """The fields, the phase readings (ADVANCED), the whole-run allocation history (EXPERT), the growth window."""

    frequency: int = config_value("memory_profiling_frequency")
    high_fraction: float = config_value("memory_high_fraction")
    log_memory: bool = config_value("log_memory")
    phase_readings: bool = False
    whole_run_history: bool = False
    window: int = 32
    warmup_readings: int = 2
    min_spacing: int = 8
    history_entries: int = 100_000

    @classmethod
    def from_config(cls, config: DebugConfig) -> MemorySettings:
        return read_view(cls, config, phase_readings=config.level >= DebugLevel.ADVANCED,
                         whole_run_history=config.level >= DebugLevel.EXPERT)
