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
accumulation the run completed (a manual accumulation of 128 micro-batches that the end cuts short).

The same hooks tell ``steps_not_counted``: weights trained while the step counter stays where it was, by an optimizer
stepped past the wrapper that counts its steps (:attr:`Unstepped.stepped_uncounted`) or by one the run was never
given, whose weights moved by :data:`MOVED_AT` batches with no hooked step (:attr:`Unstepped.trained_unseen`)::

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
MOVED_AT = 2 * SAMPLE_AT
"""Such batches in a row at one value of the step counter after which weights that moved since the sample were
trained by steps the run does not count (no accumulation moves them before its step)."""
LONGER = 2
"""How many times the run's longest completed accumulation the batches that end a run that learned must exceed."""
KEY = "optimizer_not_stepping"
UNCOUNTED = "uncounted"


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
        self.counted: int | None = None
        """The optimizer-step counter the last training batch started at."""
        self.still = 0
        """Training batches since that counter last moved."""
        self._hooked_then = self._hooked_before = self._hooked_now = 0
        self.trained_unseen = self.uncounted_named = False
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
        self._hooked_before, self._hooked_now = self._hooked_now, self.optimizer_steps
        if step != self.counted:  # ``step``: the count the batch started at, which a step in it moves next batch
            self._hooked_then = self.optimizer_steps if self.counted is not None else 0
            self.counted, self.still = step, 0
        self.still += 1
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
        if self.batches == MOVED_AT and self._kept is not None and self.still >= self.batches:
            self.trained_unseen = self.cleared = self._same(params) is False  # no counted step moved them
            return False
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

    def _same(self, params: Callable[[], Sequence[torch.Tensor]]) -> bool | None:
        """Whether the weights are bit for bit the sample kept (None: nothing to compare)."""
        now = _sample(params()) if self._kept is not None else None
        if now is None or self._kept is None:
            return None
        return now.shape == self._kept.shape and bool(torch.equal(now, self._kept))

    def _unchanged(self, params: Callable[[], Sequence[torch.Tensor]]) -> bool:
        same = self._same(params)
        self._kept = None
        self.cleared = not same
        self.trained_unseen = same is False and self.still >= self.batches
        return bool(same)

    @property
    def stepped_uncounted(self) -> bool:
        """Whether the hooked optimizers stepped in the last :data:`SAMPLE_AT` batches or more, before the latest one,
        while the step counter stayed where it was (no accumulation holds the counter back once the optimizer
        stepped)."""
        return self.still >= SAMPLE_AT and self._hooked_before > self._hooked_then

    @property
    def uncounted_steps(self) -> int:
        """The hooked optimizers' steps since the step counter last moved."""
        return self.optimizer_steps - self._hooked_then


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


def uncounted_verdict(step: int, watch: Unstepped, verdicts: VerdictEngine) -> Verdict | None:
    """``steps_not_counted``, once a run: the weights are trained while the optimizer-step counter stays at ``step``,
    stepped by a hooked optimizer past its wrapper (:attr:`Unstepped.stepped_uncounted`) or by one the run was never
    given (:attr:`Unstepped.trained_unseen`: the weights changed over batches that stepped no hooked optimizer)."""
    if watch.uncounted_named or not (watch.stepped_uncounted or watch.trained_unseen):
        return None
    watch.uncounted_named = True
    if not verdicts.observe(Kind.STEPS_NOT_COUNTED, step, [Suspicion(Kind.STEPS_NOT_COUNTED, UNCOUNTED, step)]):
        return None
    steps = watch.uncounted_steps
    if watch.stepped_uncounted:
        how = (f"the optimizer stepped {steps} times in them, past the wrapper that counts its steps "
               "(self.optimizers(use_pl_optimizer=False), opt.optimizer.step(), an optimizer from trainer.optimizers "
               "stepped by hand)")
    else:
        how = ("the weights the optimizers hold changed although none of them stepped: an optimizer made outside "
               "configure_optimizers (in training_step) or weights updated by hand train them")
    message = (f"The optimizer steps are not counted: {watch.still} training batches ran at optimizer step {step} and "
               f"{how}. Everything keyed to optimizer steps stops: max_steps is never reached (with max_epochs unset "
               "the fit never ends), checkpoints every_n_train_steps are never saved, step-interval schedulers never "
               "step, and the checks made before an optimizer step never run. Return the optimizer from "
               "configure_optimizers and step the object self.optimizers() returns.")
    return Verdict(Finding(Kind.STEPS_NOT_COUNTED, Severity.WARNING, message,
                           {"step": step, "batches": watch.still, "optimizer_steps": steps,
                            "cause": "stepped_past_wrapper" if watch.stepped_uncounted else "trained_unseen"}),
                   [], key=UNCOUNTED)


__all__ = ["JUDGE_AT", "SAMPLE_AT", "Unstepped", "uncounted_verdict", "unstepped_verdict"]
