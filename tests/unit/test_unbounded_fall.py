"""A loss that falls without bound (checks/unbounded.py, ``UnboundedFall``, through the loss judge): the fault
benchmark's loss-nll-on-logits-adam, judged the same across a checkpoint, and negative losses that level off
(issue 45: the anomaly callback alone names its area's failures)."""

from __future__ import annotations

import math

import pytest

from lightning_debug.checks.unbounded import FALL_FACTOR, UnboundedFall
from lightning_debug.monitors.anomaly.divergence import LossJudge, loss_finding
from tests.harness.losses import resumed

# loss-nll-on-logits-adam, every step: nll_loss on raw logits under Adam 1e-3 falls like -n ** 3.
NLL_ON_LOGITS = [0.089, -0.06, -0.13, -0.2, -0.28] + [-0.0015 * n ** 3 for n in range(5, 300)]


def falls(losses: list[float], judge: LossJudge | None = None, start: int = 0) -> list[int]:
    judge = judge or LossJudge()
    out = []
    for step, loss in enumerate(losses, start):
        verdict = judge.judge(loss, step)
        finding = loss_finding(verdict, step, [1e-3])
        if finding is not None and finding.details.get("judged_by") == "unbounded_fall":
            out.append(step)
    return out


def test_an_unbounded_fall_is_named_once_its_level_is_far_below_the_first_losses() -> None:
    found = falls(NLL_ON_LOGITS)
    assert found, "named"
    level_at = NLL_ON_LOGITS[found[0] - 4]
    assert -level_at >= FALL_FACTOR * 0.28 * 0.5
    assert found[0] < 120


def test_a_checkpoint_in_the_middle_of_the_fall_changes_nothing() -> None:
    whole = falls(NLL_ON_LOGITS)
    before = LossJudge()
    cut = whole[0] - 2  # the suspicion is held (patience 4) when the checkpoint is taken
    assert falls(NLL_ON_LOGITS[:cut], before) == []
    assert falls(NLL_ON_LOGITS[cut:], resumed(before), start=cut) == [s for s in whole if s >= cut]


@pytest.mark.parametrize("losses", [
    [-0.03 - 0.97 * (1 - 0.97 ** n) for n in range(600)],                     # a negative cosine similarity
    [0.0] + [-(1 - 0.99 ** n) for n in range(1, 600)],                        # the same from a zero-initialised head
    [1.8 - 0.02 * n for n in range(150)] + [-1.2 - 0.001 * n for n in range(450)],  # a Gaussian NLL's variance shrinks
    [-1e-4 * n for n in range(600)],                                          # linear, but from 0 to -0.06 only
], ids=["cosine", "cosine-from-zero", "gaussian-nll", "small-linear"])
def test_negative_losses_that_level_off_or_stay_near_their_start_are_not_a_fall(losses: list[float]) -> None:
    assert falls(losses) == []


def test_a_linear_fall_to_a_thousand_times_its_start_is_a_fall() -> None:
    """The twin of "small-linear": the same line, long enough to reach 1000x the first losses' magnitude."""
    losses = [-0.5] + [-0.5 - 0.1 * n for n in range(1, 12000)]
    judge = UnboundedFall()
    first = next(i for i, loss in enumerate(losses) if judge.judge(loss, losses[max(0, i - 7):i + 1], losses[:5]))
    assert -losses[first] >= FALL_FACTOR * 0.9 and math.isfinite(losses[first])
