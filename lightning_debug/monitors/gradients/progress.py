"""``learning_stalled`` at a learning rate above 0: the weights barely move and the loss does not fall.

A learning rate far too small (1e-6 where 1e-2 was meant) trains nothing, with no NaN and a loss that looks merely
flat. On check steps at least :data:`SAMPLE_EVERY` apart, :class:`WeightDrift` measures how far a fixed sample of
the trained weights moved per step, relative to their size (device work, read back without a sync). Healthy
look-alikes are ruled out by the conditions of :func:`judge_progress` (docs/gradients.md lists them): a converged
model's loss fell, a warm-up's start or a decay's end is under :data:`SCHEDULE_SHARE` of the base, a resumed run
has no first loss to compare with. Not ruled out: fine-tuning with a small learning rate on data already fitted::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> engine = VerdictEngine()
    >>> drift = Drift(moved=1e-7 * 100 * 5.0, size=5.0, steps=100)  # 1e-7 of the weights per step
    >>> [judge_progress(step, drift, 1.39, 1.40, [(1e-6, 1e-6)], engine, 400) is not None for step in (100, 200, 300)]
    [False, False, True]
    >>> converged = VerdictEngine()  # the same drift, after the loss fell from 1.4 to 0.01
    >>> [judge_progress(step, drift, 0.01, 1.40, [(0.05, 0.05)], converged, 400) for step in (100, 200, 300)]
    [None, None, None]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_debug.checks.numerics import local_tensor
from lightning_debug.checks.tensors import real_values
from lightning_debug.core.findings import Finding
from lightning_debug.core.context import torch_optimizer
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.readback import Readback
from lightning_debug.core.rules import CheckRead, Moment, rule
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.stalled import END_SHARE, base_lr
from lightning_debug.monitors.gradients.verdict import Verdict

SAMPLE_EVERY = 100
"""Optimizer steps at least between two samples of the weights (with checks every step, one in 100 is measured)."""
SAMPLED_PARAMETERS = 64
SAMPLED_VALUES = 4096
NEGLIGIBLE_DRIFT = 1e-5
"""Relative weight change per step under which nothing is learnt (healthy: ~1e-3; the loss tells a converged model)."""
PROGRESS = 0.1
"""The share by which the loss must have fallen since the first check step for a run to be making progress."""
SCHEDULE_SHARE = 0.1
"""A learning rate under this share of its base is a warm-up's start or a decay's end, not judged."""
MIN_STEPS = 100
"""Steps before the rule judges: a loss within 10% of its start after a few steps is the norm, not a stall."""
STILL_FALL = 10.0
"""Weights bit for bit the same are judged while the loss has not fallen this many times below the first check's:
no small learning rate leaves every sampled value as it was, but a model trained to a loss near 0 under plain SGD
takes steps below its weights' precision (the loss of single batches moves far more than 10% either way)."""
EPS_OVER_GRADIENT = 10.0
"""Adam's ``eps`` above this many times a value's gradient scale (the root of its bias-corrected ``exp_avg_sq``) is
the denominator of that value's update: the step is ``lr * m / eps``, a tenth of Adam's or less."""
EPS_SHARE = 0.9
"""The share of the sampled values with a gradient whose update ``eps`` bounds so for Adam's scaling to be lost: with
``eps=1e-8`` none is (a gradient scale of 1e-9 is a value barely ever used); with ``eps=1`` all are."""
BOUNDED_PROGRESS = 0.5
"""The share of the first check step's loss that a run whose updates ``eps`` bounds must get under to count as
learning: with Adam's scaling lost, learning at a tenth of its pace or less is the finding (``Adam(lr=1e-3, eps=1)``
on four blobs: 75% of its first loss at step 300, 0.1% with the default eps), not only a loss that stays put. Not
ruled out: a fresh run on data the model already fits, whose gradients are under a tenth of ``eps`` from the start."""
COARSE_EPS = 1e-4
"""Weights of a dtype whose epsilon is above this (bfloat16 7.8e-3, float16 9.8e-3) round away an update under half
their spacing: a float32 weight keeps any update above 6e-8 of itself."""
UNCHANGED_SHARE = 0.9
"""The share of the sampled values of such weights bit for bit the same over a sample's span for the updates to be
rounded away: a run that learns changes nearly every value in 100 steps, even in bfloat16."""
KEY = "negligible_updates"


@dataclass(frozen=True)
class Drift:
    """How far the sampled weights moved (``moved``, a norm) over ``steps`` optimizer steps, against their ``size``."""

    moved: float
    size: float
    steps: int
    taken: int | None = None
    """Optimizer steps the run's hooks counted over the window (None: not counted); 0: no step moved anything, which
    is ``optimizer_not_stepping``'s to judge, not a learning rate's."""
    lrs_before: tuple[Any, ...] = ()
    """Each trained param group's learning rate at the window's start (where a warm-up's pace is read)."""
    eps: float | None = None
    """The largest ``eps`` of the Adam-like groups sampled (None: no such group)."""
    eps_bound: float | None = None
    """The share of their sampled values with a gradient whose update ``eps`` bounds (:data:`EPS_OVER_GRADIENT`)."""
    unchanged: float | None = None
    """The share of the sampled values bit for bit the same as at the window's start."""
    coarse: str | None = None
    """The sampled weights' dtype where it rounds away small updates (:data:`COARSE_EPS`), else None."""

    @classmethod
    def read(cls, values: Sequence[float], steps: int, taken: int | None, lrs_before: tuple[Any, ...],
             eps: float | None, coarse: str | None = None) -> Drift:
        """The drift of :meth:`WeightDrift.measure`'s read-back ``values`` (moved, size, unchanged share[, bounded,
        with a gradient])."""
        bounded = values[3] / values[4] if eps is not None and len(values) > 4 and values[4] > 0 else None
        return cls(values[0], values[1], steps, taken, lrs_before, eps if bounded is not None else None, bounded,
                   values[2] if len(values) > 2 else None, coarse)

    @property
    def per_step(self) -> float:
        """The relative change per optimizer step (``inf`` when it cannot be told)."""
        if not (self.size > 0 and self.steps > 0 and math.isfinite(self.moved)):
            return math.inf
        return self.moved / self.size / self.steps


def picked_parameters(params: Sequence[Any]) -> list[Any]:
    """Up to :data:`SAMPLED_PARAMETERS` trained tensors of ``params``, spread over the model::

        >>> frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
        >>> len(picked_parameters([torch.nn.Parameter(torch.ones(3)), frozen]))
        1
    """
    trained = [p for p in params if p.requires_grad and p.numel() > 0]
    return trained[::max(1, len(trained) // SAMPLED_PARAMETERS)][:SAMPLED_PARAMETERS]


def weight_sample(picked: Sequence[Any]) -> torch.Tensor:
    """A copy of up to :data:`SAMPLED_VALUES` values of each of ``picked`` (this rank's block of a sharded one)::

        >>> weight_sample([torch.nn.Parameter(torch.arange(3.0))])
        tensor([0., 1., 2.])
    """
    with torch.no_grad():
        return torch.cat([real_values(local_tensor(p))[:SAMPLED_VALUES].float() for p in picked])


def eps_bound(picked: Sequence[Any], optimizers: Sequence[Any]) -> tuple[list[torch.Tensor], float] | None:
    """Over the sampled values of ``picked`` that an Adam-like group of ``optimizers`` steps (an ``eps``, ``betas`` and
    an ``exp_avg_sq`` state), how many have an update bounded by ``eps`` (:data:`EPS_OVER_GRADIENT`) and how many
    have any gradient (device scalars: no sync, and no copy to the device; the values of one ``eps``, step count and
    device are read together), with the largest ``eps``; None where no group is Adam-like::

        >>> weight = torch.nn.Parameter(torch.ones(4))
        >>> adam = torch.optim.Adam([weight], eps=1.0)
        >>> weight.grad = torch.full((4,), 1e-3); adam.step()
        >>> counts, eps = eps_bound([weight], [adam])
        >>> [int(count) for count in counts], eps
        ([4, 4], 1.0)
    """
    groups = {id(p): (group, torch_optimizer(optimizer).state) for optimizer in optimizers
              for group in torch_optimizer(optimizer).param_groups for p in group.get("params", ())}
    samples: dict[tuple[float, Any, torch.device], tuple[Any, list[torch.Tensor]]] = {}
    for p in picked:
        group, state = groups.get(id(p), ({}, {}))
        held = state.get(p, {}) if isinstance(state, Mapping) else {}
        square, count = held.get("exp_avg_sq"), held.get("step")
        eps, betas = group.get("eps"), group.get("betas")
        if not (isinstance(square, torch.Tensor) and square.shape == p.shape and count is not None
                and isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0
                and isinstance(betas, (tuple, list)) and len(betas) == 2):
            continue
        on_host = not isinstance(count, torch.Tensor) or count.device.type == "cpu"
        correction = 1 - betas[1] ** (float(count) if on_host else count.float())
        values = real_values(local_tensor(square))[:SAMPLED_VALUES].float()
        key = (float(eps), correction if on_host and isinstance(correction, float) else id(count), values.device)
        samples.setdefault(key, (correction, []))[1].append(values)
    if not samples:
        return None
    bounded: list[torch.Tensor] = []
    present: list[torch.Tensor] = []
    for (eps, _, _), (correction, squares) in samples.items():
        scale = (torch.cat(squares) / correction).sqrt()
        bounded.append(((scale > 0) & (scale * EPS_OVER_GRADIENT < eps)).sum().float())
        present.append((scale > 0).sum().float())
    device = bounded[0].device
    return ([sum((count.to(device) for count in bounded[1:]), bounded[0]),
             sum((count.to(device) for count in present[1:]), present[0])], max(key[0] for key in samples))


class WeightDrift:
    """A sample of the trained weights kept from one check step to the next, and the loss of the first one::

        >>> weights = [torch.nn.Parameter(torch.ones(10))]
        >>> drift = WeightDrift()
        >>> drift.measure(0, weights) is None
        True
        >>> with torch.no_grad(): _ = weights[0].add_(0.01)
        >>> moved, steps, taken, lrs_before, eps, coarse = drift.measure(100, weights)
        >>> round(moved.values()[0], 4), moved.values()[2], steps, taken, lrs_before, eps, coarse
        (0.0316, 0.0, 100, None, (), None, None)
    """

    def __init__(self) -> None:
        self._params: Sequence[Any] | None = None
        self._picked: list[Any] = []
        self._kept: torch.Tensor | None = None
        self._step = -1
        self._taken: int | None = None
        self._lrs: tuple[Any, ...] = ()
        self.first_loss: float | None = None
        self.first_step: int | None = None

    def measure(self, step: int, params: Sequence[Any], taken: int | None = None,
                lrs: Sequence[Any] = (), optimizers: Sequence[Any] = ()
                ) -> tuple[Readback, int, int | None, tuple[Any, ...], float | None, str | None] | None:
        """Keep this check step's sample and learning rates; a read-back of (moved, size, the share unchanged[,
        :func:`eps_bound`'s counts]), the optimizer steps since the last one, those the hooks counted in between
        (``taken``: the hooks' count so far, None when they do not count), the learning rates of the last one, the
        largest ``eps`` and the weights' dtype where it is coarse (:data:`COARSE_EPS`)."""
        if params is not self._params:
            self._params, self._kept = params, None
            self._picked = picked_parameters(params)
        if not self._picked or (self._kept is not None and 0 <= step - self._step < SAMPLE_EVERY):
            return None
        with torch.no_grad():
            sample = weight_sample(self._picked)
            kept, self._kept = self._kept, sample
            steps, self._step = step - self._step, step
            counted, self._taken = self._taken, taken
            before, self._lrs = self._lrs, tuple(lrs)
            if kept is None or kept.shape != sample.shape or steps <= 0:
                return None
            bound = eps_bound(self._picked, optimizers)
            moved = torch.stack([(sample - kept).norm(), kept.norm(), (sample == kept).float().mean(),
                                 *(bound[0] if bound else ())])
        dtypes = {p.dtype for p in self._picked if p.is_floating_point()}
        coarse = max(dtypes, key=lambda dtype: torch.finfo(dtype).eps) if dtypes else None
        return (Readback(moved, blocking=False), steps, None if taken is None or counted is None else taken - counted,
                before, bound[1] if bound else None,
                str(coarse).removeprefix("torch.") if coarse is not None and torch.finfo(coarse).eps > COARSE_EPS
                else None)

    def reference(self, step: int, loss: float) -> float | None:
        """The loss of the run's first check step (step 0 of a fresh run; None for a resumed one)."""
        if self.first_step is None:
            self.first_step = step
            self.first_loss = loss if step == 0 and math.isfinite(loss) else None
        return self.first_loss


CLIP_CUT = 100.0
"""Clipping that shrinks the gradients read at least this many times is what makes the steps negligible, not the
learning rate."""


SCALE_FREE_KEYS = ("betas", "alpha", "lr_decay", "rho")
"""Param-group settings of optimizers whose step divides by the gradients' own scale (Adam and its kin, Lion:
``betas``; RMSprop: ``alpha``; Adagrad: ``lr_decay``; Adadelta: ``rho``): clipping the norm barely changes their step."""


def clip_cut(clipping: tuple[float, str] | None, norm: float, groups: Sequence[Mapping[str, Any]]) -> float | None:
    """How many times the clipping applied after the checks at least shrinks gradients of global ``norm``, where that
    is :data:`CLIP_CUT` or more and shrinks the steps with them (else None): clipping the norm to ``value`` cuts it
    ``norm / value`` times, clipping each value to ``value`` leaves at most ``value * sqrt(n)`` of ``n`` trained
    values; a group of an optimizer that divides by the gradients' scale (:data:`SCALE_FREE_KEYS`) steps as far::

        >>> clip_cut((1e-4, "norm"), 2.0, []), clip_cut((1.0, "norm"), 2.0, []), clip_cut(None, 2.0, [])
        (20000.0, None, None)
        >>> import torch
        >>> clip_cut((1e-6, "value"), 2.0, [{"params": [torch.zeros(100, requires_grad=True)]}])
        200000.0
        >>> clip_cut((1e-4, "norm"), 2.0, [{"params": [torch.zeros(1)], "betas": (0.9, 0.999)}]) is None  # Adam
        True
    """
    if clipping is None or not (math.isfinite(norm) and norm > 0) or not clipping[0] > 0:
        return None
    if any(key in group for group in groups if group.get("params") for key in SCALE_FREE_KEYS):
        return None
    value, algorithm = clipping
    cap = value if algorithm == "norm" else value * math.sqrt(max(1, sum(
        p.numel() for group in groups for p in group.get("params", []) if getattr(p, "requires_grad", False))))
    return round(norm / cap, 6) if norm >= CLIP_CUT * cap else None


def judge_progress(step: int, drift: Drift | None, loss: float, first_loss: float | None,
                   lrs: Sequence[tuple[Any, Any]], verdicts: VerdictEngine, total_steps: int | None,
                   clipped: tuple[float, str, float] | None = None) -> Verdict | None:
    """``learning_stalled`` (``negligible_updates``) at check step ``step``: ``drift`` since the previous check step
    (None: not measured, nothing judged), this step's ``loss`` against ``first_loss``, ``lrs`` (learning rate, base)
    per param group; ``clipped``: the clipping's value, algorithm and :func:`clip_cut` where it cuts the gradients
    :data:`CLIP_CUT` times or more. See the module's docstring."""
    if drift is None or first_loss is None or drift.taken == 0:
        return None
    plain = all(isinstance(lr, (int, float)) and isinstance(base, (int, float)) for lr, base in lrs)
    before = drift.lrs_before if len(drift.lrs_before) == len(lrs) else (None,) * len(lrs)
    endless = [endless_warm_up(lr, was, base, step, drift.steps, total_steps) if plain else None
               for (lr, base), was in zip(lrs, before)]
    scheduled = plain and bool(lrs) and all(lr > 0 and (lr >= SCHEDULE_SHARE * base or reach is not None)
                                            for (lr, base), reach in zip(lrs, endless))
    warm_up = max((reach for reach in endless if reach is not None), default=None)
    far_from_end = total_steps is None or step < END_SHARE * total_steps
    flat = loss >= (1 - PROGRESS) * first_loss
    slow = drift.per_step < NEGLIGIBLE_DRIFT and flat
    still = drift.moved == 0 and STILL_FALL * loss >= first_loss > 0
    bounded = (drift.eps is not None and drift.eps_bound is not None and drift.eps_bound >= EPS_SHARE
               and loss >= BOUNDED_PROGRESS * first_loss)
    rounded = drift.coarse is not None and drift.unchanged is not None and drift.unchanged >= UNCHANGED_SHARE and flat
    suspect = (step >= MIN_STEPS and scheduled and far_from_end and math.isfinite(loss)
               and (slow or still or bounded or rounded))
    measured = {"per_step": drift.per_step, "loss": loss}
    confirmed = verdicts.observe(Kind.LEARNING_STALLED, step,
                                 [Suspicion(Kind.LEARNING_STALLED, KEY, step, measured=measured)] if suspect else [],
                                 judged=[KEY])
    if not confirmed:
        return None
    since = confirmed[0].first.step
    rates = sorted({float(lr) for lr, _ in lrs})
    shown = ", ".join(f"{lr:g}" for lr in rates)
    if rounded and not slow and not still:
        what = (f"the weights are {drift.coarse} and {drift.unchanged:.0%} of the sampled values did not change at "
                f"all over {drift.steps} optimizer steps at learning rate {shown}, and the loss ({loss:.4g}) is where "
                f"it started ({first_loss:.4g})")
        cause = (f"Each update is under half the spacing of {drift.coarse} values next to the weight it is added to, "
                 "so it is rounded away: keep the weights in float32 and compute in low precision (Lightning's "
                 "precision='bf16-mixed' rather than 'bf16-true'), or raise the learning rate.")
    elif bounded and not slow and not still:
        what = (f"Adam's eps ({drift.eps:g}) is over {EPS_OVER_GRADIENT:g} times the gradient scale it is added to "
                f"(the root of the bias-corrected exp_avg_sq) for {drift.eps_bound:.0%} of the sampled weights, so "
                f"each update is lr * exp_avg / eps, not about lr: the weights move by {drift.per_step:.1e} of their "
                f"size per step at learning rate {shown}, and the loss ({loss:.4g}) has not fallen to half of where it "
                f"started ({first_loss:.4g})")
        cause = "Adam's eps is far too large for these gradients (its default is 1e-8; a value from another " \
                "library's convention, or a typo): lower it, or raise the learning rate with it."
    elif drift.per_step > 0:
        what = (f"the weights move by {drift.per_step:.1e} of their size per step (a healthy step moves them by about "
                f"1e-3) at learning rate {shown}, and the loss ({loss:.4g}) is where it started ({first_loss:.4g})")
        cause = "The learning rate is far too small for this model: raise it (often 100x-1000x; a learning-rate " \
                "finder helps), unless a clipping the run does not see (clip_grad_norm_ in a hook of your own) cuts " \
                "the gradients far below their norm before the step."
        if clipped is not None:
            value, algorithm, cut = clipped
            what += f"; the gradients are clipped after the checks read them, which cuts them at least {cut:.3g}x"
            by_value = "" if algorithm == "norm" else ", gradient_clip_algorithm='value'"
            cause = (f"Gradient clipping cuts every step as a learning rate {cut:.3g} times lower would: the "
                     f"{'norm' if algorithm == 'norm' else 'values'} clipped to {value:g} "
                     f"(Trainer(gradient_clip_val={value:g}{by_value}) or clip_grad_*_ in the loop) under gradients "
                     "far larger. Raise the clipping value to about the gradients' usual norm, or remove it.")
        elif warm_up is not None:
            what += (f"; it rises as a warm-up does, but at this pace it reaches only {warm_up:.2g} of its base "
                     f"by the run's end (step {total_steps})")
            cause = ("The warm-up is far longer than the run (a length in samples or epochs where steps were meant, "
                     "or a total step count computed wrongly): the learning rate stays near 0 throughout; give the "
                     "warm-up its length in optimizer steps.")
    else:  # not a small learning rate: nothing moved them at all
        what = (f"the trained weights did not move at all (bit for bit) although the optimizer steps at learning rate "
                f"{shown}, and the loss is {loss:.4g} (the first check step's {first_loss:.4g})")
        cause = "The optimizer does not step the parameters the model trains (an optimizer built over a copy of " \
                "the model, or over parameters replaced since), every gradient is 0 when it steps (gradients read " \
                "healthy and then clipped with max_norm 0, or zeroed between the backward and the step), or every " \
                "update is below the weights' precision (bfloat16 or float16 weights under a small step: keep the " \
                "weights in float32 with mixed precision)."
    return Verdict(Finding(
        Kind.LEARNING_STALLED, Severity.WARNING,
        f"Training is not learning since step {since}: {what}. {cause}",
        {"since_step": since, "update_per_step": drift.per_step, "learning_rates": rates, "loss": loss,
         "first_loss": first_loss, "cause": KEY,
         **({"warm_up_reaches": warm_up} if warm_up is not None else {}),
         **({"clip_cut": clipped[2]} if clipped is not None and drift.per_step > 0 else {}),
         **({"eps": drift.eps, "eps_bound": drift.eps_bound} if bounded else {}),
         **({"dtype": drift.coarse, "unchanged": drift.unchanged} if rounded else {})}),
        [f"param group {index}" for index in range(len(lrs))], key=KEY)


def endless_warm_up(lr: float, before: Any, base: float, step: int, steps: int,
                    total_steps: int | None) -> float | None:
    """The share of its base that a rising learning rate under :data:`SCHEDULE_SHARE` of it reaches by the run's
    end at its pace since ``steps`` steps ago (``before``), where that share is under :data:`SCHEDULE_SHARE` too: a
    warm-up the run cannot finish is no warm-up's start; None otherwise (not rising, the end unknown, or it gets
    there). A warm-up of a million steps where a thousand were meant is 4e-4 of its base at step 400; a tiny GPT-2
    warming up over 1,000 steps in a 400-step run reaches 0.4::

        >>> endless_warm_up(3e-4 * 0.05, 2e-4 * 0.05, 0.05, 300, 100, 400)
        0.0004
        >>> endless_warm_up(0.03, 0.02, 0.1, 300, 100, 400) is None, endless_warm_up(1e-5, 2e-5, 0.05, 300, 100, 400)
        (True, None)
    """
    if total_steps is None or not isinstance(before, (int, float)) or not 0 <= before < lr < SCHEDULE_SHARE * base:
        return None
    reach = (lr + (lr - before) / max(steps, 1) * max(total_steps - step, 0)) / base
    return round(reach, 12) if reach < SCHEDULE_SHARE else None


@rule(Kind.LEARNING_STALLED, at=Moment.CHECK_READ)
def progress_at_check_read(facts: CheckRead) -> Verdict | None:
    """The registered rule: :func:`judge_progress` once a gradient check step's numbers are on the host, with each
    trained param group's (learning rate, base)."""
    lrs = [(group.get("lr"), base_lr(group, index, facts.start_lrs))
           for index, group in enumerate(facts.param_groups) if group.get("params")]
    norm = getattr(facts.numbers, "global_grad_norm", math.nan)
    cut = clip_cut(facts.clipping, norm, facts.param_groups)
    return judge_progress(facts.step, facts.drift, facts.loss, facts.first_loss, lrs, facts.verdicts,
                          facts.total_steps, None if cut is None or facts.clipping is None else (*facts.clipping, cut))


__all__ = ["CLIP_CUT", "SCALE_FREE_KEYS", "Drift", "WeightDrift", "clip_cut", "judge_progress", "picked_parameters",
           "progress_at_check_read", "weight_sample"]
