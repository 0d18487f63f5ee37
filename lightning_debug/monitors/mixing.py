"""``batch_mixing``: the model's output for one sample depends, in order, on the other samples of its batch (read
once per run by :func:`lightning_debug.checks.mixing.probe` on the first training batch).

The probe is judged only where the rows of the batch are samples drawn at random: every tensor the model is given
has the training loader's batch size as its dimension 0, and the loader shuffles. A sequence-first pipeline (a
collate that puts time first) gives another dimension 0; a loader that hands consecutive records in order may be a
window of one series on purpose, which a recurrence over the rows would read. Models whose forward fails on
fewer rows (a batch size written into a ``view``) are not judged::

    >>> from lightning_debug.checks.mixing import Probe
    >>> mixed = Probe(13, mixed=True, ordered=True, row=12, from_rows=[11, 10], own=2.0, other=1.0,
    ...               output_shape=[13, 4], between=("the inputs", "`rnn` (LSTM)'s output"))
    >>> judge_mixing(mixed, 32, "LSTM").details["from_rows"]
    [11, 10]
    >>> judge_mixing(Probe(13, mixed=True, ordered=False), 32, "LSTM") is None
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from lightning_debug.checks.mixing import ROWS, Call, Measured, Probe, hookable, measure, plain, shared_rows
from lightning_debug.core.context import RunContext
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.readback import Readback
from lightning_debug.core.session import Where

RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def loader_facts(loader: Any) -> tuple[int | None, bool]:
    """The batch size of a training loader and whether it draws its records at random (a random sampler, or a
    sampler with ``shuffle=True`` such as a ``DistributedSampler``), looked for through wrappers' ``sampler``,
    ``batch_sampler`` and ``base_dataloader``::

        >>> from torch.utils.data import DataLoader
        >>> data = list(range(10))
        >>> loader_facts(DataLoader(data, batch_size=4, shuffle=True)), loader_facts(DataLoader(data, batch_size=4))
        ((4, True), (4, False))
        >>> loader_facts(None)
        (None, False)
    """
    size: int | None = None
    shuffled = False
    layer, seen = [loader], set()
    for _ in range(5):
        found = []
        for item in layer:
            if item is None or id(item) in seen:
                continue
            seen.add(id(item))
            batch_size = getattr(item, "batch_size", None)
            if size is None and isinstance(batch_size, int) and not isinstance(batch_size, bool):
                size = batch_size
            if isinstance(item, RANDOM_SAMPLERS) or getattr(item, "shuffle", None) is True:
                shuffled = True
            found += [getattr(item, name, None) for name in ("sampler", "batch_sampler", "base_dataloader")]
        layer = found
    return size, shuffled


class CallWatch:
    """Keeps the first top-level module call of one training forward (a call made while no other module runs):
    the model's forward, with the batch as it was given::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> watch = CallWatch(); watch.watch(model); _ = model(torch.ones(3, 2)); call = watch.stop()
        >>> call.module is model, call.args[0].shape
        (True, torch.Size([3, 2]))
    """

    def __init__(self) -> None:
        self.call: Call | None = None
        self._open: list[bool] = []  # per module call under way: whether it counts as one
        self._handles: list[Any] = []

    def watch(self, root: nn.Module) -> None:
        self.stop()
        self.call, self._open = None, []
        for module in hookable(root):
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call through a ``forward`` patched on the instance is a redirection, not the model's forward: under DDP
        and FSDP Lightning calls the module with the step's ``(batch, batch_idx)``, its ``forward`` set to
        ``training_step`` for that call; the step's own calls inside it are the top-level ones."""
        counts = "forward" not in vars(module)
        if counts and not any(self._open) and self.call is None and torch.is_grad_enabled():
            self.call = Call(module, args, dict(kwargs))
        self._open.append(counts)

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop()

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def stop(self) -> Call | None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.call


def unjudged(call: Call | None, batch_size: int | None, shuffled: bool) -> str | None:
    """Why the rows of the call cannot be taken for samples drawn at random (None: they can)."""
    if call is None:
        return "no module call of the training step was seen"
    if batch_size is None or batch_size < 3:
        return "the training loader's batch size is unknown (or under 3)"
    if not shuffled:
        return "the training loader does not shuffle (its rows may be one series in order)"
    arguments = (call.args, call.kwargs)
    if not plain(arguments):
        return "the model is given an object the probe cannot cut into rows"
    if shared_rows(arguments) != batch_size:
        return "not every tensor the model is given has the batch size as its dimension 0"
    if any(type(p.data) is not torch.Tensor or p.numel() == 0 for p in call.module.parameters()):
        return "the parameters are sharded or wrapped (their forward runs collectives)"
    return None


def judge_mixing(found: Probe, batch_size: int, module_type: str) -> Finding | None:
    """The ``batch_mixing`` finding of a probe, or None."""
    if not found.named:
        return None
    rows = ", ".join(str(row) for row in found.from_rows[:4])
    own = (f"{found.other / found.own:.2g} times as much as on its own input" if found.own > 0
           else "and not at all on its own input")
    return Finding(
        Kind.BATCH_MIXING, Severity.WARNING,
        f"The model mixes the samples of a batch: run in eval mode on {found.rows} rows of the first training "
        f"batch, output row {found.row} of the {module_type}'s forward depends on the inputs of rows {rows} "
        f"({own}), and shuffling the rows changes more than their order. The rows mix between {found.between[0]} "
        f"and {found.between[1]}. A model that treats samples one by one "
        "gives every other row a gradient of exactly 0: a recurrent layer with batch_first=False fed (batch, time, "
        "features) runs across the samples; a view or reshape where a transpose or permute was meant regroups "
        "values of different samples.",
        {"row": found.row, "from_rows": list(found.from_rows), "own": found.own, "other": found.other,
         "rows": found.rows, "batch_size": batch_size, "output_shape": list(found.output_shape),
         "leaves": found.leaves, "module_type": module_type, "between": list(found.between)})


class BatchMixingProbe:
    """The probe's course through a run, once: the first batch's call kept (as the adapter captured it, or through a
    :class:`CallWatch` on the model), measured at that batch's end, read back without a sync and judged by
    :meth:`poll`. ``outcome`` is what report.json says (None: not probed yet); a first batch that made no module call
    is not judged, and not watched again."""

    def __init__(self) -> None:
        self.outcome: str | None = None
        self._watch = CallWatch()
        self._given: Call | None = None
        self._measured: tuple[int, Where, int, str, Measured, Readback] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(vars(self), _watch=CallWatch(), _given=None, _measured=None)

    def batch_start(self, context: RunContext, captured: Any) -> None:
        if self.outcome is not None or self._given is not None or self._watch.watching:
            return
        given = context.forward_call(captured) if captured is not None else None
        model = context.module()
        if given is not None:
            self._given = Call(*given)
        elif model is not None:
            self._watch.watch(model)

    def batch_end(self, context: RunContext, step: int) -> None:
        if self.outcome is not None or not (self._given is not None or self._watch.watching):
            return
        call = self._given or self._watch.stop()
        self._given = self._watch.call = None
        batch_size, shuffled = loader_facts(context.train_loader())
        reason = unjudged(call, batch_size, shuffled)
        if reason is not None or call is None or batch_size is None:
            self.outcome = f"not judged: {reason}"
            return
        rows = min(ROWS, batch_size)
        try:
            with context.muted():
                measured = measure(call, rows)
        except Exception as error:
            self.outcome = f"not judged: the model's forward failed on {rows} rows ({error!r:.120})"
            return
        if measured is None:
            self.outcome = ("not judged: no output of the forward has the batch's rows with a graph, or it pairs "
                            "the rows (a similarity between the samples)")
            return
        self.outcome = "measured"
        self._measured = (step, context.where(), batch_size, type(call.module).__name__, measured,
                          Readback(measured.numbers, blocking=False))

    def poll(self, final: bool) -> tuple[Finding, int, Where] | None:
        """The finding with its step and place once the numbers are on the host (at once when ``final``)."""
        if self._measured is None or not (final or self._measured[-1].ready()):
            return None
        step, where, batch_size, module_type, measured, numbers = self._measured
        self._measured = None
        found = measured.read(numbers.values())
        finding = judge_mixing(found, batch_size, module_type)
        self.outcome = ("mixed" if finding is not None else "mixed in no order (a statistic or an attention over "
                        "the batch)" if found.mixed else "each sample's output depends on its input alone")
        return None if finding is None else (finding, step, where)

    def stop(self) -> None:
        self._watch.stop()

    def state(self) -> str | None:
        """The outcome a checkpoint keeps (a measurement not yet read is taken again after a resume)."""
        return None if self.outcome == "measured" else self.outcome
