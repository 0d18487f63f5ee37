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
import enum
import functools
import inspect
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_debug.config_types import (MAX_PROFILE_STEPS, AboveOne, ConfigError, FiniteNonNegativeFloat,
                                          NonNegativeInt, NotEmptyStr, PositiveInt, ProfileLength, Setting,
                                          UnitFraction, as_integer, field_rule, markdown, member_named,
                                          rejects_unknown_keywords, setting, unknown_name_error, with_args)


class _AnyCaseNames(enum.EnumMeta):
    """``DebugMode["full_debug"]`` is ``DebugMode.FULL_DEBUG``: LightningCLI looks an enum member up by name, so a
    YAML ``config: {mode: full_debug}`` accepts the spellings ``DebugConfig(mode=...)`` does (unknown: ``KeyError``)."""

    def __getitem__(cls, name: Any) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            member = member_named(cls, name)
            if member is None:
                raise
            return member


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
    """What a non-finite loss, gradient or parameter does; a ``str`` enum, so ``mode == "skip"`` keeps working."""

    WARN = "warn"
    RAISE = "raise"
    SKIP = "skip"
    STOP = "stop"

    def __str__(self) -> str:
        return self.value


AnomalyModeName = Literal["warn", "raise", "skip", "stop"]
"""Fields are typed ``AnomalyMode | AnomalyModeName``: LightningCLI then rejects any other value while it parses
(exit code 2, no traceback) and accepts the spellings Python accepts."""
DebugLevelName = Literal["basic", "intermediate", "advanced", "expert"]



class Area(enum.Enum):
    """The areas of checks, in the order the run calls them: ``ACTIVATIONS`` comes with gradients, ``LOOP`` and
    ``ERRORS`` with any of the four callback areas."""

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
EVERY_CALLBACK = AREAS_BY_MODE[DebugMode.FULL_DEBUG]
"""The areas of the four callbacks: a field that names them all is a keyword of every callback."""


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


def _check_profile_steps(window: Any) -> tuple[int, int]:
    values = [as_integer(v) for v in window] if isinstance(window, (list, tuple)) else []
    if len(values) != 2 or any(v is None or v < 0 for v in values):
        raise ValueError("DebugConfig.profile_steps must be None or (start, length) with integers start >= 0 "
                         f"and length >= 0, got {window!r}")
    if values[1] > MAX_PROFILE_STEPS:  # type: ignore[operator]
        raise ValueError(f"DebugConfig.profile_steps length must be at most {MAX_PROFILE_STEPS}, got {window!r}: "
                         "torch.profiler keeps every event of the window in memory and writes one trace of "
                         "them all (about 100 KB per step for a small model); profile a few steps")
    return values[0], values[1]  # type: ignore[return-value]


_ANOMALY, _GRADIENTS, _MEMORY, _PERFORMANCE = (Area.ANOMALY,), (Area.GRADIENTS,), (Area.MEMORY,), (Area.PERFORMANCE,)


@dataclass
class DebugConfig:
    """Settings for all lightning-debug checks. Frequencies count optimizer steps (``trainer.global_step``), not
    micro-batches. Each field is declared once below; the Args here, the callbacks' keywords and
    docs/configuration.md's table are made from the declarations.

    Example::

        >>> cfg = DebugConfig(mode="anomaly_detection", level="advanced")
        >>> cfg.mode, cfg.level
        (<DebugMode.ANOMALY_DETECTION: 'anomaly_detection'>, <DebugLevel.ADVANCED: 'advanced'>)
    """

    mode: DebugMode = setting(DebugMode.FULL_DEBUG, "Which callbacks :func:`~lightning_debug.debug_callbacks` "
                              "returns.")
    level: DebugLevel | DebugLevelName = setting(
        DebugLevel.BASIC, "Depth of each check; a higher level includes everything of the lower ones.",
        areas=EVERY_CALLBACK)
    anomaly_detection_mode: AnomalyMode | AnomalyModeName = setting(
        "warn", 'What a non-finite loss, gradient or parameter does: ``"warn"`` (event and a rate-limited '
        'warning), ``"raise"`` (:class:`~lightning_debug.AnomalyError`), ``"skip"`` (drop this optimizer step) '
        'or ``"stop"`` (stop training cleanly).', areas=_ANOMALY)
    anomaly_check_frequency: PositiveInt = setting(1, "Check for non-finite values every N optimizer steps.",
                                                   areas=_ANOMALY)
    gradient_checking_frequency: PositiveInt = setting(100, "Check gradient health every N optimizer steps.",
                                                       areas=_GRADIENTS)
    memory_profiling_frequency: PositiveInt = setting(50, "Measure memory every N optimizer steps.", areas=_MEMORY)
    performance_profiling_frequency: PositiveInt = setting(10, "Time the step phases every N optimizer steps.",
                                                           areas=_PERFORMANCE)
    gradient_explosion_threshold: FiniteNonNegativeFloat | None = setting(
        None, "Opt-in fixed cap on the gradient norm: when set, a global (or any parameter's) gradient norm above "
        "it is exploding, and it is the clip value suggested before the run has a history. ``None`` (the "
        "default): the global norm is judged against the run's own recent norms (a jump of 10x over their "
        "median) and no fixed value is used anywhere (see docs/gradients.md).", areas=_GRADIENTS)
    gradient_vanishing_threshold: FiniteNonNegativeFloat = setting(
        1e-6, "A layer (module) whose gradient norm is below this is vanishing; parameters with an exactly "
        "zero gradient inside a learning module are structural and never count.", areas=_GRADIENTS,
        below="gradient_explosion_threshold")
    save_debug_info: bool = setting(True, "Write events.jsonl and the report files to ``debug_output_dir``.",
                                    areas=EVERY_CALLBACK, run_wide=True)
    debug_output_dir: NotEmptyStr = setting(
        "debug_outputs", "Where files go (a path string or ``os.PathLike``). Every run writes in a directory of "
        "its own: a relative path resolves under the logger's version directory (TensorBoard, CSV: "
        "``version_N/debug_outputs``), otherwise under ``default_root_dir`` with the run id below it "
        "(``debug_outputs/<run id>``), as does an absolute path.", areas=EVERY_CALLBACK, run_wide=True,
        check=_check_output_dir, allowed="a non-empty path (``str`` or ``os.PathLike``) with no NUL byte, no "
        "component over 255 bytes, at most 4095 bytes, that is not an existing file nor under one")
    log_gradients: bool = setting(False, "Log per-parameter gradient norms and histograms.", areas=_GRADIENTS)
    log_activations: bool = setting(
        False, "Log per-module activation statistics (``debug/activation/<module>/<stat>``: mean, std, max "
        "abs, zero and saturated fractions, non-finite count) of the leaf modules' outputs on gradient check steps, "
        "with the gradients area (``GradientHealthCallback``, docs/activations.md); dead ReLUs (``dead_activation``) "
        "and saturated sigmoid/tanh layers (``saturated_activation``) are judged with or without it.",
        areas=_GRADIENTS)
    log_weights: bool = setting(False, "Log per-parameter weight norms, update ratios and histograms.",
                                areas=_GRADIENTS)
    log_memory: bool = setting(True, "Log memory scalars to the trainer's logger.", areas=_MEMORY)
    log_performance: bool = setting(True, "Log timing scalars to the trainer's logger.", areas=_PERFORMANCE)
    memory_high_fraction: UnitFraction = setting(
        0.9, "``memory_high`` when CUDA memory reserved exceeds this fraction of the device, or used system "
        "memory this fraction of the machine.", areas=_MEMORY)
    slow_step_factor: AboveOne = setting(
        3.0, "A step slower than this many times the recent median step is a ``slow_step``.", areas=_PERFORMANCE)
    dataloader_bottleneck_share: UnitFraction = setting(
        0.3, "Data wait above this share of the step time (over recent check steps) is a "
        "``dataloader_bottleneck``.", areas=_PERFORMANCE)
    profile_steps: tuple[NonNegativeInt, ProfileLength] | None = setting(
        None, "``(start, length)``: run torch.profiler over optimizer steps ``start`` to ``start + length - 1``; "
        "``None`` means off below ADVANCED and (10, 2) from ADVANCED on; a length of 0 turns it off. At most "
        f"{MAX_PROFILE_STEPS} steps: the profiler keeps every event of the window in memory and writes one trace "
        "of them all (145 MB and +100 MB RSS were measured over 1,500 steps of a small model). Kineto's "
        "profiler_start/stop lines are silenced.",
        areas=_PERFORMANCE, check=_check_profile_steps,
        allowed=f"None or (start, length) with integers start >= 0 and 0 <= length <= {MAX_PROFILE_STEPS}")
    save_plots: bool = setting(
        True, "At the end of fit, draw ``debug_analysis.png`` (loss, step time, memory, gradient norm, findings) "
        "next to the report when it is worth the half second it costs: a finding of warning or above, a run that "
        "did not finish, or 200+ steps (``lightning-debug report DIR`` draws it any time); needs matplotlib "
        '(``pip install matplotlib``), skipped with a note that says how to draw it later without it.', run_wide=True)
    print_summary: bool = setting(
        True, "At the end of fit, print a short summary of the findings and where the files are, once, on the "
        "global-zero process: plain lines, whole paths and commands to copy; in colour on a terminal when rich is "
        "installed.", run_wide=True)
    follow_log_cadence: bool = setting(
        True, "Send scalars to the loggers at the trainer's logging cadence (``log_every_n_steps``), as "
        "Lightning's own monitoring callbacks do: of the check steps in each logging window, the last one's "
        "values are logged at their own step (the lowest value for ``debug/loss_finite``, so a NaN is never "
        "hidden). False logs every check step. Events and the report are never thinned.", run_wide=True)
    expose_callback_metrics: bool = setting(
        False, "Also put ``debug/loss_finite``, ``debug/anomaly/count`` and ``debug/grad/global_norm`` into "
        "``trainer.callback_metrics`` when they are measured, so ``EarlyStopping`` or ``ModelCheckpoint`` can "
        "``monitor`` them.", run_wide=True)

    def __post_init__(self) -> None:
        for name, (check, _) in _RULES.items():
            setattr(self, name, check(getattr(self, name)))
        for name, above in _BELOW.items():
            low, high = getattr(self, name), getattr(self, above)
            if high is not None and low >= high:
                raise ConfigError(f"DebugConfig.{name} must be below DebugConfig.{above}, got {low!r} >= {high!r}",
                                  (name, above), f"{name} must be below {above}", {name: low, above: high})

    def replace(self, **overrides: Any) -> "DebugConfig":
        """A copy with the given fields changed; ``None`` values keep this config's value."""
        unknown = sorted(set(overrides) - SETTINGS.keys())
        if unknown:
            raise unknown_name_error("DebugConfig", unknown[0], SETTINGS)
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


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in dataclasses.fields(DebugConfig)}
"""Each field's declaration, in field order."""
TYPES: dict[str, Any] = typing.get_type_hints(DebugConfig)
"""Each field's type (its bound): what LightningCLI checks at parse time."""
RUN_WIDE_FIELDS = tuple(name for name, declared in SETTINGS.items() if declared.run_wide)
"""Settings of the whole run (its files, console summary, plots, logging), not of one area's checks."""
_RULES = {name: field_rule(name, TYPES[name], declared) for name, declared in SETTINGS.items()}
_BELOW = {name: declared.below for name, declared in SETTINGS.items() if declared.below}


def allowed(name: str) -> str:
    """What field ``name`` accepts, in words (help text, the docs' table)."""
    return _RULES[name][1]


def default_text(name: str) -> str:
    """Field ``name``'s default as the docs show it (an enum by name)."""
    default = DebugConfig.__dataclass_fields__[name].default
    return default.name if isinstance(default, enum.Enum) else repr(default)


def fields_of(area: Area) -> tuple[str, ...]:
    """The fields ``area``'s callback takes as keyword overrides: its own first, then those of every callback."""
    own = [name for name, declared in SETTINGS.items() if area in declared.areas]
    return tuple(sorted(own, key=lambda name: SETTINGS[name].areas == EVERY_CALLBACK))


def _help(name: str) -> str:
    """Field ``name``'s help text: its description and, unless it is a flag, what it accepts."""
    whole_run = " A setting of the whole run: set on any of the trainer's debug callbacks, it holds for all."
    return (SETTINGS[name].doc + ("" if TYPES[name] is bool else f" Allowed: {allowed(name)}.")
            + (whole_run if SETTINGS[name].run_wide else ""))


DebugConfig.__doc__ = with_args(DebugConfig.__doc__, ((name, _help(name)) for name in SETTINGS))

DebugConfig.__init__ = rejects_unknown_keywords(DebugConfig.__init__, what="field")  # type: ignore[method-assign]


def keyword_overrides(init: Callable[..., None], area: Area) -> Callable[..., None]:
    """``init`` with one keyword per field of :func:`fields_of` ``(area)`` before its own, typed ``<the field's
    type> | None`` (None keeps ``config``'s value); any other keyword is a ``ValueError`` naming the closest.

    Example::

        >>> class Callback:
        ...     def __init__(self, config=None, **overrides): self.overrides = overrides
        >>> print(*inspect.signature(keyword_overrides(Callback.__init__, Area.MEMORY)).parameters)
        self config memory_profiling_frequency log_memory memory_high_fraction level save_debug_info debug_output_dir
    """
    hints = typing.get_type_hints(init)
    own = [parameter.replace(annotation=hints.get(name, parameter.annotation))
           for name, parameter in inspect.signature(init).parameters.items() if parameter.kind != parameter.VAR_KEYWORD]
    keyword = inspect.Parameter.KEYWORD_ONLY
    overrides = [inspect.Parameter(name, keyword, default=None, annotation=TYPES[name] | None)
                 for name in fields_of(area)]
    positional = [parameter for parameter in own if parameter.kind != keyword]
    signature = inspect.Signature([*positional, *overrides, *(p for p in own if p.kind == keyword)],
                                  return_annotation=None)
    return rejects_unknown_keywords(init, signature)


def override_help(name: str) -> str:
    """A callback's help text for its keyword override of field ``name``."""
    return f"{_help(name)} Null: the value in ``config`` (DebugConfig default: {default_text(name)})."


def config_rows() -> list[str]:
    """docs/configuration.md's table of fields, one markdown row per field (a test keeps the two the same).

    Example::

        >>> config_rows()[3]
        '| anomaly_check_frequency | 1 | an integer >= 1 | Check for non-finite values every N optimizer steps. |'
    """
    whole_run = " A setting of the whole run (below)."
    return [f"| {name} | {default_text(name)} | {markdown(allowed(name))} | {markdown(declared.doc)}"
            f"{whole_run if declared.run_wide else ''} |" for name, declared in SETTINGS.items()]


def config_value(name: str) -> Any:
    """An attribute of an area's settings view that holds ``DebugConfig.<name>`` (filled by :func:`read_view`)."""
    return dataclasses.field(default=getattr(_DEFAULTS, name), metadata={"config_field": name})


_DEFAULTS = DebugConfig()
_View = typing.TypeVar("_View")


def read_view(view: type[_View], config: DebugConfig, **derived: Any) -> _View:
    """An area's settings view (a dataclass of :func:`config_value`) from ``config`` and its derived keywords."""
    fields = dataclasses.fields(view)  # type: ignore[arg-type]
    read = {f.name: getattr(config, f.metadata["config_field"]) for f in fields if "config_field" in f.metadata}
    return view(**read, **derived)


def resolve_config(config: DebugConfig | None, **overrides: Any) -> DebugConfig:
    """``config`` (or the defaults) with the non-``None`` keyword overrides applied and validated."""
    if config is not None and not isinstance(config, DebugConfig):
        raise ValueError(f"config must be a DebugConfig or None, got {type(config).__name__}")
    return (config or DebugConfig()).replace(**overrides)


def as_config(value: Any) -> DebugConfig:
    """A :class:`DebugConfig` from one, ``None`` (the defaults), a mapping of its fields or a :class:`DebugMode`
    (or its name); anything else is a ``ValueError``.

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

