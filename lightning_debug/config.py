"""The one configuration object shared by every callback and the Accelerate debugger.

Validation happens here, at construction, so that a typo in a YAML file fails before the first
step rather than at step 10,000::

    >>> from lightning_debug import DebugConfig
    >>> DebugConfig(anomaly_detection_mode="skip", gradient_checking_frequency=10).anomaly_detection_mode
    <AnomalyMode.SKIP: 'skip'>
    >>> DebugConfig(anomaly_check_frequency=0)
    Traceback (most recent call last):
    ...
    ValueError: DebugConfig.anomaly_check_frequency must be an integer >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_debug.config_types import (MAX_PROFILE_STEPS, AboveOne, FiniteNonNegativeFloat, NonNegativeInt,
                                          NotEmptyStr, PositiveInt, ProfileLength, UnitFraction)


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


@functools.total_ordering
class DebugLevel(enum.Enum, metaclass=_AnyCaseNames):
    """How deep each check goes; a higher level includes everything of the lower ones."""

    BASIC = "basic"
    INTERMEDIATE = "intermediate"
    ADVANCED = "advanced"
    EXPERT = "expert"

    @property
    def rank(self) -> int:
        return list(DebugLevel).index(self)

    def __lt__(self, other: "DebugLevel") -> bool:  # type: ignore[override]
        return self.rank < other.rank


class AnomalyMode(str, enum.Enum, metaclass=_AnyCaseNames):
    """What a non-finite loss, gradient or parameter does (``DebugConfig.anomaly_detection_mode``).

    A ``str`` enum, so ``config.anomaly_detection_mode == "skip"`` keeps working.
    """

    WARN = "warn"
    RAISE = "raise"
    SKIP = "skip"
    STOP = "stop"

    def __str__(self) -> str:
        return self.value


AnomalyModeName = Literal["warn", "raise", "skip", "stop"]
"""The values of :class:`AnomalyMode`. Fields are typed ``AnomalyMode | AnomalyModeName``: LightningCLI
(jsonargparse) then rejects any other value while it parses the YAML file (a usage error, exit code 2, no
traceback), accepts the spellings Python accepts (``skip``, ``RAISE``, through the enum's names in any
case) and prints the member name (``SKIP``) in ``--print_config``."""

DebugLevelName = Literal["basic", "intermediate", "advanced", "expert"]
"""The values of :class:`DebugLevel`, for keyword overrides typed ``DebugLevel | DebugLevelName``."""

class Area(enum.Enum):
    """The areas of checks, in the order the run calls them.

    :class:`DebugMode` selects the four callback areas (anomaly, gradients, memory, performance).
    ``ACTIVATIONS`` comes with the gradients area when ``log_activations`` is on; ``LOOP`` (modules
    left in eval mode, gradients not zeroed) and ``ERRORS`` (the user's exception explained) come
    with any of them, once per run.
    """

    ANOMALY = "anomaly"
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"
    MEMORY = "memory"
    PERFORMANCE = "performance"
    LOOP = "loop"
    ERRORS = "errors"


AREAS_BY_MODE: dict[DebugMode, tuple[Area, ...]] = {
    DebugMode.NONE: (),
    DebugMode.ANOMALY_DETECTION: (Area.ANOMALY,),
    DebugMode.GRADIENT_CHECKING: (Area.GRADIENTS,),
    DebugMode.MEMORY_PROFILING: (Area.MEMORY,),
    DebugMode.PERFORMANCE_PROFILING: (Area.PERFORMANCE,),
    DebugMode.FULL_DEBUG: (Area.ANOMALY, Area.GRADIENTS, Area.MEMORY, Area.PERFORMANCE),
}


def unknown_name_error(owner: str, name: str, valid: Iterable[str], what: str = "field") -> ValueError:
    """``ValueError: <owner> has no <what> 'x'; did you mean 'y'? ...``, naming the closest valid name.

    Example::

        >>> str(unknown_name_error("DebugConfig", "anomaly_mode", ["anomaly_detection_mode", "level"]))
        "DebugConfig has no field 'anomaly_mode'; did you mean 'anomaly_detection_mode'? Fields are anomaly_detection_mode, level"
    """
    names = sorted(valid)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return ValueError(f"{owner} has no {what} {name!r}{hint} {what.capitalize()}s are {', '.join(names)}")


def rejects_unknown_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an ``__init__`` so an unknown keyword is a ``ValueError`` naming the closest valid one (not
    Python's ``TypeError``); the signature stays the same for ``inspect`` and LightningCLI."""
    import inspect

    accepted = [name for name, parameter in inspect.signature(init).parameters.items()
                if name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in accepted]
        if unknown:
            raise unknown_name_error(type(self).__name__, unknown[0], accepted,
                                     "field" if isinstance(self, DebugConfig) else "argument")
        init(self, *args, **kwargs)

    return checked


def _coerce_enum(enum_type: type[enum.Enum], field_name: str, value: Any) -> enum.Enum:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        wanted = value.strip().lower()
        for member in enum_type:
            if wanted in (member.name.lower(), str(member.value).lower()):
                return member
    names = (member.value if isinstance(member, str) else member.name for member in enum_type)
    allowed = ", ".join(names)
    raise ValueError(f"DebugConfig.{field_name} must be one of {allowed}, got {value!r}")


def _is_bool(value: Any) -> bool:
    """``True``/``False`` or a numpy bool (``np.True_``), never ``1`` or ``"yes"``."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _integer(value: Any) -> int | None:
    """An int from an ``int``, a numpy integer (``np.int64``) or a whole float (``1.0``, as a YAML file
    through LightningCLI reads it); None for anything else (bools, ``2.5``)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _real(value: Any) -> float | None:
    """A float from an int, a float or a numpy scalar (``np.float32``); None for anything else (bools, strings)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _check_frequency(field_name: str, value: Any) -> int:
    number = _integer(value)
    if number is None or number < 1:
        raise ValueError(f"DebugConfig.{field_name} must be an integer >= 1, got {value!r}")
    return number


def _check_threshold(field_name: str, value: Any) -> float:
    number = _real(value)
    if number is None or not math.isfinite(number) or number < 0:
        raise ValueError(f"DebugConfig.{field_name} must be a finite number >= 0, got {value!r}")
    return number


def _check_bool(field_name: str, value: Any) -> bool:
    if not _is_bool(value):
        raise ValueError(f"DebugConfig.{field_name} must be True or False, got {value!r}")
    return bool(value)


def _check_output_dir(value: Any) -> str:
    """A non-empty path (``str`` or ``os.PathLike``) a file system can hold, not an existing file nor under one."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"DebugConfig.debug_output_dir must be a non-empty path string, got {value!r}")
    if "\0" in path: raise ValueError(f"DebugConfig.debug_output_dir must not contain a NUL byte, got {value!r}")
    longest = max(map(len, (encoded := os.fsencode(path)).split(b"/")))
    if longest > 255 or len(encoded) > 4095:  # NAME_MAX, and PATH_MAX less its terminating NUL
        raise ValueError("DebugConfig.debug_output_dir must have path components of at most 255 bytes "
                         f"and at most 4095 bytes in all (file system limits), got {len(encoded)} bytes "
                         f"with a longest component of {longest}")
    resolved = Path(path).expanduser()  # no directory can be made in or under a regular file
    if resolved.is_absolute() and not (above := next(p for p in (resolved, *resolved.parents) if p.exists())).is_dir():
        raise ValueError(f"DebugConfig.debug_output_dir must be a directory that can be created, but {str(above)!r}"
                         f"{'' if above == resolved else f' in {path!r}'} is an existing file")
    return path


def _check_performance_fields(config: "DebugConfig") -> None:
    factor = _real(config.slow_step_factor)
    if factor is None or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"DebugConfig.slow_step_factor must be a finite number > 1, got {config.slow_step_factor!r}")
    config.slow_step_factor = factor
    share = _real(config.dataloader_bottleneck_share)
    if share is None or not 0 < share <= 1:
        raise ValueError("DebugConfig.dataloader_bottleneck_share must be a number in (0, 1], got "
                         f"{config.dataloader_bottleneck_share!r}")
    config.dataloader_bottleneck_share = share
    window = config.profile_steps
    if window is not None:
        values = [_integer(v) for v in window] if isinstance(window, (list, tuple)) else []
        if len(values) != 2 or any(v is None or v < 0 for v in values):
            raise ValueError("DebugConfig.profile_steps must be None or (start, length) with integers start >= 0 "
                             f"and length >= 0, got {window!r}")
        if values[1] > MAX_PROFILE_STEPS:  # type: ignore[operator]
            raise ValueError(f"DebugConfig.profile_steps length must be at most {MAX_PROFILE_STEPS}, got {window!r}: "
                             "torch.profiler keeps every event of the window in memory and writes one trace of "
                             "them all (about 100 KB per step for a small model); profile a few steps")
        config.profile_steps = (values[0], values[1])  # type: ignore[assignment]


def _check_gradient_thresholds(config: "DebugConfig") -> None:
    """The vanishing threshold, and the explosion threshold only when set (then the vanishing one is below it)."""
    low = config.gradient_vanishing_threshold = _check_threshold("gradient_vanishing_threshold",
                                                                 config.gradient_vanishing_threshold)
    if config.gradient_explosion_threshold is None:
        return
    high = config.gradient_explosion_threshold = _check_threshold("gradient_explosion_threshold",
                                                                  config.gradient_explosion_threshold)
    if low >= high:
        raise ValueError("DebugConfig.gradient_vanishing_threshold must be below DebugConfig."
                         f"gradient_explosion_threshold, got {low!r} >= {high!r}")


def _check_memory_fields(config: "DebugConfig") -> None:
    fraction = _real(config.memory_high_fraction)
    if fraction is None or not 0 < fraction <= 1:
        raise ValueError(f"DebugConfig.memory_high_fraction must be a number in (0, 1], got {config.memory_high_fraction!r}")
    config.memory_high_fraction = fraction


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
        gradient_explosion_threshold: Opt-in fixed cap on the gradient norm: when set, a global (or
            any parameter's) gradient norm above it is exploding, and it is the clip value suggested
            before the run has a history. ``None`` (the default): the global norm is judged against
            the run's own recent norms (a jump of 10x over their median) and no fixed value is used
            anywhere (see docs/gradients.md).
        gradient_vanishing_threshold: A layer (module) whose gradient norm is below this is
            vanishing; parameters with an exactly zero gradient inside a learning module are
            structural and never count.
        save_debug_info: Write events.jsonl and the report files to ``debug_output_dir``.
        debug_output_dir: Where files go (a path string or ``os.PathLike``). Every run writes in a
            directory of its own: a relative path resolves under the logger's version directory
            (TensorBoard, CSV: ``version_N/debug_outputs``), otherwise under ``default_root_dir``
            with the run id below it (``debug_outputs/<run id>``), as does an absolute path.
        log_gradients: Log per-parameter gradient norms and histograms.
        log_activations: Log per-module activation statistics (mean, std, max |x|, zero and
            saturated fractions, non-finite count) of the leaf modules' outputs on gradient check
            steps, and report dead ReLUs and saturated sigmoid/tanh layers; with the gradients
            area (``GradientHealthCallback``).
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
        save_plots: At the end of fit, draw ``debug_analysis.png`` (loss, step time, memory, gradient
            norm, findings) next to the report with a finding of warning or above, a run that did not
            finish, or 200+ steps (``lightning-debug report DIR`` draws it any time); needs matplotlib
            (``pip install "lightning-debug[plots]"``), skipped with a note without it.
        print_summary: At the end of fit, print a short summary of the findings and where the
            files are, once, on the global-zero process (with rich when it is installed).
        follow_log_cadence: Send scalars to the loggers at the trainer's logging cadence
            (``log_every_n_steps``), as Lightning's own monitoring callbacks do: of the check steps
            in each logging window, the last one's values are logged at their own step (the lowest
            value for ``debug/loss_finite``, so a NaN is never hidden). False logs every check step.
            Events and the report are never thinned.
        expose_callback_metrics: Also put ``debug/loss_finite``, ``debug/anomaly/count`` and
            ``debug/grad/global_norm`` into ``trainer.callback_metrics`` when they are measured, so
            ``EarlyStopping`` or ``ModelCheckpoint`` can ``monitor`` them.

    Example::

        >>> cfg = DebugConfig(mode="anomaly_detection", level="advanced")
        >>> cfg.mode, cfg.level
        (<DebugMode.ANOMALY_DETECTION: 'anomaly_detection'>, <DebugLevel.ADVANCED: 'advanced'>)
    """

    mode: DebugMode = DebugMode.FULL_DEBUG
    level: DebugLevel = DebugLevel.BASIC
    anomaly_detection_mode: AnomalyMode | AnomalyModeName = "warn"
    anomaly_check_frequency: PositiveInt = 1
    gradient_checking_frequency: PositiveInt = 100
    memory_profiling_frequency: PositiveInt = 50
    performance_profiling_frequency: PositiveInt = 10
    gradient_explosion_threshold: FiniteNonNegativeFloat | None = None
    gradient_vanishing_threshold: FiniteNonNegativeFloat = 1e-6
    save_debug_info: bool = True
    debug_output_dir: NotEmptyStr = "debug_outputs"  # an os.PathLike is accepted too (stored as str)
    log_gradients: bool = False
    log_activations: bool = False
    log_weights: bool = False
    log_memory: bool = True
    log_performance: bool = True
    memory_high_fraction: UnitFraction = 0.9
    slow_step_factor: AboveOne = 3.0
    dataloader_bottleneck_share: UnitFraction = 0.3
    profile_steps: tuple[NonNegativeInt, ProfileLength] | None = None
    save_plots: bool = True
    print_summary: bool = True
    follow_log_cadence: bool = True
    expose_callback_metrics: bool = False

    def __post_init__(self) -> None:
        self.mode = _coerce_enum(DebugMode, "mode", self.mode)  # type: ignore[assignment]
        self.level = _coerce_enum(DebugLevel, "level", self.level)  # type: ignore[assignment]
        self.anomaly_detection_mode = _coerce_enum(  # type: ignore[assignment]
            AnomalyMode, "anomaly_detection_mode", self.anomaly_detection_mode)
        for name in FREQUENCY_FIELDS:
            setattr(self, name, _check_frequency(name, getattr(self, name)))
        _check_gradient_thresholds(self)
        for name in BOOL_FIELDS:
            setattr(self, name, _check_bool(name, getattr(self, name)))
        _check_performance_fields(self)
        _check_memory_fields(self)
        self.debug_output_dir = _check_output_dir(self.debug_output_dir)

    def replace(self, **overrides: Any) -> "DebugConfig":
        """A copy with the given fields changed; ``None`` values keep this config's value."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise unknown_name_error("DebugConfig", unknown[0], known)
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def areas(self) -> tuple[Area, ...]:
        """The areas of checks that ``mode`` enables."""
        return AREAS_BY_MODE[self.mode]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums by name, string enums by value), as written into report.json."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value if isinstance(value, str) else value.name
            out[f.name] = value
        return out


DebugConfig.__init__ = rejects_unknown_keywords(DebugConfig.__init__)  # type: ignore[method-assign]

FREQUENCY_FIELDS = ("anomaly_check_frequency", "gradient_checking_frequency", "memory_profiling_frequency",
                    "performance_profiling_frequency")
BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(DebugConfig) if f.type in ("bool", bool))


def resolve_config(config: DebugConfig | None, **overrides: Any) -> DebugConfig:
    """``config`` (or the defaults) with the non-``None`` keyword overrides applied and validated."""
    if config is not None and not isinstance(config, DebugConfig):
        raise ValueError(f"config must be a DebugConfig or None, got {type(config).__name__}")
    return (config or DebugConfig()).replace(**overrides)


def as_config(value: Any) -> DebugConfig:
    """A :class:`DebugConfig` from one (returned as is), ``None`` (the defaults), a mapping of its fields,
    or a :class:`DebugMode` (or its name: ``"full_debug"``); anything else is a ``ValueError``.

    Example::

        >>> as_config({"anomaly_check_frequency": 5}).anomaly_check_frequency, as_config("anomaly_detection").mode
        (5, <DebugMode.ANOMALY_DETECTION: 'anomaly_detection'>)
        >>> as_config(3)
        Traceback (most recent call last):
        ...
        ValueError: expected a DebugConfig, a mapping of its fields or a mode name (none, anomaly_detection, gradient_checking, memory_profiling, performance_profiling, full_debug), got int
    """
    if value is None or isinstance(value, DebugConfig):
        return value or DebugConfig()
    if isinstance(value, Mapping):
        return DebugConfig(**{str(name): field_value for name, field_value in value.items()})
    if isinstance(value, (str, DebugMode)):
        return DebugConfig(mode=value)
    modes = ", ".join(mode.value for mode in DebugMode)
    raise ValueError(f"expected a DebugConfig, a mapping of its fields or a mode name ({modes}), "
                     f"got {type(value).__name__}")

