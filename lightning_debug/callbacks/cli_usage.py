"""A setting that breaks a rule between fields, given through LightningCLI, is a usage error (exit 2, a few lines).

Such a rule can only be checked when the callback is built, and jsonargparse then let the
:class:`~lightning_debug.config_types.ConfigError` out as two chained tracebacks (97 lines, exit 1).
:func:`register` adds, through jsonargparse's public ``add_instantiator``, an instantiator that prints the class,
the rule and the values and exits 2; other exceptions and ``JSONARGPARSE_DEBUG`` are left to jsonargparse.

Example::

    >>> from lightning_debug.config import DebugConfig
    >>> try:
    ...     DebugConfig(gradient_explosion_threshold=1e-9)
    ... except ConfigError as error:
    ...     print("\\n".join(usage_lines(DebugConfig, error, {"gradient_explosion_threshold": 1e-9})))
    error: lightning_debug.DebugConfig: gradient_vanishing_threshold must be below gradient_explosion_threshold
      given: gradient_vanishing_threshold: 1e-06 (default), gradient_explosion_threshold: 1e-09
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from lightning_debug.config_types import ConfigError

_REGISTERED: list[type] = []


def usage_lines(class_type: type, error: ConfigError, init_args: dict[str, Any]) -> list[str]:
    """The class and the rule, then each field's value (``default`` when the configuration did not set it)."""
    try:
        defaults = {name: p.default for name, p in inspect.signature(class_type).parameters.items()}
    except (TypeError, ValueError):
        defaults = {}
    given = ", ".join(f"{name}: {error.given.get(name)!r}"
                      f"{' (default)' if init_args.get(name) in (None, defaults.get(name)) else ''}"
                      for name in error.fields)
    return [f"error: {public_name(class_type)}: {error.rule}", f"  given: {given}"]


def public_name(class_type: type) -> str:
    """``lightning_debug.GradientHealthCallback`` for a class the package exports, else its module path."""
    package = sys.modules.get("lightning_debug")
    name = class_type.__name__
    if name in getattr(package, "__all__", ()) and getattr(package, name, None) is class_type:
        return f"lightning_debug.{name}"
    return f"{class_type.__module__}.{class_type.__qualname__}"


def instantiate(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """jsonargparse's default construction, with a :class:`ConfigError` printed as a usage error (exit 2)."""
    try:
        return class_type(*args, **kwargs)
    except ConfigError as error:
        if os.environ.get("JSONARGPARSE_DEBUG"):
            raise
        sys.stderr.write("".join(f"{line}\n" for line in usage_lines(class_type, error, kwargs)))
        sys.stderr.flush()
        raise SystemExit(2) from error


def register(*class_types: type) -> bool:
    """Register :func:`instantiate` for ``class_types`` once, if a loaded jsonargparse has it (4.49+); whether it is."""
    jsonargparse = sys.modules.get("jsonargparse")
    add_instantiator = getattr(jsonargparse, "add_instantiator", None)
    if add_instantiator is None:
        return False
    for class_type in class_types:
        if class_type not in _REGISTERED:
            add_instantiator(instantiate, class_type, subclasses=True)
            _REGISTERED.append(class_type)
    return True
