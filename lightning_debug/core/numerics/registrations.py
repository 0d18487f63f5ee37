"""A process-wide count of the parameter and module registrations that may have changed a watched
model, so a parameter index is validated only when one happened, never rescanned on a healthy step.

Not every registration is a change. transformers' Llama-family decoders slice their ``ModuleList``
in every forward (a new container that registers every layer again) and Switch-Transformers'
router assigns ``self.classifier = self.classifier.to(dtype)`` (the same module in the same slot).
So a registration counts only when it puts a different object into a slot of a module of a watched
model (:func:`watch_model`); one into a module outside every watched model (a fresh container)
is ignored, since attaching that container to the model is itself a counted registration. The
count only says "may have changed": the index is then compared by identity before it is rebuilt.

The two hooks are process-wide (``torch.nn.modules.module.register_module_*_registration_hook``), so they
are held for as long as a run needs them: :func:`watch_registrations` returns a :class:`Lease`, the
first lease installs them, and releasing the last one (a run's end, whatever ended it) removes them and
forgets the watched models; the count itself never goes back, so an index made before stays stale-proof.

Example::

    >>> from torch import nn
    >>> lease = watch_registrations()
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
    >>> installed(), lease.held
    (True, True)
    >>> lease.release(); lease.held  # the hooks go with the last lease held in the process
    False
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

_registrations = [0]
_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_every_module = [False]  # a model whose modules are unknown is watched: every registration counts


def registration_count() -> int:
    """How many registrations that may have changed a watched model happened while the hooks were installed, plus
    one for each time they were installed (what happened in between was not seen)."""
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


_handles: list[RemovableHandle] = []
_leases: set[int] = set()  # the ids of the leases not yet released
_next_lease = [0]


def installed() -> bool:
    """Whether the two global registration hooks are installed now (a run holds a lease)."""
    return bool(_handles)


class Lease:
    """A hold on the two global hooks: :meth:`release` (idempotent) lets them go, and so does garbage
    collection of a lease never released (a queue dropped without its run's end)."""

    def __init__(self) -> None:
        _next_lease[0] += 1
        self.id = _next_lease[0]
        _leases.add(self.id)
        self._finalizer = weakref.finalize(self, _release, self.id)

    @property
    def held(self) -> bool:
        return self.id in _leases

    def release(self) -> None:
        self._finalizer()


def _release(lease_id: int) -> None:
    _leases.discard(lease_id)
    if _leases or not _handles:
        return
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _watched.clear()
    _every_module[0] = False


def watch_registrations() -> Lease:
    """Hold the two global registration hooks (installed by the first lease held); release the lease at the
    run's end."""
    lease = Lease()
    if not _handles:
        _registrations[0] += 1  # a change made while nothing counted: every index made before is checked again
        _handles.append(nn.modules.module.register_module_parameter_registration_hook(_count_parameter))
        _handles.append(nn.modules.module.register_module_module_registration_hook(_count_module))
    return lease
