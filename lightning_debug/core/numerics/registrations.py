"""A process-wide count of parameter and module registrations, so a parameter index is rebuilt only
when a model changed (a new parameter or submodule anywhere), never rescanned on a healthy step.

Example::

    >>> from torch import nn
    >>> watch_registrations()
    >>> before = registration_count()
    >>> _ = nn.Linear(2, 2)
    >>> registration_count() > before
    True
"""

from __future__ import annotations

from typing import Any

from torch import nn

_registrations = [0]


def registration_count() -> int:
    """How many parameters and submodules were registered since :func:`watch_registrations` (plus one)."""
    return _registrations[0]


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


def watch_registrations() -> None:
    """Count every parameter and submodule registered in this process (once per process)."""
    if _registrations[0] == 0:
        _registrations[0] = 1
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        nn.modules.module.register_module_module_registration_hook(_count_registration)
