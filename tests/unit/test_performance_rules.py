"""The performance rules fed recorded step times directly: no Trainer, no run, milliseconds each."""

from __future__ import annotations

import math
import random
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig
from lightning_debug.checks.timing import PHASES, Phase, PhaseTimer, Stopwatch, StepTimes
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.ledger import INSTRUMENTED_STEPS_KEPT, RunLedger
from lightning_debug.core.ledger import CheckSchedule
from lightning_debug.core.verdicts import VerdictEngine
from lightning_debug.monitors.performance import PerformanceMonitor
from lightning_debug.monitors.performance.data_wait import DATA_WINDOW, MIN_DATA_HISTORY, DataWaitRule
from lightning_debug.monitors.performance.loader import describe_loader, loader_advice
from lightning_debug.monitors.performance.profiler import (
    StepWindows,
    host_sync_finding,
    sync_sites,
    trace_finding,
    trace_summary,
)
from lightning_debug.monitors.performance.settings import (
    DEFAULT_PROFILE_WINDOW,
    SYNC_DEBUG_WINDOW,
    PerformanceSettings,
)
from lightning_debug.monitors.performance.slow_step import MIN_HISTORY, RECENT_STEPS, SLOW_WINDOW, SlowStepRule
from lightning_debug.monitors.performance.step_stats import StepStats, step_metrics
from lightning_debug.monitors.performance.stragglers import (
    GATHER_FIELDS,
    STRAGGLER_WARMUP,
    STRAGGLER_WINDOW,
    StragglerRule,
    gather_row,
)

SETTINGS = PerformanceSettings()


def times(step: int, data: float = 1.0, forward: float = 10.0, backward: float = 20.0, optimizer: float = 5.0,
          *, cpu_wait: dict[Phase, float] | None = None, samples: int | None = None,
          elements: int | None = None) -> StepTimes:
    """One recorded step, phase times in ms."""
    return StepTimes(step, {Phase.DATA: data, Phase.FORWARD: forward, Phase.BACKWARD: backward,
                            Phase.OPTIMIZER: optimizer}, samples=samples, cpu_waits=dict(cpu_wait or {}),
                     elements=elements)


def feed_slow(rule: SlowStepRule, recorded: list[StepTimes], settings: PerformanceSettings = SETTINGS) -> list[Any]:
    """The verdicts of the slow-step rule over recorded steps, judged and remembered as the monitor does."""
    verdicts = []
    for step_times in recorded:
        verdicts.append(rule.judge(step_times, settings))
        rule.remember(step_times)
    return verdicts


# --- slow step ------------------------------------------------------------------------------------

def test_slow_step_needs_history_before_judging() -> None:
    rule = SlowStepRule()
    assert feed_slow(rule, [times(step, forward=5000.0 if step == MIN_HISTORY - 1 else 10.0)
                            for step in range(MIN_HISTORY)]) == [None] * MIN_HISTORY
    assert rule.judge(times(MIN_HISTORY, forward=5000.0), SETTINGS) is not None


def test_slow_step_ignores_ordinary_jitter() -> None:
    jitter = [0.8, 1.2, 1.0, 1.3, 0.7, 1.1, 0.9, 1.25]
    recorded = [times(step, forward=10.0 * jitter[step % len(jitter)]) for step in range(100)]
    assert [v for v in feed_slow(SlowStepRule(), recorded) if v is not None] == []


def test_slow_step_absolute_floor_spares_a_fast_model() -> None:
    """1 ms steps; a 40 ms hiccup is 40x the median but under MIN_SLOW_EXCESS_MS: no outlier."""
    recorded = [times(step, 0.1, 0.4, 0.4, 0.1) for step in range(10)] + [times(10, 0.1, 40.0, 0.4, 0.1)]
    rule = SlowStepRule()
    assert feed_slow(rule, recorded)[-1] is None
    assert not any(rule.flags)


def test_lone_moderate_outlier_is_flagged_but_not_reported() -> None:
    rule = SlowStepRule()
    feed_slow(rule, [times(step) for step in range(10)])
    assert rule.judge(times(10, forward=200.0), SETTINGS) is None  # 6x the median, not 20x
    assert list(rule.flags)[-1] is True


def test_lone_far_outlier_is_an_info_naming_its_phase() -> None:
    rule = SlowStepRule()
    feed_slow(rule, [times(step) for step in range(10)])
    verdict = rule.judge(times(10, optimizer=2000.0), SETTINGS)
    assert verdict is not None and verdict.phase is Phase.OPTIMIZER and not verdict.recurring
    assert verdict.key == "optimizer (once)"
    finding = verdict.finding()
    assert finding.kind is Kind.SLOW_STEP and finding.severity is Severity.INFO
    assert finding.details["phase"] == "optimizer" and set(finding.details["phases_ms"]) == {p.value for p in Phase}
    assert "the optimizer phase took 2000.0 ms" in finding.message


def test_a_burst_of_slow_steps_in_a_row_is_a_warning_once_it_ends() -> None:
    """Three slow steps in a row could be a burst or a new level: held until a step comes back under the threshold
    of before, then the warning, labelled at the burst's last step."""
    recorded = [times(step) for step in range(20)] + [times(step, data=300.0) for step in (20, 21, 22)] + [times(23)]
    verdicts = feed_slow(SlowStepRule(), recorded)
    assert verdicts[:23] == [None] * 23
    burst = verdicts[23]
    assert burst is not None and burst.step == 22 and burst.recurring and burst.shift is None
    assert burst.finding().severity is Severity.WARNING and burst.key == "data"


@pytest.mark.parametrize("after_resume", [10.0, 300.0])
def test_a_run_of_slow_steps_held_at_a_checkpoint_is_decided_after_the_resume(after_resume: float) -> None:
    """The run is the verdict engine's, checkpointed; the step times are not (a resumed process is timed afresh).
    Resumed with no history, a step back under the threshold of before ends the run as the burst, labelled at its last
    step as without the resume; a step above it holds the run on until enough steps are timed again, and slow steps
    that stay are the new level, labelled at the run's first step."""
    recorded = [times(step) for step in range(20)] + [times(step, data=300.0) for step in (20, 21, 22)]
    before = SlowStepRule(VerdictEngine())
    assert feed_slow(before, recorded) == [None] * 23
    engine = VerdictEngine()
    engine.load_state_dict(before.verdicts.state_dict())
    resumed = SlowStepRule(engine)
    after = [times(step, data=after_resume) for step in range(23, 23 + 2 * MIN_HISTORY)]
    decided = [verdict for verdict in feed_slow(resumed, after) if verdict is not None]
    if after_resume == 10.0:
        assert [(v.step, v.shift is None, v.finding().severity) for v in decided] == [(22, True, Severity.WARNING)]
    else:
        assert [(v.step, v.shift is not None) for v in decided] == [(20, True)], decided
        assert decided[0].finding().severity is Severity.INFO


@pytest.mark.parametrize(("elements_after", "explained"), [(4096, True), (1024, False)])
def test_steps_that_stay_slow_are_a_new_level_told_as_an_info(elements_after: int, explained: bool) -> None:
    """A sequence-length schedule: from step 30 each step has 4x the tokens and takes 8x as long, for good. No
    warning at all; once the recent median has followed, one info labelled at step 30, which says the input grew
    (or, when it did not, what else makes every step slower)."""
    recorded = [times(step, forward=10.0, backward=20.0, elements=1024) for step in range(30)]
    recorded += [times(step, forward=80.0, backward=200.0, elements=elements_after) for step in range(30, 120)]
    verdicts = [v for v in feed_slow(SlowStepRule(), recorded) if v is not None]
    assert len(verdicts) == 1, verdicts
    shift = verdicts[0]
    assert shift.step == 30 and shift.shift is not None and shift.key == "backward (shift)"
    finding = shift.finding()
    assert finding.severity is Severity.INFO and finding.details["shift_step"] == 30
    assert finding.details["factor"] == pytest.approx(286.0 / 36.0, rel=0.01)
    assert ("4.0x the elements" in finding.message) is explained
    assert ("did not grow" in finding.message) is not explained


def bucketed(steps: int, stall_every: int | None = None) -> list[StepTimes]:
    """Batches bucketed by sequence length, in a shuffled order: the step time grows with the input's elements (a
    batch of 512 tokens takes 30x one of 16). ``stall_every``: a 300 ms stall on every such step."""
    generator = random.Random(0)
    recorded = []
    for step in range(steps):
        size = generator.choice([16, 32, 64, 128, 256, 512]) * 8
        stalled = stall_every is not None and step % stall_every == 0
        recorded.append(times(step, forward=size / 40 + (300.0 if stalled else 0.0), backward=size / 20,
                              elements=size))
    return recorded


def test_batches_bucketed_by_length_are_not_slow_steps() -> None:
    """A length-bucketed loader: the long buckets are ten times the median, by design. Not one verdict."""
    assert [v for v in feed_slow(SlowStepRule(), bucketed(300)) if v is not None] == []


def test_a_stall_among_bucketed_batches_is_still_a_slow_step() -> None:
    """A 300 ms stall every 7th step among bucketed batches is still a warning."""
    verdicts = [v for v in feed_slow(SlowStepRule(), bucketed(400, stall_every=7)) if v is not None]
    assert verdicts and verdicts[0].finding().severity is Severity.WARNING, verdicts


def test_a_stall_on_a_long_bucket_is_judged_against_the_other_long_ones() -> None:
    """A 1.5 s stall on long batches only: each is an outlier among the batches of its size (about 300 ms)."""
    recorded = bucketed(400)
    stalled = [t.step for t in recorded if t.elements == 512 * 8 and t.step >= 100][::4]
    recorded = [times(t.step, forward=t.phases[Phase.FORWARD] + 1500.0, backward=t.phases[Phase.BACKWARD],
                      elements=t.elements) if t.step in stalled else t for t in recorded]
    rule = SlowStepRule()
    feed_slow(rule, recorded)
    assert stalled and set(stalled[-4:]) <= set(rule.outlier_steps), (stalled, list(rule.outlier_steps))


def test_slow_steps_in_a_row_are_no_period_whatever_the_timing_frequency() -> None:
    """Timed every 10th step, a new level makes every timed step slow: ten steps apart, and still no rhythm."""
    settings = PerformanceSettings(frequency=10)
    recorded = [times(step) for step in range(0, 200, 10)] + [times(step, data=300.0) for step in range(200, 260, 10)]
    rule = SlowStepRule()
    assert [v for v in feed_slow(rule, recorded, settings) if v is not None] == []
    assert rule.period() is None and rule.period(3) is None
    held = rule.flush()
    assert held is not None and held.step == 200 and held.shift is not None and held.shift.ended_run
    assert held.finding().severity is Severity.INFO and "until the end of the run" in held.finding().message


def test_recurring_outliers_are_a_warning_keyed_by_phase() -> None:
    rule = SlowStepRule()
    recorded = [times(step) for step in range(10)]
    recorded += [times(step, data=300.0 if step % 3 == 0 else 1.0) for step in range(10, 20)]
    verdicts = [v for v in feed_slow(rule, recorded) if v is not None]
    assert verdicts and verdicts[-1].recurring and verdicts[-1].phase is Phase.DATA
    assert verdicts[-1].key == "data" and verdicts[-1].finding().severity is Severity.WARNING
    assert verdicts[-1].slow_steps >= 3 and verdicts[-1].window_steps <= SLOW_WINDOW


@pytest.mark.parametrize(("period", "severity"), [(20, Severity.WARNING), (200, Severity.INFO)])
def test_a_periodic_stall_is_a_warning_only_when_it_costs_a_share_of_the_time(period: int,
                                                                                severity: Severity) -> None:
    """A 100 ms data stall over 36 ms steps: every 20th step it costs 12% of the time, every 200th 1.4%, the rhythm
    of a healthy run (an epoch boundary, a checkpoint), told as an info with what it costs."""
    recorded = [times(step, data=101.0 if step and step % period == 0 else 1.0) for step in range(4 * period + 1)]
    verdicts = [v for v in feed_slow(SlowStepRule(), recorded, PerformanceSettings(frequency=1)) if v is not None]
    assert verdicts and verdicts[-1].period == period and verdicts[-1].recurring
    finding = verdicts[-1].finding()
    share = 100.0 / (period * 36.0 + 100.0)
    assert finding.severity is severity and finding.details["time_share"] == pytest.approx(share, rel=0.02)
    assert f"it costs {share:.1%} of the time" in finding.message
    assert ("an info" in finding.message) is (severity is Severity.INFO)
    assert verdicts[-1].key == ("data (rhythm)" if severity is Severity.INFO else "data"), "an info hides no warning"


def test_a_stall_under_the_floor_on_half_the_timed_steps_is_a_rhythm_at_its_sixth_recurrence() -> None:
    """1 ms steps timed every 10th, a 30 ms stall every 20th: under MIN_SLOW_EXCESS_MS, and half the history."""
    settings = PerformanceSettings(frequency=10)
    recorded = [times(step, 0.1, 30.5 if step and step % 20 == 0 else 0.5, 0.3, 0.1) for step in range(0, 160, 10)]
    verdicts = feed_slow(SlowStepRule(), recorded, settings)
    named = [v for v in verdicts if v is not None]
    assert [v.step for v in named] == [120, 140] and all(v.period == 20 and v.phase is Phase.FORWARD for v in named)
    assert named[0].outlier_steps == (20, 40, 60, 80, 100, 120) and named[0].median_step_ms == pytest.approx(1.0)
    assert named[0].finding().severity is Severity.WARNING


def test_a_rhythm_whose_dearer_stalls_were_outliers_keeps_the_outliers_in_order() -> None:
    """A stall every 20th step costing 45 and 60 ms in turn: the 60 ms ones are over the 50 ms floor (outliers), the
    45 ms ones are found by the rhythm. The outliers stay in step order, so the stall still reads as every 20th step."""
    settings = PerformanceSettings(frequency=10)
    stall = {20: 45.0, 40: 60.0, 60: 45.0, 80: 60.0, 100: 45.0, 120: 60.0, 140: 45.0}
    recorded = [times(step, 0.1, 0.5 + stall.get(step, 0.0), 0.3, 0.1) for step in range(0, 160, 10)]
    rule = SlowStepRule()
    named = [v for v in feed_slow(rule, recorded, settings) if v is not None]
    assert list(rule.outlier_steps) == [40, 60, 80, 100, 120, 140], list(rule.outlier_steps)
    assert named[-1].step == 140 and named[-1].period == 20 and rule.period() == 20


def test_bursts_at_random_steps_and_of_random_cost_under_the_floor_are_no_rhythm() -> None:
    """A busy machine: 30% of the timed steps 10-40 ms late, at random, over 40 runs of 5,000 steps timed every 10th
    (without the test of one cost, 4 of them would form a rhythm; without the clean steps between, 1)."""
    settings = PerformanceSettings(frequency=10)
    for seed in range(40):
        rng = random.Random(seed)
        recorded = [times(step, 0.1, 0.5 + (rng.uniform(10.0, 40.0) if rng.random() < 0.3 else 0.0), 0.3, 0.1)
                    for step in range(0, 5000, 10)]
        assert [v for v in feed_slow(SlowStepRule(), recorded, settings) if v is not None] == [], seed


def test_a_rhythm_costing_under_the_periodic_share_is_no_warning() -> None:
    """20 ms steps, 15 ms more every 20th: 3.6% of the time, a rhythm of a healthy run."""
    recorded = [times(step, 1.0, 14.0 + (15.0 if step and step % 20 == 0 else 0.0), 4.0, 1.0) for step in range(200)]
    assert [v for v in feed_slow(SlowStepRule(), recorded, PerformanceSettings(frequency=1)) if v is not None] == []


def test_slow_step_leaves_out_the_wait_for_a_cpu() -> None:
    """A step slow only because another program had the CPU is judged without that wait."""
    rule = SlowStepRule()
    feed_slow(rule, [times(step) for step in range(10)])
    assert rule.judge(times(10, forward=2000.0, cpu_wait={Phase.FORWARD: 1990.0}), SETTINGS) is None
    assert list(rule.flags)[-1] is False


def test_slow_step_factor_setting_raises_the_threshold() -> None:
    history = [times(step, forward=100.0) for step in range(10)]
    low, high = SlowStepRule(), SlowStepRule()
    feed_slow(low, history)
    feed_slow(high, history, PerformanceSettings(slow_step_factor=10.0))
    low.judge(times(10, forward=600.0), SETTINGS)
    high.judge(times(10, forward=600.0), PerformanceSettings(slow_step_factor=10.0))
    assert list(low.flags)[-1] and not list(high.flags)[-1]


def test_slow_step_history_is_bounded() -> None:
    rule = SlowStepRule()
    feed_slow(rule, [times(step) for step in range(3 * RECENT_STEPS)])
    assert len(rule.steps) == RECENT_STEPS and all(len(w) == RECENT_STEPS for w in rule.phases.values())
    assert len(rule.flags) == SLOW_WINDOW


# --- data wait ------------------------------------------------------------------------------------

def test_data_wait_needs_a_window_of_steps() -> None:
    rule = DataWaitRule()
    verdicts = [rule.judge(times(step, data=100.0), SETTINGS) for step in range(MIN_DATA_HISTORY)]
    assert verdicts[:-1] == [None] * (MIN_DATA_HISTORY - 1) and verdicts[-1] is not None


def test_sustained_data_wait_is_a_bottleneck_with_loader_advice() -> None:
    rule = DataWaitRule()
    verdict = None
    for step in range(DATA_WINDOW):
        verdict = rule.judge(times(step, data=60.0), SETTINGS)
    assert verdict is not None and verdict.window_check_steps == DATA_WINDOW
    assert verdict.share == pytest.approx(60.0 / 95.0) and verdict.steps_above_share == DATA_WINDOW
    finding = verdict.finding({"num_workers": 0, "pin_memory": False, "persistent_workers": False}, True, 8)
    assert finding.kind is Kind.DATALOADER_BOTTLENECK and finding.severity is Severity.WARNING
    assert finding.details["num_workers"] == 0 and finding.details["cpus"] == 8
    assert "pin_memory=True" in finding.message and "63%" in finding.message


def test_unknown_loader_gets_generic_advice() -> None:
    rule = DataWaitRule()
    for step in range(DATA_WINDOW):
        verdict = rule.judge(times(step, data=60.0), SETTINGS)
    finding = verdict.finding(None, False, 4)  # type: ignore[union-attr]
    assert finding.details["num_workers"] is None and "worker processes" in finding.message


def test_tiny_model_with_loop_overhead_is_no_bottleneck() -> None:
    """2 ms of loop overhead between 1 ms steps is a big share but under MIN_DATA_WAIT_MS."""
    rule = DataWaitRule()
    assert all(rule.judge(times(step, 2.0, 0.5, 0.4, 0.1), SETTINGS) is None for step in range(30))


def test_a_few_slow_batches_are_no_bottleneck() -> None:
    rule = DataWaitRule()
    assert all(rule.judge(times(step, data=200.0 if step % 4 == 0 else 1.0), SETTINGS) is None for step in range(40))


def test_data_wait_share_setting() -> None:
    strict, lenient = DataWaitRule(), DataWaitRule()
    for step in range(DATA_WINDOW):
        loose_verdict = lenient.judge(times(step, data=20.0), PerformanceSettings(dataloader_bottleneck_share=0.5))
        strict_verdict = strict.judge(times(step, data=20.0), PerformanceSettings(dataloader_bottleneck_share=0.2))
    assert loose_verdict is None and strict_verdict is not None
    assert strict_verdict.threshold_share == 0.2 and len(strict.window) == DATA_WINDOW


# --- stragglers -----------------------------------------------------------------------------------

def gathered(step: int, slow_ms: float, ranks: int = 2, slow_rank: int = 1) -> list[float]:
    """One all-gather: every rank's row, ``slow_rank``'s forward ``slow_ms`` longer."""
    values: list[float] = []
    for rank in range(ranks):
        forward = 20.0 + (slow_ms if rank == slow_rank else 0.0)
        values += [float(step), 100.0, 5.0, forward, 70.0 - (slow_ms if rank == slow_rank else 0.0), 5.0]
    return values


def test_consistently_slower_rank_is_a_straggler_after_the_warm_up() -> None:
    rule = StragglerRule()
    results = [rule.judge(gathered(step, 30.0, ranks=4, slow_rank=2)) for step in range(STRAGGLER_WARMUP
                                                                                        + STRAGGLER_WINDOW)]
    assert results[:STRAGGLER_WARMUP] == [None] * STRAGGLER_WARMUP
    assert all(r is not None and r.straggler is None for r in results[STRAGGLER_WARMUP:-1])
    straggler = results[-1].straggler  # type: ignore[union-attr]
    assert straggler is not None and straggler.rank == 2 and straggler.world_size == 4 and straggler.key == "rank2"
    finding = straggler.finding()
    assert finding.kind is Kind.STRAGGLER_RANK and "Rank 2 is the slowest on 8 of the last 8" in finding.message
    assert set(finding.details["mean_ms_by_rank"]) == set(GATHER_FIELDS) - {"step"}


def test_small_or_intermittent_gaps_are_no_straggler() -> None:
    small, intermittent = StragglerRule(), StragglerRule()
    for step in range(40):
        small_result = small.judge(gathered(step, 3.0))  # under STRAGGLER_MIN_MS and the margin
        intermittent_result = intermittent.judge(gathered(step, 30.0 if step % 2 else 0.0))
        assert small_result is None or small_result.straggler is None
        assert intermittent_result is None or intermittent_result.straggler is None


def test_a_rank_that_waits_for_rank_zero_before_the_all_reduce_is_no_straggler() -> None:
    """Rank 0 writes outside its timed phases; rank 1 waits for it at a collective in its data wait, then both
    reach the all-reduce together (equal backward): rank 1 is slowest before the all-reduce, nobody waits for it."""
    rule, late = StragglerRule(), StragglerRule()
    for step in range(40):
        waited = [float(step), 7.0, 1.3, 0.8, 4.2, 0.3] + [float(step), 24.0, 20.5, 0.8, 2.6, 0.3]
        result = rule.judge(waited)
        assert result is None or result.straggler is None
        arrived_late = [float(step), 66.0, 1.8, 0.7, 63.2, 0.3] + [float(step), 84.0, 21.1, 61.4, 1.0, 0.4]
        verdict = late.judge(arrived_late)
    assert verdict is not None and verdict.straggler is not None and verdict.straggler.rank == 1
    assert verdict.straggler.median_wait_ms == pytest.approx(62.2)
    assert verdict.straggler.finding().details["median_wait_ms"] == pytest.approx(62.2)


def test_gathers_of_different_steps_or_missing_rows_are_not_judged() -> None:
    rule = StragglerRule()
    assert rule.judge(gathered(3, 30.0)[:6] + gathered(4, 30.0)[6:]) is None
    assert rule.judge(gathered(3, 30.0)[:6] + gather_row(None)) is None
    assert rule.judge(gathered(3, 30.0)[:6]) is None  # one rank
    assert rule.gathered == 0


def test_gather_row_is_the_judged_times() -> None:
    row = gather_row(times(7, data=10.0, cpu_wait={Phase.DATA: 4.0}))
    assert row == [7.0, 41.0, 6.0, 10.0, 20.0, 5.0]
    assert all(math.isnan(v) for v in gather_row(None))


# --- profiler and sync-debug windows --------------------------------------------------------------

def test_sync_sites_name_whose_code_synchronizes() -> None:
    counts = Counter({("/venv/site-packages/lib.py", 1): 9, ("/home/me/train.py", 2): 3,
                      ("/pkg/lightning_debug/x.py", 3): 1})
    sites = sync_sites(counts, package_dir="/pkg/lightning_debug")
    assert [site["origin"] for site in sites] == ["library", "user code", "lightning-debug"]
    finding = host_sync_finding(sites, 13, SYNC_DEBUG_WINDOW)
    assert finding is not None and finding.severity is Severity.WARNING
    assert finding.message.startswith("13 host-device synchronizations in steps 5-7") and "train.py:2" in finding.message
    library_only = host_sync_finding(sites[:1], 9, SYNC_DEBUG_WINDOW)
    assert library_only is not None and library_only.severity is Severity.INFO
    assert host_sync_finding([], 0, SYNC_DEBUG_WINDOW) is None


def test_trace_summary_and_finding() -> None:
    ops = [SimpleNamespace(key="ProfilerStep#1", count=1, self_cpu_time_total=5e6, cpu_time_total=5e6),
           SimpleNamespace(key="aten::mm", count=2, self_cpu_time_total=800.0, cpu_time_total=900.0,
                           self_device_time_total=700.0)]
    trace = trace_summary(ops, Path("/out/profiler/rank0.steps10-14.pt.trace.json"), 10, 14, uses_cuda=True)
    assert trace["top_cpu"] == ["aten::mm"] and trace["top_device"] == ["aten::mm"]
    finding = trace_finding(trace)
    assert finding.kind is Kind.PROFILER_TRACE and "steps 10-14" in finding.message


def test_profiler_window_on_cpu_writes_one_trace(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    traces: list[dict[str, Any]] = []
    windows = StepWindows(PerformanceSettings(profile_window=(1, 2)), False, 0, tmp_path, traces.append,
                          lambda *_: None, pytest.fail)
    assert windows.until == 3
    closed = []
    for step in range(5):
        closed.append(windows.boundary(step))
        torch.ones(4).sum()
    assert closed == [False, False, False, True, False] and not windows.active
    assert [(t["first_step"], t["last_step"]) for t in traces] == [(1, 2)]
    assert Path(traces[0]["path"]).exists()
    printed = capfd.readouterr()
    assert "profiler_start" not in printed.err + printed.out, "kineto's start/stop lines are silenced"


def test_sync_debug_window_reports_the_synchronizing_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA sync-debug mode is simulated: inside the window each synchronization is a warning."""
    modes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    closed: list[tuple[list[dict[str, Any]], int, int]] = []
    windows = StepWindows(PerformanceSettings(sync_window=(2, 2)), True, 0, None, pytest.fail,
                          lambda sites, total, step: closed.append((sites, total, step)), pytest.fail)
    for step in range(6):
        windows.boundary(step)
        assert windows.active == (2 <= step < 4)
        if windows.active:
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
    assert modes == ["warn", 0] and len(closed) == 1
    sites, total, step = closed[0]
    assert (total, step, sites[0]["origin"], sites[0]["count"]) == (2, 4, "user code", 2)
    assert sites[0]["code"].startswith("warnings.warn(")


def test_windows_without_an_output_directory_or_cuda_do_nothing() -> None:
    windows = StepWindows(PerformanceSettings(profile_window=(0, 2), sync_window=SYNC_DEBUG_WINDOW), False, 0,
                          None, pytest.fail, pytest.fail, pytest.fail)
    assert windows.sync_window is None  # the sync-debug window needs CUDA
    assert [windows.boundary(step) for step in range(4)] == [False] * 4 and not windows.active
    windows.restore()


# --- loader advice, settings, scalars, the ledger, phases ---------------------------------------

def test_loader_settings_and_advice() -> None:
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4, num_workers=0)
    combined = SimpleNamespace(iterables={"train": [loader]})
    assert describe_loader(combined)["batch_size"] == 4  # type: ignore[index]
    assert describe_loader(object()) is None and describe_loader({"num_workers": 3}) == {"num_workers": 3}
    advice = loader_advice({"num_workers": 2, "persistent_workers": False, "pin_memory": True}, True, 16)
    assert advice[0].startswith("2 worker(s) cannot keep up") and "persistent_workers=True" in advice[1]
    assert len(advice) == 2
    assert "set num_workers to 1" in loader_advice({"num_workers": 0}, False, 2)[0]


def test_settings_from_config() -> None:
    assert PerformanceSettings.from_config(DebugConfig()).profile_window is None
    advanced = PerformanceSettings.from_config(DebugConfig(level="advanced"))
    assert advanced.profile_window == DEFAULT_PROFILE_WINDOW and advanced.sync_window is None
    expert = PerformanceSettings.from_config(DebugConfig(level="expert", profile_steps=(3, 2),
                                                         performance_profiling_frequency=4))
    assert (expert.profile_window, expert.sync_window, expert.frequency) == ((3, 2), SYNC_DEBUG_WINDOW, 4)
    with pytest.raises(AttributeError):
        expert.frequency = 5  # type: ignore[misc]
    assert PerformanceMonitor(DebugConfig(level="advanced"), "loop").profile_window == DEFAULT_PROFILE_WINDOW


def test_step_metrics_and_stats_keep_the_output_names() -> None:
    metrics = step_metrics(times(3, samples=8, cpu_wait={Phase.DATA: 0.5}), world_size=2)
    assert list(metrics) == ["debug/perf/step_ms", "debug/perf/data_ms", "debug/perf/forward_ms",
                             "debug/perf/backward_ms", "debug/perf/optimizer_ms", "debug/perf/samples_per_sec"]
    stats = StepStats()
    stats.add(times(3, samples=8), world_size=2, cpu_waits_read=True)
    assert list(stats.summaries()) == ["step_time_ms", "data_time_ms", "forward_time_ms", "backward_time_ms",
                                       "optimizer_time_ms", "samples_per_sec"]
    restored = StepStats()
    restored.load_state_dict(stats.state_dict())
    assert {name: summary["mean"] for name, summary in restored.summaries().items()} == {
        name: summary["mean"] for name, summary in stats.summaries().items()}


def test_ledger_tells_timed_and_instrumented_steps() -> None:
    ledger = RunLedger()
    assert not ledger.is_timed(0)
    ledger.timing = CheckSchedule(5)
    assert [step for step in range(12) if ledger.is_timed(step)] == [0, 5, 10]
    for step in range(2 * INSTRUMENTED_STEPS_KEPT):
        ledger.instrument(step)
    assert ledger.was_instrumented(2 * INSTRUMENTED_STEPS_KEPT - 1) and not ledger.was_instrumented(0)


def test_phases_tile_the_step_in_order_and_accept_their_names() -> None:
    assert [phase.value for phase in PHASES] == ["data", "forward", "backward", "optimizer"]
    timer = PhaseTimer(Stopwatch(), step=1, start=0.0)
    for name in ("forward", "backward", "optimizer"):
        timer.enter(name)
    timer.stop()
    assert timer.saw_optimizer and timer.micro_batches == 1 and set(timer.read().phases) == set(Phase)


@pytest.mark.parametrize(("timed_14", "expected"), [(False, 5), (True, None)])
def test_a_period_holds_across_a_step_that_was_not_timed_but_not_one_timed_healthy(timed_14: bool,
                                                                                   expected: int | None) -> None:
    """A stall every 5th step whose step 14 fell in an untimed window (ADVANCED's profiler window) is still
    periodic; the same outliers with step 14 timed and fast are not."""
    rule = SlowStepRule()
    for step in range(30):
        if step in (10, 11, 12, 13) or (step == 14 and not timed_14):
            continue
        forward = 500.0 if step % 5 == 4 and step != 14 else 10.0
        times = StepTimes(step, {Phase.DATA: 1.0, Phase.FORWARD: forward, Phase.BACKWARD: 20.0, Phase.OPTIMIZER: 5.0})
        rule.judge(times, SETTINGS)
        rule.remember(times)
    assert list(rule.outlier_steps)[-4:] == [9, 19, 24, 29]
    assert rule.period() == expected
