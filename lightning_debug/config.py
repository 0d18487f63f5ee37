"""The one configuration object shared by every callback and the Accelerate debugger.

Validation happens here, at construction, so that a typo in a YAML file fails before the first
step rather than at step 10,000::

    >>> from lightning_debug import DebugConfig
    >>> DebugConfig(anomaly_detection_mode="skip", gradient_checking_frequency=10).anomaly_detection_mode
    'skip'
    >>> DebugConfig(anomaly_check_frequency=0)
    Traceback (most recent call last):
    ...
    ValueError: DebugConfig.anomaly_check_frequency must be an integer >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any


class _AnyCaseNames(enum.EnumMeta):
    """``DebugMode["full_debug"]`` is ``DebugMode.FULL_DEBUG``.

    LightningCLI (jsonargparse) reads an enum from YAML by looking its member up by name, so this
    makes a nested ``config: {mode: full_debug, level: advanced}`` accept the same spellings as
    ``DebugConfig(mode="full_debug")``; an unknown name is still a ``KeyError``.
    """

    def __getitem__(cls, name: Any) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            if isinstance(name, str):
                wanted = name.strip().lower()
                for member in cls:  # type: ignore[var-annotated]
                    if wanted in (member.name.lower(), str(member.value).lower()):
                        return member
            raise


class DebugMode(enum.Enum, metaclass=_AnyCaseNames):
    """Which callbacks :func:`lightning_debug.debug_callbacks` returns."""

    NONE = "none"
    ANOMALY_DETECTION = "anomaly_detection"
    GRADIENT_CHECKING = "gradient_checking"
    MEMORY_PROFILING = "memory_profiling"
    PERFORMANCE_PROFILING = "performance_profiling"
    FULL_DEBUG = "full_debug"


class DebugLevel(enum.Enum, metaclass=_AnyCaseNames):
    """How deep each check goes; a higher level includes everything of the lower ones."""

    BASIC = "basic"
    INTERMEDIATE = "intermediate"
    ADVANCED = "advanced"
    EXPERT = "expert"

    @property
    def rank(self) -> int:
        return list(DebugLevel).index(self)

    def __ge__(self, other: "DebugLevel") -> bool:  # type: ignore[override]
        return self.rank >= other.rank

    def __gt__(self, other: "DebugLevel") -> bool:  # type: ignore[override]
        return self.rank > other.rank

    def __le__(self, other: "DebugLevel") -> bool:  # type: ignore[override]
        return self.rank <= other.rank

    def __lt__(self, other: "DebugLevel") -> bool:  # type: ignore[override]
        return self.rank < other.rank


ANOMALY_MODES = ("warn", "raise", "skip", "stop")


def _coerce_enum(enum_type: type[enum.Enum], field_name: str, value: Any) -> enum.Enum:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        wanted = value.strip().lower()
        for member in enum_type:
            if wanted in (member.name.lower(), str(member.value).lower()):
                return member
    allowed = ", ".join(member.name for member in enum_type)
    raise ValueError(f"DebugConfig.{field_name} must be one of {allowed}, got {value!r}")


def _check_frequency(field_name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DebugConfig.{field_name} must be an integer >= 1, got {value!r}")
    return value


def _check_threshold(field_name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"DebugConfig.{field_name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_bool(field_name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"DebugConfig.{field_name} must be True or False, got {value!r}")
    return value


def _check_performance_fields(config: "DebugConfig") -> None:
    factor = config.slow_step_factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"DebugConfig.slow_step_factor must be a finite number > 1, got {factor!r}")
    config.slow_step_factor = float(factor)
    share = config.dataloader_bottleneck_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"DebugConfig.dataloader_bottleneck_share must be a number in (0, 1], got {share!r}")
    config.dataloader_bottleneck_share = float(share)
    window = config.profile_steps
    if window is not None:
        if (not isinstance(window, (list, tuple)) or len(window) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in window)
                or window[0] < 0 or window[1] < 0):
            raise ValueError("DebugConfig.profile_steps must be None or (start, length) with integers start >= 0 "
                             f"and length >= 0, got {window!r}")
        config.profile_steps = (int(window[0]), int(window[1]))


def _check_memory_fields(config: "DebugConfig") -> None:
    fraction = config.memory_high_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"DebugConfig.memory_high_fraction must be a number in (0, 1], got {fraction!r}")
    config.memory_high_fraction = float(fraction)


@dataclass
class DebugConfig:
    """Settings for all lightning-debug checks.

    Frequencies count optimizer steps (``trainer.global_step``), not micro-batches, so gradient
    accumulation does not change how often a check runs. Strings are accepted for ``mode`` and
    ``level`` (``"full_debug"``, ``"ADVANCED"``) so the class reads naturally from YAML.

    Args:
        mode: Which callbacks :func:`~lightning_debug.debug_callbacks` returns.
        level: Depth of each check: BASIC, INTERMEDIATE, ADVANCED or EXPERT.
        anomaly_detection_mode: What a non-finite loss, gradient or parameter does: ``"warn"``
            (event and a rate-limited warning), ``"raise"`` (:class:`~lightning_debug.AnomalyError`),
            ``"skip"`` (drop this optimizer step) or ``"stop"`` (stop training cleanly).
        anomaly_check_frequency: Check for non-finite values every N optimizer steps.
        gradient_checking_frequency: Check gradient health every N optimizer steps.
        memory_profiling_frequency: Measure memory every N optimizer steps.
        performance_profiling_frequency: Time the step phases every N optimizer steps.
        gradient_explosion_threshold: A gradient norm above this is exploding.
        gradient_vanishing_threshold: A gradient norm below this is vanishing.
        save_debug_info: Write events.jsonl and the report files to ``debug_output_dir``.
        debug_output_dir: Where files go; a relative path resolves under the trainer's ``log_dir``.
        log_gradients: Log per-parameter gradient norms and histograms.
        log_activations: Log per-module activation statistics on check steps.
        log_weights: Log per-parameter weight norms, update ratios and histograms.
        log_memory: Log memory scalars to the trainer's logger.
        log_performance: Log timing scalars to the trainer's logger.
        memory_high_fraction: ``memory_high`` when CUDA memory reserved exceeds this fraction of the
            device, or used system memory this fraction of the machine.
        slow_step_factor: A step slower than this many times the recent median step is a ``slow_step``.
        dataloader_bottleneck_share: Data wait above this share of the step time (over recent check
            steps) is a ``dataloader_bottleneck``.
        profile_steps: ``(start, length)``: run torch.profiler over optimizer steps ``start`` to
            ``start + length - 1``; ``None`` means off below ADVANCED and a default window from
            ADVANCED on; a length of 0 turns it off.
        save_plots: At the end of fit, draw ``debug_analysis.png`` (step time, memory, gradient
            norm, findings over steps) next to the report; needs matplotlib
            (``pip install "lightning-debug[plots]"``), skipped with a note without it.
        print_summary: At the end of fit, print a short summary of the findings and where the
            files are, once, on the global-zero process (with rich when it is installed).

    Example::

        >>> cfg = DebugConfig(mode="anomaly_detection", level="advanced")
        >>> cfg.mode, cfg.level
        (<DebugMode.ANOMALY_DETECTION: 'anomaly_detection'>, <DebugLevel.ADVANCED: 'advanced'>)
    """

    mode: DebugMode = DebugMode.FULL_DEBUG
    level: DebugLevel = DebugLevel.BASIC
    anomaly_detection_mode: str = "warn"
    anomaly_check_frequency: int = 1
    gradient_checking_frequency: int = 100
    memory_profiling_frequency: int = 50
    performance_profiling_frequency: int = 10
    gradient_explosion_threshold: float = 10.0
    gradient_vanishing_threshold: float = 1e-6
    save_debug_info: bool = True
    debug_output_dir: str = "debug_outputs"
    log_gradients: bool = False
    log_activations: bool = False
    log_weights: bool = False
    log_memory: bool = True
    log_performance: bool = True
    memory_high_fraction: float = 0.9
    slow_step_factor: float = 3.0
    dataloader_bottleneck_share: float = 0.3
    profile_steps: tuple[int, int] | None = None
    save_plots: bool = True
    print_summary: bool = True

    def __post_init__(self) -> None:
        self.mode = _coerce_enum(DebugMode, "mode", self.mode)  # type: ignore[assignment]
        self.level = _coerce_enum(DebugLevel, "level", self.level)  # type: ignore[assignment]
        mode = self.anomaly_detection_mode
        if not isinstance(mode, str) or mode.strip().lower() not in ANOMALY_MODES:
            raise ValueError(
                f"DebugConfig.anomaly_detection_mode must be one of {', '.join(ANOMALY_MODES)}, got {mode!r}"
            )
        self.anomaly_detection_mode = mode.strip().lower()
        for name in (
            "anomaly_check_frequency",
            "gradient_checking_frequency",
            "memory_profiling_frequency",
            "performance_profiling_frequency",
        ):
            setattr(self, name, _check_frequency(name, getattr(self, name)))
        for name in ("gradient_explosion_threshold", "gradient_vanishing_threshold"):
            setattr(self, name, _check_threshold(name, getattr(self, name)))
        if self.gradient_vanishing_threshold >= self.gradient_explosion_threshold:
            raise ValueError(
                "DebugConfig.gradient_vanishing_threshold must be below DebugConfig.gradient_explosion_threshold, got "
                f"{self.gradient_vanishing_threshold!r} >= {self.gradient_explosion_threshold!r}"
            )
        for name in ("save_debug_info", "log_gradients", "log_activations", "log_weights", "log_memory",
                     "log_performance"):
            _check_bool(name, getattr(self, name))
        _check_performance_fields(self)
        _check_bool("save_plots", self.save_plots)
        _check_bool("print_summary", self.print_summary)
        _check_memory_fields(self)
        if not isinstance(self.debug_output_dir, str) or not self.debug_output_dir.strip():
            raise ValueError(f"DebugConfig.debug_output_dir must be a non-empty path string, got {self.debug_output_dir!r}")

    def replace(self, **overrides: Any) -> "DebugConfig":
        """A copy with the given fields changed; ``None`` values keep this config's value."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"DebugConfig has no field {unknown[0]!r}; fields are {', '.join(sorted(known))}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums by name), as written into report.json."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.name if isinstance(value, enum.Enum) else value
        return out


def resolve_config(config: DebugConfig | None, **overrides: Any) -> DebugConfig:
    """``config`` (or the defaults) with the non-``None`` keyword overrides applied and validated."""
    if config is not None and not isinstance(config, DebugConfig):
        raise ValueError(f"config must be a DebugConfig or None, got {type(config).__name__}")
    return (config or DebugConfig()).replace(**overrides)

