"""``learning_stalled`` (``optimizer_not_stepping``): training batches run, none of them both runs a backward and
steps an optimizer, and the weights the optimizers hold stay bit for bit the same.

A forgotten ``optimizer.step()`` (manual optimization, a plain or an Accelerate loop) and a ``training_step`` that
forgets to return its loss (Lightning then skips the backward of every batch and steps an optimizer without
gradients) give no NaN, no error and a flat loss: "No problems found". Under Lightning the first also keeps the
optimizer-step counter at 0, so no check keyed to optimizer steps ever runs. Gradient accumulation holds the step back
by design, for a few to a few hundred micro-batches, and a backward the run cannot see (``loss.backward()`` where
``manual_backward`` is meant) still moves the weights. So :class:`Unstepped` counts the training batches since one
ran a backward and stepped an optimizer (a post-hook on each optimizer tells), keeps a sample of the weights the
optimizers hold at :data:`SAMPLE_AT` of them (a device copy, no sync; a fit without an optimizer holds none and is
not judged) and compares at :data:`JUDGE_AT`, or at the end of the run: the same bits, the optimizer is not stepping;
changed, something trains them unseen, and the rule stops for good. After batches that learned, only batches whose
backward no step follows are judged (an ``opt.step()`` under a condition that turned false): batches run forward
only then recompute statistics on purpose (Lightning's ``StochasticWeightAveraging`` gives BatchNorm a last epoch
without backward or step), and at the end the run of them must be more than :data:`LONGER` times the longest
accumulation the run completed (a manual accumulation of 128 micro-batches that the end cuts short)::

    >>> weights = [torch.nn.Parameter(torch.ones(3))]
    >>> watch = Unstepped()
    >>> [watch.batch_ended(0, lambda: weights) for _ in range(JUDGE_AT)][-1]  # no optimizer step
    True
    >>> moved = Unstepped()
    >>> for batch in range(SAMPLE_AT):
    ...     moved.backward()
    ...     _ = moved.batch_ended(7, lambda: weights)
    >>> with torch.no_grad(): _ = weights[0].add_(1.0)
    >>> [moved.batch_ended(7, lambda: weights) for _ in range(JUDGE_AT)][-1], moved.cleared
    (False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_debug.core.context import torch_optimizer
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.progress import picked_parameters, weight_sample
from lightning_debug.monitors.gradients.verdict import Verdict

SAMPLE_AT = 100
"""Training batches in a row without a backward and an optimizer step before the weights are sampled: more than any
common accumulation, so a healthy run never pays for the sample."""
JUDGE_AT = 1000
"""Such batches in a row that no accumulation reaches: the sample is compared then."""
LONGER = 2
"""How many times the run's longest completed accumulation the batches that end a run that learned must exceed."""
KEY = "optimizer_not_stepping"


class Unstepped:
    """Training batches since the last one that ran a backward and stepped an optimizer, the backward passes among
    them, and every optimizer step of the run (:meth:`watch` hooks the optimizers)."""

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.batches = self.backwards = self.optimizer_steps = 0
        self.longest = 0
        """The most batches in a row that did not learn before one that did: the run's accumulation."""
        self.step_events = 0
        """Optimizer steps the run was told of (the monitor counts them; the hooks count every one taken)."""
        self.learned = self.cleared = False
        self._backward = self._stepped = False
        self._kept: torch.Tensor | None = None
        self._handles: list[Any] = []

    def watch(self, optimizers: Iterable[Any]) -> None:
        """Count the steps of ``optimizers`` (the torch optimizer inside any wrapper) until :meth:`release`."""
        for optimizer in optimizers:
            inner = torch_optimizer(optimizer)
            if hasattr(inner, "register_step_post_hook"):
                self._handles.append(inner.register_step_post_hook(self._optimizer_stepped))

    @property
    def counted_steps(self) -> int | None:
        """Every optimizer step taken so far, or None when no optimizer could be hooked."""
        return self.optimizer_steps if self._handles else None

    def release(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True
        self.optimizer_steps += 1

    def backward(self) -> None:
        self._backward = True

    def batch_ended(self, step: int, params: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """A training batch at optimizer step ``step`` ended; True when :data:`JUDGE_AT` batches in a row without a
        backward and an optimizer step found the weights unchanged (``params``: called only to sample them)."""
        backward, stepped, self._backward, self._stepped = self._backward, self._stepped, False, False
        if self.cleared:
            return False
        if backward and stepped:
            self.longest = max(self.longest, self.batches)
            self.learned, self.first_step, self.batches, self.backwards, self._kept = True, None, 0, 0, None
            return False
        if self.first_step is None:
            self.first_step = step
        self.batches += 1
        self.backwards += backward
        if self.batches == SAMPLE_AT:
            self._kept = _sample(params())
        return self.batches == JUDGE_AT and self._judged() and self._unchanged(params)

    def at_end(self, params: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """The run ends: True when its last batches since the sample (all of them, or after batches that learned,
        those whose backward no step followed) left the weights as they were."""
        return (not self.cleared and SAMPLE_AT < self.batches < JUDGE_AT and self._judged()
                and (not self.learned or self.batches > LONGER * self.longest) and self._unchanged(params))

    def _judged(self) -> bool:
        """Whether the batches in a row are judged: any, in a run that never learned; else those most of which ran a
        backward (forward-only batches after training recompute statistics on purpose)."""
        return not self.learned or 2 * self.backwards >= self.batches

    def _unchanged(self, params: Callable[[], Sequence[torch.Tensor]]) -> bool:
        kept, self._kept = self._kept, None
        now = _sample(params()) if kept is not None else None
        same = now is not None and kept is not None and now.shape == kept.shape and bool(torch.equal(now, kept))
        self.cleared = not same
        return same


def _sample(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """:func:`~.progress.weight_sample` of the trained ``params``; None when there is nothing to compare."""
    picked = picked_parameters(params)
    sample = weight_sample(picked) if picked else None
    return sample if sample is not None and sample.numel() else None


def unstepped_verdict(step: int, watch: Unstepped, verdicts: VerdictEngine, at_end: bool) -> Verdict | None:
    """``learning_stalled`` (``optimizer_not_stepping``) once :class:`Unstepped` found the weights unchanged; the
    kind's policy confirms this variant on its one observation (the comparison is the proof)."""
    confirmed = verdicts.observe(Kind.LEARNING_STALLED, step, [Suspicion(Kind.LEARNING_STALLED, KEY, step,
                                                                         variant=KEY)], judged=[KEY])
    if not confirmed:
        return None
    batches, backwards, since = watch.batches, watch.backwards, watch.first_step
    steps = f"at optimizer step {step}" if since == step else f"from optimizer step {since} to {step}"
    ran = (f"{batches} training batches ran {steps}"
           + (" to the end of the run" if at_end and watch.learned else " for the whole run" if at_end else ""))
    unchanged = f"the weights the optimizer holds are bit for bit what they were {batches - SAMPLE_AT} batches before"
    if backwards:
        stopped = "stopped stepping" if watch.learned else "never stepped"
        message = (f"The optimizer {stopped}: {ran}, {backwards} of them a backward pass that no optimizer step "
                   f"followed; {unchanged}. Call optimizer.step() (and zero_grad()) after the backward: under "
                   "Lightning's manual optimization opt.step() after self.manual_backward(loss)"
                   + (", and look for a condition around it that turned false." if watch.learned else "."))
    else:
        message = (f"The model is not training: {ran} and none of them ran a backward pass; {unchanged}. The training "
                   "step returns no loss (a missing `return loss`), and Lightning skips the backward of a batch "
                   "without one.")
    return Verdict(Finding(Kind.LEARNING_STALLED, Severity.WARNING, message,
                           {"cause": KEY, "batches": batches, "backward_passes": backwards, "since_step": since,
                            "optimizer_steps": watch.optimizer_steps, "learned_before": watch.learned}),
                   [], key=KEY)


__all__ = ["JUDGE_AT", "SAMPLE_AT", "Unstepped", "unstepped_verdict"]
