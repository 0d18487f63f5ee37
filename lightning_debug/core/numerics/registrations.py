"""A process-wide count of the parameter and module registrations that may have changed a watched
model, so a parameter index is validated only when one happened, never rescanned on a healthy step.

Not every registration is a change. transformers' Llama-family decoders slice their ``ModuleList``
in every forward (a new container that registers every layer again) and Switch-Transformers'
router assigns ``self.classifier = self.classifier.to(dtype)`` (the same module in the same slot).
So a registration counts only when it puts a different object into a slot of a module of a watched
model (:func:`watch_model`); one into a module outside every watched model (a fresh container)
is ignored, since attaching that container to the model is itself a counted registration. The
count only says "may have changed": the index is then compared by identity before it is rebuilt.

Example::

    >>> from torch import nn
    >>> watch_registrations()
    >>> model = nn.Sequential(nn.Linear(2, 2))
    >>> watch_model(model)
    >>> before = registration_count()
    >>> _ = nn.ModuleList(list(model))  # a fresh container: not the model
    >>> model[0] = model[0]             # the same module in the same slot
    >>> registration_count() == before
    True
    >>> model.append(nn.Linear(2, 2))
    Sequential(...)
    >>> registration_count() > before
    True
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_registrations = [0]
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_every_module = [False]  # a model whose modules are unknown is watched: every registration counts


def registration_count() -> int:
    """How many registrations that may have changed a watched model happened since :func:`watch_registrations` (plus one)."""
    return _registrations[0]


def watch_model(model: nn.Module | None) -> None:
    """Count registrations into ``model``'s modules from now on (None: a model whose modules are not
    known, so every registration in the process counts). Called when an index is built."""
    if model is None:
        _every_module[0] = True
    else:
        _watched.update(model.modules())


def _count_parameter(module: nn.Module, name: str, param: Any) -> None:
    if (_every_module[0] or module in _watched) and module._parameters.get(name) is not param:
        _registrations[0] += 1


def _count_module(module: nn.Module, name: str, submodule: Any) -> None:
    if (_every_module[0] or module in _watched) and module._modules.get(name) is not submodule:
        _registrations[0] += 1


def watch_registrations() -> None:
    """Install the two global registration hooks (once per process)."""
    if _registrations[0] == 0:
        _registrations[0] = 1
        nn.modules.module.register_module_parameter_registration_hook(_count_parameter)
        nn.modules.module.register_module_module_registration_hook(_count_module)
