"""How a :class:`~lightning_debug.DebugConfig` field is declared: its type is its :class:`Bound`, the rest its
:func:`setting`. A bound gives both checks: the restricted type LightningCLI checks while it parses (a usage
error, exit code 2), and the check at construction (a ``ValueError`` naming the field and the bound in words).

Example::

    >>> BOUNDS[UnitFraction].read(0.5), BOUNDS[UnitFraction].read(1.5), BOUNDS[PositiveInt].read(3.0)
    (0.5, None, 3)
    >>> BOUNDS[PositiveInt].read(True) is None
    True
    >>> BOUNDS[PositiveInt].words
    'an integer >= 1'
"""

from __future__ import annotations

import difflib
import enum
import functools
import inspect
import math
import numbers
import operator
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_PROFILE_STEPS = 50
"""The longest torch.profiler window (``DebugConfig.profile_steps`` says why)."""

_COMPARE = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def is_bool(value: Any) -> bool:
    """``True``/``False`` or a numpy bool (``np.True_``), never ``1`` or ``"yes"``."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def as_integer(value: Any) -> int | None:
    """An int from an ``int``, a numpy integer or a whole float (``1.0``, as LightningCLI reads YAML); else None."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if is_bool(value) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def as_real(value: Any) -> float | None:
    """A float from an int, a float or a numpy scalar; None for anything else (bools, strings)."""
    if is_bool(value) or not isinstance(value, numbers.Real):
        return None
    return float(value)


@dataclass(frozen=True)
class Bound:
    """One kind of constraint: its name (as a parse error prints it), base type, limits and words; ``type`` is
    the annotation to give a field (jsonargparse's restricted type, its own ``PositiveInt`` where it has one)."""

    name: str
    base: type
    limits: tuple[tuple[str, float], ...]
    words: str
    type: Any = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", _parse_type(self))

    def read(self, value: Any) -> Any:
        """``value`` as the base type when it is within the bound, else None."""
        if self.base is str:
            return value if isinstance(value, str) and value.strip() else None
        number = as_integer(value) if self.base is int else as_real(value)
        if number is None or not all(_COMPARE[op](number, limit) for op, limit in self.limits):
            return None
        return number


def _parse_type(bound: Bound) -> Any:
    """Without jsonargparse, a plain subclass of the base that only names the bound."""
    try:
        from jsonargparse.typing import restricted_number_type, restricted_string_type
    except ImportError:
        return type(bound.name, (bound.base,), {"__doc__": f"{bound.words} (checked by DebugConfig)."})
    if bound.base is str:
        return restricted_string_type(bound.name, r"^.*[^ ].*$")
    return restricted_number_type(bound.name, bound.base, list(bound.limits), join="and")


BOUNDS: dict[Any, Bound] = {bound.type: bound for bound in (
    Bound("PositiveInt", int, ((">", 0),), "an integer >= 1"),
    Bound("NonNegativeInt", int, ((">=", 0),), "an integer >= 0"),
    Bound("FiniteNonNegativeFloat", float, ((">=", 0), ("<", math.inf)), "a finite number >= 0"),
    Bound("UnitFraction", float, ((">", 0), ("<=", 1)), "a number in (0, 1]"),
    Bound("AboveOne", float, ((">", 1), ("<", math.inf)), "a finite number > 1"),
    Bound("ProfileLength", int, ((">=", 0), ("<=", MAX_PROFILE_STEPS)), f"an integer in [0, {MAX_PROFILE_STEPS}]"),
    Bound("NotEmptyStr", str, (), "a string that is not blank"))}
"""Each bound by its type: what a field's annotation names."""

PositiveInt, NonNegativeInt, FiniteNonNegativeFloat, UnitFraction, AboveOne, ProfileLength, NotEmptyStr = BOUNDS

ALLOWED = {bound.name: bound.words for bound in BOUNDS.values()}
"""Each type's bounds in words, by the type's name (how a parse error names it): what a short error says is allowed."""


@dataclass(frozen=True)
class Setting:
    """A ``DebugConfig`` field besides its name, type and default: its one description (``doc``), the areas whose
    callback takes it as a keyword, whether the whole run shares it, its own ``check`` (``value -> value``) with
    its ``allowed`` words when its type's are not enough, and the field it must stay ``below``."""

    doc: str
    areas: tuple[Any, ...] = ()
    run_wide: bool = False
    check: Callable[[Any], Any] | None = None
    allowed: str | None = None
    below: str | None = None


def setting(default: Any, doc: str, **declared: Any) -> Any:
    """A ``DebugConfig`` field: ``name: BoundedType = setting(default, "what it does", areas=(...))``."""
    return field(default=default, metadata={"setting": Setting(doc, **declared)})


def alternatives(hint: Any) -> tuple[list[Any], bool]:
    """The types of an annotation, without None, and whether None is one of them."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return [arg for arg in args if arg is not type(None)], type(None) in args
    return [hint], False


class ConfigError(ValueError):
    """Settings that break a rule between them: ``fields`` (those at fault), ``rule`` (in words) and ``given``
    (their values), from which LightningCLI prints a usage error (:mod:`lightning_debug.callbacks.cli_usage`).

    Example::

        >>> error = ConfigError("DebugConfig.a must be below DebugConfig.b, got 2 >= 1", fields=("a", "b"),
        ...                     rule="a must be below b", given={"a": 2, "b": 1})
        >>> isinstance(error, ValueError), error.fields, error.rule
        (True, ('a', 'b'), 'a must be below b')
    """

    def __init__(self, message: str, fields: Iterable[str], rule: str, given: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.fields = tuple(fields)
        self.rule = rule
        self.given = dict(given or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.fields, self.rule, self.given))


def _enum_names(enum_type: Any) -> str:
    return ", ".join(member.value if isinstance(member, str) else member.name for member in enum_type)


def member_named(enum_type: Any, name: Any) -> Any:
    """The member of ``enum_type`` whose name or value is ``name`` in any case, else None."""
    wanted = name.strip().lower() if isinstance(name, str) else None
    return next((m for m in enum_type if wanted in (m.name.lower(), str(m.value).lower())), None)


def coerce_enum(enum_type: type[enum.Enum], field_name: str, value: Any) -> enum.Enum:
    """A member of ``enum_type`` from itself, its name or its value in any case; else a ``ValueError``."""
    member = value if isinstance(value, enum_type) else member_named(enum_type, value)
    if member is None:
        raise ValueError(f"DebugConfig.{field_name} must be one of {_enum_names(enum_type)}, got {value!r}")
    return member


def _check(read: Callable[[Any], Any], words: str, field_name: str, value: Any) -> Any:
    if (checked := read(value)) is None:
        raise ValueError(f"DebugConfig.{field_name} must be {words}, got {value!r}")
    return checked


def _optional(check: Callable[[Any], Any], value: Any) -> Any:
    return None if value is None else check(value)


def field_rule(name: str, hint: Any, declared: Setting) -> tuple[Callable[[Any], Any], str]:
    """Field ``name``'s check at construction and what it allows in words: its declared ``check`` and
    ``allowed``, else its type's (a bool, an enum, a :class:`Bound`); a type without a rule is a KeyError at import.

    Example::

        >>> check, words = field_rule("x", UnitFraction | None, Setting("An x."))
        >>> check(None), check(1), words
        (None, 1.0, 'None, or a number in (0, 1]')
    """
    (kind, *_), optional = alternatives(hint)
    if declared.check is not None:
        check, words = declared.check, declared.allowed or ""
    elif kind is bool:
        check, words = functools.partial(_check, lambda v: bool(v) if is_bool(v) else None, "True or False", name), \
            "True or False"
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        check, words = functools.partial(coerce_enum, kind, name), f"one of {_enum_names(kind)} (any case)"
    else:
        bound = BOUNDS[kind]
        check, words = functools.partial(_check, bound.read, bound.words, name), bound.words
    if optional:
        check, words = functools.partial(_optional, check), words if declared.check else f"None, or {words}"
    return check, words + (f", below ``{declared.below}`` when that is set" if declared.below else "")


def with_args(doc: str | None, entries: Iterable[tuple[str, str]]) -> str:
    """``doc`` (a class docstring) with ``name: text`` entries first in its ``Args:`` section (made before its
    ``Example::`` when it has none), wrapped Google-style for jsonargparse and ``help()``. The docstring is cleaned
    first: Python 3.13 compiles docstrings dedented and earlier versions do not, and a section added at another
    indentation would read as the expected output of the example above it.

    Example::

        >>> with_args("Summary.\\n\\n    Example::\\n        1 + 1\\n", [("x", "An x.")]).splitlines()[2:5]
        ['Args:', '    x: An x.', '']
        >>> "Args:" in with_args("Summary.\\n\\nExample::\\n    1 + 1\\n", [("x", "An x.")]).split("Example::")[0]
        True
    """
    lines = [textwrap.fill(f"{name}: {text}", 112, initial_indent=" " * 4, subsequent_indent=" " * 8)
             for name, text in entries]
    doc = inspect.cleandoc(doc or "") + "\n"
    if "\nArgs:\n" not in doc:
        at = doc.index("\nExample::") if "\nExample::" in doc else len(doc) - 1
        doc = doc[:at] + "\nArgs:\n" + doc[at:]
    before, _, after = doc.partition("\nArgs:\n")
    return before + "\nArgs:\n" + "\n".join(lines) + "\n" + after


def markdown(text: str) -> str:
    """Docstring markup as markdown, for the docs' table: double backticks as one, a role (class, func) as its name."""
    return re.sub(r":\w+:`~?(?:[\w.]*\.)?(\w+)`", r"`\1`", text).replace("``", "`")


def unknown_name_error(owner: str, name: str, valid: Iterable[str], what: str = "field") -> ValueError:
    """``ValueError: <owner> has no <what> 'x'; did you mean 'y'? ...``.

    Example::

        >>> str(unknown_name_error("DebugConfig", "anomaly_mode", ["anomaly_detection_mode", "level"]))
        "DebugConfig has no field 'anomaly_mode'; did you mean 'anomaly_detection_mode'? Fields are anomaly_detection_mode, level"
    """
    names = sorted(valid)
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return ValueError(f"{owner} has no {what} {name!r}{hint} {what.capitalize()}s are {', '.join(names)}")


def rejects_unknown_keywords(init: Callable[..., None], signature: inspect.Signature | None = None,
                             what: str = "argument") -> Callable[..., None]:
    """Wrap an ``__init__`` so an unknown keyword is a ``ValueError`` naming the closest valid one (not
    Python's ``TypeError``); ``inspect`` and LightningCLI read ``signature`` (default: ``init``'s)."""
    signature = signature or inspect.signature(init)
    accepted = [name for name, parameter in signature.parameters.items()
                if name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [name for name in kwargs if name not in accepted]
        if unknown:
            raise unknown_name_error(type(self).__name__, unknown[0], accepted, what)
        init(self, *args, **kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return checked
