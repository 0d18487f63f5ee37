"""The current step's shared gradient pass, the parameter indexes, and the read-backs still pending.

Example::

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(2, 1)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> queue = NumericsQueue()
    >>> numerics = queue.get(0, model.named_parameters, None)
    >>> queue.get(0, model.named_parameters, None) is numerics, queue.pending
    (True, True)
    >>> queue.poll(final=True); queue.pending
    False
    >>> queue.close()  # the run's end: the process-wide registration hooks are released
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_debug.core.gate import distributed
from lightning_debug.core.ledger import RunLedger
from lightning_debug.core.numerics.index import (
    AllReduce,
    Lease,
    ParameterIndex,
    registration_count,
    signature,
    watch_model,
    watch_registrations,
)
from lightning_debug.core.numerics.step import Observed, StepNumerics

MAX_PENDING_READBACKS = 4


class NumericsQueue:
    """The current step's :class:`StepNumerics`, computed by the first check that asks and shared by the rest, the
    parameter indexes, and the steps waiting for their values (past ``max_pending``, the oldest is read with a sync).
    """

    def __init__(self, max_pending: int = MAX_PENDING_READBACKS, ledger: RunLedger | None = None) -> None:
        self.max_pending = max_pending
        self.ledger = ledger if ledger is not None else RunLedger()
        self.param_norms_wanted: list[Callable[[int], bool]] = []  # weight logging, update ratios
        self.replicas_wanted: list[Callable[[int], bool]] = []
        self._observed: tuple[int, Observed] | None = None
        self._current: StepNumerics | None = None
        self._pending: list[StepNumerics] = []
        self._indexes: dict[Any, tuple[int, Any, ParameterIndex]] = {}
        self.flags_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._lease: Lease | None = None  # taken with the first index: a run built and never started holds nothing

    def close(self) -> None:
        """The run ended: let the process-wide registration hooks go (an index asked for later holds them again)."""
        if self._lease is not None:
            self._lease.release()

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far: which update a late parameter scan sees."""
        return self.ledger.record.steps_done

    @property
    def optimizer_step(self) -> int | None:
        """With several optimizers, the steps the one being stepped took before this one; else None."""
        return self.ledger.record.optimizer_step

    @property
    def several_optimizers(self) -> bool:
        return self.ledger.record.several_optimizers

    def observed(self, step: int) -> Observed:
        """What has been observed of optimizer step ``step`` so far (an earlier step's is dropped)."""
        if self._observed is None or self._observed[0] != step:
            self._observed = (step, Observed())
        return self._observed[1]

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        """Add a micro-batch loss to this optimizer step's (no sync)."""
        self.observed(step).add_loss(loss)

    def observe_batch(self, step: int, fingerprint: torch.Tensor) -> None:
        """Add a micro-batch's fingerprint to this optimizer step's, for the ranks to compare (no sync)."""
        self.observed(step).add_batch(fingerprint)

    def observe_inputs(self, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Add a micro-batch's floating tensors to this step's NaN/Inf test (no sync)."""
        self.observed(step).add_inputs(tensors)

    def observe_buffers(self, step: int, high: torch.Tensor | None) -> None:
        """The largest magnitude over the buffers after this step's forward (the last counts: a NaN/Inf stays)."""
        if high is not None:
            self.observed(step).buffer_high = high

    def index(self, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]],
              optimizer: Any = None, rebuild: bool = False, plain_sharded: bool = False) -> ParameterIndex:
        """The :class:`ParameterIndex` of the model, or of the parameters ``optimizer`` owns: a use compares the count
        of registrations (and the param group sizes); when either moved, and every ``REQUIRES_GRAD_RECHECK`` uses, the
        model is walked and compared with the index's ``signature``; only a real change rebuilds it.
        """
        if self._lease is None or not self._lease.held:
            self._lease = watch_registrations()
        count = registration_count()
        if optimizer is None:
            key: Any = ("model", plain_sharded)
            layout: Any = None
        else:
            key = ("optimizer", id(optimizer), plain_sharded)
            layout = (optimizer, tuple(len(group["params"]) for group in optimizer.param_groups))
        cached = self._indexes.get(key)
        if not rebuild and cached is not None:
            if cached[0] == count and cached[1] == layout and not cached[2].recheck_due():
                return cached[2]
            named = self._named(named_parameters, optimizer)
            if signature(named) == cached[2].signature:
                self._indexes[key] = (count, layout, cached[2])
                return cached[2]
        else:
            named = self._named(named_parameters, optimizer)
        if len(self._indexes) > 8:
            self._indexes.clear()
        index = ParameterIndex(named, distributed()[0], plain_sharded)
        watch_model(_model_of(named_parameters))
        self._indexes[key] = (count, layout, index)
        return index

    @staticmethod
    def _named(named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]],
               optimizer: Any) -> list[tuple[str, nn.Parameter]]:
        named = list(named_parameters())
        if optimizer is not None:
            position = {id(p): name for name, p in named}
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            named = [(position.get(id(p), f"parameter {i}"), p) for i, p in enumerate(owned)]
        return named

    def scheduled_step(self, step: int) -> int:
        """The step a check's frequency counts: ``step``, or with several optimizers :attr:`optimizer_step`."""
        return step if self.optimizer_step is None else self.optimizer_step

    def get(self, step: int, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]],
            all_reduce: AllReduce | None, grad_scale: torch.Tensor | None = None,
            optimizer: Any = None, plain_sharded: bool = False) -> StepNumerics:
        """This step's :class:`StepNumerics` (one fused pass, one collective, whoever asks first)."""
        if self._current is None or self._current.step != step:
            index = self.index(named_parameters, optimizer, plain_sharded=plain_sharded)
            gradients: tuple[list[torch.Tensor], list[int]] | None = None
            try:  # a failure here is flagged inside StepNumerics, which still joins the collective
                gradients = index.local_grads()
                if gradients[1] and not all(index.params[i].requires_grad for i in gradients[1]):  # frozen since built
                    index = self.index(named_parameters, optimizer, rebuild=True, plain_sharded=plain_sharded)
                    gradients = index.local_grads()
            except Exception:
                gradients = None
            wanted = any(wants(step) for wants in self.param_norms_wanted)
            replicas = any(wants(step) for wants in self.replicas_wanted)
            observed = self._observed[1] if self._observed is not None and self._observed[0] == step else None
            self._observed = None
            self._current = StepNumerics(step, index, observed, all_reduce, grad_scale, wanted, gradients, replicas)
            self._current.steps_done = lambda: self.steps_done
            self._current.flags_sum = self.flags_sum
            self._pending.append(self._current)
        return self._current

    def poll(self, final: bool = False) -> None:
        """Stage pending measurements for read-back and deliver those whose copy has completed."""
        for numerics in self._pending:
            numerics.stage(blocking=False)
        while self._pending and (final or self._pending[0].ready() or len(self._pending) > self.max_pending):
            self._pending.pop(0).deliver()

    @property
    def pending(self) -> bool:
        """Whether a measurement waits for its values to reach the host."""
        return bool(self._pending)

    @property
    def oldest_pending_step(self) -> int | None:
        return self._pending[0].step if self._pending else None


def _model_of(named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]]) -> nn.Module | None:
    """The module whose ``named_parameters`` this is, so only registrations into it count; None when unknown."""
    owner = getattr(named_parameters, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    module = getattr(owner, "module", None)
    found = module() if callable(module) else None
    return found if isinstance(found, nn.Module) else None
