"""The anomaly check's settings: the few :class:`DebugConfig` fields it reads, typed and frozen."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_debug.config import AnomalyMode, DebugConfig, DebugLevel, config_value, read_view


@dataclass(frozen=True)
class AnomalySettings:
    """The fields, ``localizes`` (replay to name a NaN's cause, ADVANCED) and ``records_stacks`` (EXPERT)::

        >>> settings = AnomalySettings.from_config(DebugConfig(level="advanced", anomaly_detection_mode="skip"))
        >>> settings.mode, settings.localizes, settings.records_stacks, settings.check_frequency
        (<AnomalyMode.SKIP: 'skip'>, True, False, 1)
    """

    mode: AnomalyMode = config_value("anomaly_detection_mode")
    check_frequency: int = config_value("anomaly_check_frequency")
    localizes: bool = False
    records_stacks: bool = False

    @classmethod
    def from_config(cls, config: DebugConfig) -> AnomalySettings:
        return read_view(cls, config, localizes=config.level >= DebugLevel.ADVANCED,
                         records_stacks=config.level >= DebugLevel.EXPERT)
