"""What a replay must not do under distributed training: run a user's collective on one rank only.

A replayed ``training_step`` may call collectives of its own (``self.all_gather(z, sync_grads=True)``
in a contrastive loss). Its forward replay runs on every rank with the same calls, so those match;
but the backward replay stops at the first NaN on the rank that has it, so a collective in the
backward (the gather's own backward) would be entered on the other ranks only, and every rank would
wait forever. :class:`ReplayCollectives` notices the collectives of the forward replay (the c10d
operations it dispatches) and then leaves the backward replay out, saying so.

It also makes the replay's uninitialized allocations defined: ``torch.empty_like`` (the buffers a
gather fills) returns whatever the memory held, sometimes a NaN bit pattern, which the replay would
otherwise name as the operation that produced NaN from finite inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
UNINITIALIZED = frozenset({torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
                           torch.Tensor.new_empty_strided})


class _Watch(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "namespace", "") in COLLECTIVE_NAMESPACES:
            name = f"{func.namespace}.{func.__name__.split('.')[0]}"
            if name not in self.seen:
                self.seen.append(name)
        return func(*args, **(kwargs or {}))


class _Defined(TorchFunctionMode):
    """Uninitialized floating-point allocations come back zero-filled (only while a replay runs)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in UNINITIALIZED and isinstance(result, torch.Tensor) and (result.is_floating_point()
                                                                           or result.is_complex()):
            with torch.no_grad():
                result.zero_()
        return result


class ReplayCollectives:
    """The collectives one micro-batch's replay dispatched, and whether its backward was left out.

    Enter it around :func:`~lightning_debug.checks.localize.localize` and give ``localize`` the
    replay through :meth:`wrap`: the first call (the forward replay) runs and is watched; a later call
    with gradients enabled (the backward replay) is left out when the first dispatched a collective.

    Example::

        >>> watch = ReplayCollectives()
        >>> with watch:
        ...     replay = watch.wrap(lambda: torch.empty_like(torch.ones(2)).sum())
        ...     with torch.no_grad():
        ...         forward = replay()
        ...     backward = replay()
        >>> forward.item(), backward is None, watch.seen, watch.backward_left_out
        (0.0, False, [], False)
    """

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.calls = 0
        self.backward_left_out = False
        self._defined: _Defined | None = None

    def __enter__(self) -> ReplayCollectives:
        # entered before localize's own modes, so they see the zero-filled allocations
        self._defined = _Defined()
        self._defined.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._defined is not None:
            self._defined.__exit__(*exc)
            self._defined = None

    def wrap(self, replay: Callable[[], Any]) -> Callable[[], Any]:
        def watched() -> Any:
            self.calls += 1
            if self.calls > 1 and self.seen and torch.is_grad_enabled():
                self.backward_left_out = True
                return None
            with self._watching():
                return replay()

        return watched

    @contextmanager
    def _watching(self) -> Iterator[None]:
        with _Watch(self.seen):
            yield
