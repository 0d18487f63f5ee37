"""The anomaly check's collectives, and what a replay must not do: run a user's collective on one rank only. A
backward replay stops at the first NaN on the rank that has it, so a collective in it (the backward of
``self.all_gather(z, sync_grads=True)``) would hang the others: :class:`ReplayCollectives` leaves that backward
out. It also zero-fills the replay's uninitialized allocations, whose garbage could read as a NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_debug.checks.dispatch import TorchDispatchMode
from lightning_debug.core.gate import Planned, Shape
from lightning_debug.monitors.anomaly.policy import reads_late

COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


class _ReplayMode(TorchDispatchMode):
    """Notes the collectives dispatched while ``watching``; zero-fills uninitialized floating allocations. Entered
    below the localizer's own modes, so that they see the filled allocation."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen
        self.watching = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace = getattr(func, "namespace", "")
        if self.watching and namespace in COLLECTIVE_NAMESPACES:
            name = f"{namespace}.{func.__name__.split('.')[0]}"
            if name not in self.seen:
                self.seen.append(name)
        result = func(*args, **(kwargs or {}))
        if namespace == "aten" and func.__name__.split(".")[0] in UNINITIALIZED and isinstance(result, torch.Tensor) \
                and (result.is_floating_point() or result.is_complex()):
            result.zero_()
        return result


class ReplayCollectives:
    """The collectives one micro-batch's replay dispatched: the first call of :meth:`wrap` (the forward) is watched, a
    later one with gradients enabled is left out when the first dispatched a collective::

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
        self._mode: _ReplayMode | None = None

    def __enter__(self) -> ReplayCollectives:
        self._mode = _ReplayMode(self.seen)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def wrap(self, replay: Callable[[], Any]) -> Callable[[], Any]:
        def watched() -> Any:
            self.calls += 1
            if self.calls > 1 and self.seen and torch.is_grad_enabled():
                self.backward_left_out = True
                return None
            mode = self._mode
            if mode is None or self.calls > 1:
                return replay()
            mode.watching = True
            try:
                return replay()
            finally:
                mode.watching = False

        return watched


def nan_step_plan(monitor: Any, current: Any) -> list[Planned]:
    """The collectives the anomaly check makes after the step's measurement, chosen only from values every rank
    shares, so the gate can make those a failure kept a rank from."""
    replay = monitor.context.replay() if monitor.localizes else None
    if reads_late(monitor.mode, replays=replay is not None) or current.world_size < 2:
        return []
    host = current.read(blocking=True)
    if host.failure is not None:
        return []
    nonfinite = bool(host.ranks_with_nonfinite_loss or host.ranks_with_nonfinite_grads)
    plan = []
    if nonfinite and replay is not None and not current.index.sharded and monitor.context.module() is not None:
        plan.append(Planned("replay", Shape.OBJECTS))
    if host.ranks_with_nonfinite_inputs:
        plan.append(Planned("rows", Shape.OBJECTS))
    if nonfinite and not host.params_measured and len(current.index):
        plan.append(Planned("scan", Shape.SUM, len(current.index), current.index.device))
    return plan
