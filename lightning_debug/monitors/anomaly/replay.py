"""When to replay a non-finite step, over which micro-batches, and which rank's cause the findings name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_debug.checks.localize import Cause, CauseSite, localize
from lightning_debug.core.kinds import Kind
from lightning_debug.core.monitor import Replay
from lightning_debug.monitors.anomaly.collectives import ReplayCollectives
from lightning_debug.monitors.anomaly.prose import (
    NO_BATCH_CAPTURED,
    backward_left_out,
    outside_the_replay,
    replay_failed,
)

EPISODE_KINDS = (Kind.NONFINITE_LOSS.value, Kind.NONFINITE_GRAD.value)
Captured = tuple[Any, Any]  # (the micro-batch as the adapter captured it, the RNG state at its start)


def replays_for_free(model: torch.nn.Module) -> bool:
    """Whether the defaults replay a NaN's first step too, as ``level=ADVANCED`` does: when every parameter lives on
    the host. There the step's numbers are read in the step at no cost (a "sync" with the CPU waits for nothing),
    and keeping the micro-batch and RNG state until the next step holds no device memory. On an accelerator the
    defaults read the numbers a step late instead (no sync, the batch freed), so the parameters a replay needs are
    already updated: the cause is named from ADVANCED, or in ``skip``/``raise``/``stop`` mode at that level::

        >>> replays_for_free(torch.nn.Linear(2, 1)), replays_for_free(torch.nn.Linear(2, 1, device="meta"))
        (True, False)
    """
    return all(parameter.device.type == "cpu" for parameter in model.parameters())


def wants_replay(loss_ranks: Sequence[int], grad_ranks: Sequence[int], uses_grad_scaler: bool,
                 open_kinds: Iterable[str]) -> bool:
    """Whether to replay: the first step of an episode of non-finite loss or gradients (not a GradScaler's overflow)::

        >>> wants_replay([0], [], False, []), wants_replay([], [0], True, []), wants_replay([0], [0], False, ["nonfinite_loss"])
        (True, False, False)
    """
    if not (loss_ranks or grad_ranks) or (uses_grad_scaler and not loss_ranks):
        return False
    return not any(kind in EPISODE_KINDS for kind in open_kinds)


def replay_each(model: torch.nn.Module, inputs: Sequence[Captured], replay: Replay, same_work: bool) -> list[Cause]:
    """Replay the step's micro-batches until one names a cause (all of them with ``same_work``); one whose forward
    dispatched a collective gets no backward replay::

        >>> model = torch.nn.Linear(2, 1)
        >>> batch = torch.tensor([[1.0, float("nan")]])
        >>> [cause.where.value for cause in replay_each(model, [(batch, None)], lambda b: model(b).sum(), False)]
        ['inputs']
    """
    causes: list[Cause] = []
    for captured, rng in inputs:
        watch = ReplayCollectives()
        try:
            with watch:
                cause = localize(model, captured, watch.wrap(lambda captured=captured: replay(captured)), rng,
                                 check_backward=True, same_work=same_work)
        except Exception as error:
            cause = Cause(CauseSite.ERROR, replay_failed(error))
        if watch.backward_left_out and not cause.where.names_a_cause:
            cause = Cause(CauseSite.NOT_REPRODUCED, backward_left_out(watch.seen), replay_ms=cause.replay_ms,
                          outputs={"collectives": list(watch.seen)})
        causes.append(cause)
        if cause.where.names_a_cause and not same_work:
            break
    return causes


def own_cause(causes: Sequence[Cause], outside: str | None) -> Cause:
    """This rank's cause: the first that names one; ``outside`` (what the replay does not cover, e.g. the loss
    function) explains a NaN the replayed model did not reproduce::

        >>> causes = [Cause(CauseSite.NOT_REPRODUCED, "finite", replay_ms=2.0), Cause(CauseSite.INPUTS, "bad", replay_ms=3.0)]
        >>> own = own_cause(causes, None)
        >>> own.where.value, own.replay_ms
        ('inputs', 5.0)
        >>> own_cause([], None).summary
        'no batch was captured for this step'
    """
    found = [c for c in causes if c.where.names_a_cause]
    own = (found or causes or [Cause(CauseSite.NOT_REPRODUCED, NO_BATCH_CAPTURED)])[0]
    if outside and own.where is CauseSite.NOT_REPRODUCED:
        own = Cause(CauseSite.NOT_REPRODUCED, outside_the_replay(outside), replay_ms=own.replay_ms)
    own.replay_ms = sum(c.replay_ms for c in causes)
    return own


def across_ranks(own: Cause, gathered: Sequence[dict[str, Any] | None], origin: Sequence[int] = ()) -> Cause:
    """The cause every rank names: that of the first rank in ``origin`` (whose own loss or gradients were non-finite)
    that reproduced the NaN. A rank that had no NaN can "reproduce" one only by accident (a kernel's
    non-determinism), so its cause is never the one named; without ``origin`` every rank counts::

        >>> gathered = [Cause(CauseSite.NOT_REPRODUCED, "finite").to_dict(), Cause(CauseSite.INPUTS, "bad").to_dict()]
        >>> cause = across_ranks(Cause.from_dict(gathered[0]), gathered)
        >>> cause.where.value, cause.summary, cause.outputs["per_rank"]
        ('inputs', 'on rank 1: bad', {0: 'finite', 1: 'bad'})
        >>> across_ranks(Cause.from_dict(gathered[1]), gathered, origin=[0]).summary
        'on rank 0: finite'
    """
    ranks = [rank for rank in origin if 0 <= rank < len(gathered) and gathered[rank]] or \
        [rank for rank, c in enumerate(gathered) if c]
    reproduced = [rank for rank in ranks if CauseSite(gathered[rank]["where"]).names_a_cause]  # type: ignore[index]
    chosen = reproduced[0] if reproduced else ranks[0] if ranks and origin else None
    if chosen is not None:
        own = Cause.from_dict(gathered[chosen])  # type: ignore[arg-type]
        own.summary = f"on rank {chosen}: {own.summary}"
    own.outputs = dict(own.outputs, per_rank={rank: (c or {}).get("summary") for rank, c in enumerate(gathered)})
    return own


def replay_step(model: torch.nn.Module, inputs: Sequence[Captured], replay: Replay, distributed: bool,
                replay_scope: Callable[[], str | None], origin: Sequence[int], on_failure: Callable[[Exception], None],
                gather: Callable[[Callable[[], Any]], list[Any]]) -> Cause:
    """Localize a step: every rank replays with the same calls, then the causes are gathered whatever failed here."""
    try:
        causes = replay_each(model, inputs, replay, same_work=distributed)
        own = own_cause(causes, replay_scope() if causes else None)
    except Exception as error:  # still join the gather below
        own = Cause(CauseSite.ERROR, replay_failed(error))
        on_failure(error)
    return across_ranks(own, gather(own.to_dict), origin) if distributed else own
