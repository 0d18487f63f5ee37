"""What the memory area reads from :class:`~lightning_debug.config.DebugConfig`, typed and frozen.

Made once per monitor; the rules take it instead of the whole configuration, so a unit test builds
one directly and a reader sees every knob of the area in one place.

Example::

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
    """The memory area's settings.

    Attributes:
        frequency, high_fraction, log_memory: ``DebugConfig``'s ``memory_profiling_frequency``,
            ``memory_high_fraction`` and ``log_memory``.
        phase_readings: Read the allocator at every phase change of a check step (level ADVANCED and up).
        whole_run_history: Record every CUDA allocation for the whole run, so that an OOM leaves a
            full snapshot (level EXPERT).
        window: Readings the growth trend is fitted over (the oldest drop out).
        warmup_readings: First readings left out of the trend (allocator and cache warm-up).
        min_spacing: Fewest optimizer steps between two readings of the trend.
        history_entries: The longest CUDA allocation history recorded.
    """

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
