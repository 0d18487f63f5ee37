"""The loss rule as the anomaly monitor runs it (with its verdict engine), for unit tests fed recorded losses."""

from __future__ import annotations

from lightning_debug.monitors.anomaly.divergence import LossJudge


def resumed(before: LossJudge) -> LossJudge:
    """A judge that goes on from ``before``'s checkpoint: the rule's baselines and the engine's held suspicions."""
    after = LossJudge()
    after.trend.load_state_dict(before.trend.state_dict())
    after.verdicts.load_state_dict(before.verdicts.state_dict())
    after.step = before.step
    return after
