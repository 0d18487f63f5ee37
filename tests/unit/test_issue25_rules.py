"""The rules of issue 25 fed recorded histories: a loss that climbs through its noise, a stall every k-th
step, a label out of range read from a loss's frame, and the report's order along the chain of causes."""

from __future__ import annotations

import random

import torch
from torch import nn

from lightning_debug.checks.errors import declared_labels, out_of_range_labels
from lightning_debug.checks.trends import CLIMB_LEVEL_WINDOW, LossKind
from lightning_debug.checks.timing import Phase, StepTimes
from lightning_debug.core.findings import order_findings
from lightning_debug.core.ledger import RunLedger
from lightning_debug.monitors.performance.settings import PerformanceSettings
from lightning_debug.monitors.anomaly.divergence import CLIMB_CHECKS, LossJudge
from lightning_debug.monitors.performance.slow_step import FAR_MIN_OUTLIERS, SlowStepRule
from tests.harness.losses import resumed


def judge_all(losses: list[float], climb: bool = True) -> list[LossKind | None]:
    trend = LossJudge()
    return [trend.judge(loss, climb=climb).kind for loss in losses]


def noisy(levels: list[float], seed: int = 0, spread: float = 0.3) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.uniform(-spread, spread)) for level in levels]


# --- the noisy climb ------------------------------------------------------------------------------
def test_a_noisy_climb_is_named_within_the_confirmation_window() -> None:
    levels = [2.8] * 10 + [2.8 * 1.08 ** i for i in range(40)]
    kinds = judge_all(noisy(levels))
    assert LossKind.CLIMB in kinds
    first = kinds.index(LossKind.CLIMB)
    doubled = next(i for i, level in enumerate(levels) if level >= 2 * 2.8)
    assert doubled <= first <= doubled + CLIMB_LEVEL_WINDOW // 2 + CLIMB_CHECKS, (doubled, first)


def test_noisy_healthy_losses_are_no_climb() -> None:
    falling = noisy([2.8 * 0.97 ** i for i in range(80)], spread=0.5)
    assert LossKind.CLIMB not in judge_all(falling)
    bump = noisy([2.8] * 10 + [2.8 * 1.3] * 6 + [2.8 * 0.9 ** i for i in range(40)])
    assert LossKind.CLIMB not in judge_all(bump), "a short rise that comes back"
    memorised = [2.8 * 0.8 ** i for i in range(40)] + [0.02 * 1.1 ** i for i in range(30)]
    assert LossKind.CLIMB not in judge_all(memorised), "near zero and drifting up, far below the start"
    heavy = [2.8 if i % 7 else 40.0 for i in range(80)]
    assert LossKind.CLIMB not in judge_all(heavy), "single hard batches move losses, not the median"


def test_a_climb_is_not_judged_where_the_monitor_says_so_and_survives_a_resume() -> None:
    levels = noisy([2.8] * 10 + [2.8 * 1.08 ** i for i in range(40)])
    assert LossKind.CLIMB not in judge_all(levels, climb=False)
    before = LossJudge()
    for loss in levels[:30]:
        before.judge(loss)
    after = resumed(before)
    whole = LossJudge()
    assert [after.judge(v).kind for v in levels[30:]] == [whole.judge(v).kind for v in levels][30:]


# --- a stall every k-th step ----------------------------------------------------------------------
def step_times(step: int, forward: float) -> StepTimes:
    return StepTimes(step, {Phase.DATA: 0.1, Phase.FORWARD: forward, Phase.BACKWARD: 0.6, Phase.OPTIMIZER: 0.2})


def feed(rule: SlowStepRule, forwards: dict[int, float], steps: range) -> list[object]:
    settings, verdicts = PerformanceSettings(frequency=steps.step), []
    for step in steps:
        recorded = step_times(step, forwards.get(step, 1.0))
        verdicts.append(rule.judge(recorded, settings))
        rule.remember(recorded)
    return verdicts


def test_a_stall_every_5th_step_is_periodic_and_says_its_share() -> None:
    rule = SlowStepRule()
    verdicts = [v for v in feed(rule, {s: 200.0 for s in range(0, 40, 5)}, range(40)) if v is not None]
    warning = next(v for v in verdicts if v.recurring)
    assert warning.step == 20 and warning.period == 5 and warning.fraction == 0.2
    assert warning.outlier_steps == (5, 10, 15, 20)
    assert "recurs every 5th step, 20% of steps" in warning.finding().message
    assert rule.ongoing(37) and not rule.ongoing(46), "one episode between recurrences, closed after two periods"


def test_sparse_timing_names_the_period_it_sees_and_how_to_see_more() -> None:
    verdicts = feed(SlowStepRule(), {s: 200.0 for s in range(0, 400, 15)}, range(0, 400, 10))
    warning = next(v for v in verdicts if v is not None and v.recurring)
    assert warning.period == 30 and "performance_profiling_frequency=1" in warning.finding().message


def test_irregular_far_stalls_recur_as_a_share_and_jitter_does_not() -> None:
    stalls = {7: 300.0, 18: 300.0, 26: 300.0, 41: 300.0, 44: 300.0, 60: 300.0}
    verdicts = [v for v in feed(SlowStepRule(), stalls, range(62)) if v is not None]
    assert any(v.recurring and v.period is None for v in verdicts)
    assert len(stalls) >= FAR_MIN_OUTLIERS
    jitter = {7: 60.0, 29: 60.0, 48: 60.0}
    assert [v for v in feed(SlowStepRule(), jitter, range(60)) if v is not None and v.recurring] == []


def test_the_ledger_notes_what_ran_in_a_step_bounded() -> None:
    ledger = RunLedger()
    for step in range(0, 400, 5):
        ledger.note(step, "checkpoint saving")
    assert ledger.noted([390, 395, 3]) == {"checkpoint saving": [390, 395]}
    assert len(ledger.notes) <= 64


# --- labels ---------------------------------------------------------------------------------------
def test_out_of_range_labels_read_from_a_loss_modules_frame() -> None:
    try:
        nn.CrossEntropyLoss()(torch.zeros(6, 4, 5), torch.tensor([[0, 1, 2, 3, -100]] * 5 + [[0, 1, 2, 7, -1]]))
    except (IndexError, RuntimeError) as error:
        found = out_of_range_labels(error)
    assert found is not None and found["num_classes"] == 4 and found["count"] == 2
    assert found["label"] == 7 and found["index"] == 28  # -100 is ignore_index; the -1 at index 29 also counted


def test_declared_labels_are_read_as_structure() -> None:
    class Config:
        num_labels = 3

    model = nn.Linear(2, 2)
    assert declared_labels(model) is None
    model.config = Config()  # type: ignore[assignment]
    assert declared_labels(model) == {"value": 3, "attribute": "config.num_labels"}


# --- report order ---------------------------------------------------------------------------------
def test_a_consequence_follows_its_own_cause_even_when_seen_earlier() -> None:
    findings = {"nonfinite_grad": {"severity": "error", "first_step": 3},
                "nonfinite_loss": {"severity": "error", "first_step": 4, "consequence_of": "nonfinite_param"},
                "nonfinite_param": {"severity": "critical", "first_step": 4, "consequence_of": "nonfinite_grad"},
                "exploding_gradients": {"severity": "warning", "first_step": 3, "consequence_of": "nonfinite_grad"}}
    order = list(order_findings(findings))
    assert order.index("nonfinite_grad") < order.index("nonfinite_param") < order.index("nonfinite_loss")
    assert order[0] == "nonfinite_grad"
