"""One gate for every collective the plugin makes: every rank enters each one, in the same order, with a fixed
shape, whatever failed on it.

A check that fails on one rank is recorded and the run goes on, but a collective after the failing code would then
not be entered there and every other rank would wait forever. So a step's planned collectives (:class:`Planned`,
chosen from values every rank shares) are made by the gate, those this rank never reached with an empty
contribution (:meth:`Gate.close`).

Example, one process (every collective is then local)::

    >>> from lightning_debug.core.guard import Failures
    >>> gate = Gate(Failures())
    >>> gate.open(3, [Planned("rows", Shape.OBJECTS)])
    >>> gate.close()
    >>> gate.agree(1, failed=False)
    Agreement(decision=1, raised=False, failed_ranks=[])
    >>> list(gate.log)
    [(3, 'rows'), (3, 'decision')]

At the end the ranks gather their failed checks once (:func:`gather_failures`) after a bounded wait: a rank that
does not come is named after :data:`WAIT_S` seconds, not the process group's 30-minute timeout.
"""

from __future__ import annotations

import datetime
import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_debug.core.guard import Failures
from lightning_debug.errors import AnomalyError

LOG_KEPT = 256
DECISIONS = 3  # continue, skip, stop (core.monitor.Decision), counted per value


class Shape(enum.Enum):
    """What a planned collective exchanges: a summed float64 vector, each rank's float64 row, one object per rank."""

    SUM = "sum"
    ROWS = "rows"
    OBJECTS = "objects"


@dataclass(frozen=True)
class Planned:
    """A collective due at this point of the step on every rank: its name, shape and (for a sum) length."""

    name: str
    shape: Shape
    size: int = 0
    device: Any = field(default=None, compare=False)
    transport: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)  # ROWS: whose gather


@dataclass(frozen=True)
class Agreement:
    """The step's decision every rank takes, whether a rank raised (``raise`` mode), the ranks that failed."""

    decision: int
    raised: bool
    failed_ranks: list[int]


def distributed() -> tuple[int, int]:
    """This process's rank and the world size of the default group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def drop_gradients(optimizer: Any) -> None:
    """Make ``optimizer.step()`` a no-op: torch optimizers skip parameters whose ``.grad`` is None (no update, no
    momentum, no weight decay)."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


def _device(device: Any) -> Any:
    """``device``, or where the default group's backend takes tensors (NCCL: this process's GPU)."""
    if device is not None:
        return device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Gate:
    """The collectives of one run (see the module docstring); ``log`` keeps the last (step, name) made."""

    def __init__(self, failures: Failures) -> None:
        self.failures = failures
        self.step = -1
        self._plan: list[Planned] = []
        self.log: deque[tuple[int, str]] = deque(maxlen=LOG_KEPT)

    def open(self, step: int, planned: Iterable[Planned]) -> None:
        """The collectives due at ``step`` from now on, in order (computed from values every rank shares)."""
        self.step = step
        self._plan = list(planned)

    def due(self, name: str) -> bool:
        return any(p.name == name for p in self._plan)

    def _reach(self, name: str) -> None:
        """Make the planned collectives before ``name`` (empty contributions), then take ``name`` off the plan."""
        if not self.due(name):
            return
        while self._plan and self._plan[0].name != name:
            self._empty(self._plan.pop(0))
        self._plan.pop(0)

    def _empty(self, planned: Planned) -> None:
        if planned.shape is Shape.SUM:
            self.sum(planned.name, None, planned.size, planned.device)
        elif planned.shape is Shape.ROWS:
            self.rows(planned.name, None, planned.size, planned.device, planned.transport)
        else:
            self.gather(planned.name, None)

    def _contribution(self, name: str, contribute: Callable[[], Any] | None, device: Any = None,
                      size: int | None = None) -> Any:
        """``contribute()`` (a float64 vector of ``size`` when given); None when there is none or it raised."""
        if contribute is None:
            return None
        try:
            own = contribute()
            return own if size is None else own.to(device=device, dtype=torch.float64).reshape(size)
        except Exception as failure:
            self.failures.record(f"contributing to the {name} collective", failure,
                                 "this rank sends an empty contribution")
            return None

    def close(self) -> None:
        """Make every planned collective this rank has not reached (a failure skipped the code that makes it)."""
        while self._plan:
            self._empty(self._plan.pop(0))

    def _enter(self, name: str, contribute: Callable[[], Any] | None, device: Any = None,
               size: int | None = None) -> Any:
        """Reach ``name`` on the plan, note it in :attr:`log` and return this rank's contribution (None: empty)."""
        self._reach(name)
        own = self._contribution(name, contribute, device, size)
        self.log.append((self.step, name))
        return own

    def sum(self, name: str, contribute: Callable[[], torch.Tensor] | None, size: int,
            device: Any = None) -> tuple[torch.Tensor, int]:
        """The sum over ranks of ``contribute()`` and how many ranks sent an empty one (zeros)."""
        device = _device(device)
        own = self._enter(name, contribute, device, size)
        vector = torch.zeros(size + 1, dtype=torch.float64, device=device)
        if own is not None:
            vector[:size] = own
        vector[size] = 1.0 if own is None else 0.0
        if distributed()[1] > 1:
            dist.all_reduce(vector)
        return vector[:size], int(round(float(vector[size])))

    def rows(self, name: str, contribute: Callable[[], torch.Tensor] | None, size: int,
             device: Any = None, transport: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Every rank's row of ``size`` float64 (NaN for an empty one), one after the other, gathered by ``transport``
        (the framework's all-gather) or ``torch.distributed``; the copy to the host is the caller's."""
        device = _device(device)
        row = self._enter(name, contribute, device, size)
        if row is None:
            row = torch.full((size,), float("nan"), dtype=torch.float64, device=device)
        if transport is not None:
            return transport(row).reshape(-1)
        world = distributed()[1]
        if world < 2:
            return row
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        return torch.cat(rows)

    def gather(self, name: str, contribute: Callable[[], Any] | None) -> list[Any]:
        """Every rank's ``contribute()`` (None for an empty one)."""
        own = self._enter(name, contribute)
        world = distributed()[1]
        if world < 2:
            return [own]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, own)
        return gathered

    def agree(self, decision: int, failed: bool, raised: bool = False, device: Any = None) -> Agreement:
        """The step's decision on every rank: the largest of those of the ranks whose checks did not fail (a failed
        rank sends its flag, never a decision), whether any raised, and which failed."""
        rank, world = distributed()
        vector = torch.zeros(DECISIONS + 1 + world, dtype=torch.float64, device=_device(device))
        if failed:
            vector[DECISIONS + 1 + rank] = 1.0
        else:
            vector[int(decision)] = 1.0
            vector[DECISIONS] = 1.0 if raised else 0.0
        self._reach("decision")
        self.log.append((self.step, "decision"))
        if world > 1:
            dist.all_reduce(vector)
        counts = vector.tolist()
        agreed = max((value for value in range(DECISIONS) if counts[value] > 0), default=0)
        failed_ranks = [r for r in range(world) if counts[DECISIONS + 1 + r] > 0]
        return Agreement(agreed, counts[DECISIONS] > 0, failed_ranks)

    def optimizer_step(self, step: int, due: list[tuple[str, Callable[..., Any], Any]], scheduled: int,
                       measure: Callable[[], Any], optimizer: Any) -> int:
        """One ``before_optimizer_step``: the shared measurement, the guarded checks, the planned collectives this rank
        did not reach, the agreed decision, and on a dropped step :meth:`undo`. An
        :class:`~lightning_debug.AnomalyError` leaves after the agreement.
        """
        checking = [monitor for _, _, monitor in due if monitor.schedule.is_due(scheduled)]
        self.open(step, [])
        current = self.failures.call("measuring the step", measure) if any(m.measures for m in checking) else None
        plan: list[Planned] = []
        for monitor in checking:
            if current is not None and monitor.plan_collectives is not None:
                plan += self.failures.call("planning the step's collectives", monitor.plan_collectives, current) or []
        self.open(step, plan)
        decision, failed, raised = 0, False, None
        for name, handler, monitor in due:
            try:
                result = handler(step, optimizer, measure)
            except AnomalyError as error:
                raised = raised or error
                continue
            except Exception as failure:
                self.failures.record(name, failure)
                failed = failed or monitor.decides
                continue
            if result is not None and result > decision:
                decision = int(result)
        self.close()
        if any(m.decides for m in checking) and distributed()[1] > 1:
            agreement = self.agree(decision, failed, raised is not None)
            decision = agreement.decision
            if agreement.raised and raised is None:
                raised = AnomalyError(f"lightning-debug: another rank raised at step {step} (anomaly_detection_mode="
                                      "'raise'); this rank stops with it", step, [])
        if raised is not None:
            raise raised
        if decision and self.undo(step, [monitor for _, _, monitor in due]):
            decision = DECISIONS - 1  # STOP
        return decision

    def undo(self, step: int, monitors: list[Any]) -> bool:
        """The agreed decision dropped ``step``: each deciding monitor puts back what its forward changed
        (``undo_step``), then the ranks sum whether something is still broken; if so the decision becomes STOP."""
        undoers = [m for m in monitors if m.decides and hasattr(m, "undo_step")]
        if not undoers:
            return False
        broken = False
        for monitor in undoers:
            broken = bool(self.failures.call(f"{type(monitor).__name__}.undo_step", monitor.undo_step, step)) or broken
        world = distributed()[1]
        if world > 1:
            total, _ = self.sum("buffers", lambda: torch.tensor([1.0 if broken else 0.0]), 1)
            broken = bool(total[0] > 0)
        for monitor in undoers if broken else []:
            self.failures.call(f"{type(monitor).__name__}.buffers_broken", monitor.buffers_broken, step, world)
        return broken

    def reducer(self, all_reduce: Callable[[torch.Tensor], Any] | None) -> Callable[[torch.Tensor], Any] | None:
        """``all_reduce`` (the step's shared measurement), noted in :attr:`log` as ``numerics``."""
        if all_reduce is None:
            return None

        def logged(tensor: torch.Tensor) -> Any:
            self.log.append((self.step, "numerics"))
            return all_reduce(tensor)

        return logged

    def plan_batch_end(self, monitors: list[Any], step: int, stepped: bool) -> list[Planned]:
        """The collectives the monitors plan for the end of a batch of ``step``."""
        return [planned for monitor in monitors if monitor.batch_end_collectives is not None
                for planned in self.failures.call("planning the step's collectives", monitor.batch_end_collectives,
                                                  step, stepped) or []]


WAIT_S = 60.0


class RankNotResponding(RuntimeError):
    """A rank did not reach the plugin's gather within the bounded wait."""


def bounded_wait(seconds: float = WAIT_S) -> None:
    """Wait at most ``seconds`` for every rank (gloo's ``monitored_barrier``, which names the missing ranks); a
    no-op elsewhere."""
    if distributed()[1] < 2 or dist.get_backend() != "gloo":
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as error:
        raise RankNotResponding(f"not every rank reached the end-of-run gather within {seconds:.0f} s ({error})") \
            from error


def merge_failures(own: dict[str, dict[str, Any]], gathered: list[Any], rank: int) -> dict[str, dict[str, Any]]:
    """``own`` failed checks (of rank ``rank``) with those every rank gathered, each reason prefixed with its rank.

        >>> one = {"count": 1, "first_step": 3, "last_step": 3, "reasons": {"RuntimeError: boom": 1}}
        >>> merged = merge_failures({}, [{}, {"PerformanceMonitor.batch_end": one}], 0)
        >>> merged["PerformanceMonitor.batch_end"]["ranks"], merged["PerformanceMonitor.batch_end"]["reasons"]
        ([1], {'on rank 1: RuntimeError: boom': 1})
    """
    merged: dict[str, dict[str, Any]] = {}
    per_rank = [dict(entry) if isinstance(entry, dict) else {} for entry in gathered]
    if rank < len(per_rank):
        per_rank[rank] = own
    else:
        per_rank.append(own)
    for source, failed in enumerate(per_rank):
        for name, entry in failed.items():
            if not isinstance(entry, dict):
                continue
            reasons = {f"on rank {source}: {reason}": count for reason, count in (entry.get("reasons") or {}).items()}
            into = merged.get(name)
            if into is None:
                merged[name] = dict(entry, reasons=reasons, ranks=[source])
                continue
            into["count"] = into.get("count", 0) + entry.get("count", 0)
            into["first_step"] = min(into.get("first_step", 0), entry.get("first_step", 0))
            into["last_step"] = max(into.get("last_step", 0), entry.get("last_step", 0))
            into["reasons"] = dict(into["reasons"], **reasons)
            into["ranks"] = into["ranks"] + [source]
    return merged


def gather_failures(own: dict[str, dict[str, Any]],
                    gather: Callable[[Callable[[], Any]], list[Any]]) -> list[Any] | None:
    """Every rank's failed checks (``gather``, the run's gate, after :func:`bounded_wait`); call on every rank. None
    on one process."""
    if distributed()[1] < 2:
        return None
    bounded_wait()
    return gather(lambda: own)
