"""Findings, episodes and tallies (core/findings.py), and how a monitor writes them (core/monitor.py), fed
observations directly: no Trainer, milliseconds. The doctests show one episode and one causal order."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from lightning_debug import DebugConfig
from lightning_debug.config import Area
from lightning_debug.core.context import RunContext
from lightning_debug.core.findings import EpisodePhase, Episodes, Finding, Tally, order_findings, root_of
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Monitor
from lightning_debug.core.ledger import CheckSchedule
from lightning_debug.run import Run

KEY = ("nonfinite_loss", "")


# --- Episodes -------------------------------------------------------------------------------------

def test_an_episode_survives_fewer_absent_checks_than_its_grace() -> None:
    episodes = Episodes(grace=3)
    episodes.observe(KEY, 1)
    assert episodes.close_missing(set(), 2) == [] and episodes.close_missing(set(), 3) == []
    assert episodes.observe(KEY, 4) is EpisodePhase.CONTINUE  # seen again: the count of misses starts over
    assert episodes.close_missing(set(), 5) == [] and episodes.close_missing(set(), 6) == []
    assert episodes.close_missing(set(), 7) == [(KEY, {"first_step": 1, "last_step": 4, "steps": 2})]
    assert episodes.observe(KEY, 8) is EpisodePhase.START


def test_closing_touches_only_the_kinds_checked_and_what_was_not_seen() -> None:
    episodes = Episodes()
    other = ("exploding_grad", "")
    episodes.observe(KEY, 1)
    episodes.observe(other, 1)
    assert episodes.close_missing({other}, 2, kinds={"exploding_grad", "nonfinite_loss"}) == [
        (KEY, {"first_step": 1, "last_step": 1, "steps": 1})]
    assert episodes.close_missing(set(), 2, kinds={"nonfinite_loss"}) == []  # another area's check
    assert list(episodes.open) == [other]


def test_the_end_of_the_run_closes_every_episode_whatever_the_grace() -> None:
    episodes = Episodes(grace=10)
    episodes.observe(KEY, 1)
    episodes.observe(("dead_activation", "fc"), 2)
    assert len(episodes.close_missing(set(), 3, final=True)) == 2 and episodes.open == {}


def test_episodes_survive_a_checkpoint() -> None:
    episodes = Episodes(grace=2)
    episodes.observe(("dead_activation", "block.0"), 3)
    episodes.close_missing(set(), 4)
    resumed = Episodes(grace=2)
    resumed.load_state_dict(episodes.state_dict())
    assert resumed.open == episodes.open and resumed.observe(("dead_activation", "block.0"), 5) is EpisodePhase.CONTINUE


# --- Tally ----------------------------------------------------------------------------------------

def finding(kind: Kind = Kind.NONFINITE_LOSS, severity: Severity = Severity.WARNING, message: str = "m",
            **details: Any) -> Finding:
    return Finding(kind, severity, message, dict(details))


def test_a_tally_counts_episodes_and_steps_and_keeps_the_worst_severity() -> None:
    tally = Tally()
    tally.record(3, finding(message="first"), new_episode=True)
    tally.record(4, finding(severity=Severity.CRITICAL, message="second"), new_episode=False)
    tally.record(9, finding(severity=Severity.INFO), new_episode=True)
    assert tally.state_dict()["nonfinite_loss"] == {"episodes": 2, "steps": 3, "first_step": 3, "last_step": 9,
                                                    "severity": "critical", "first_message": "first"}


def test_consequence_of_comes_from_the_first_finding_only() -> None:
    tally = Tally()
    tally.record(1, finding(Kind.NONFINITE_PARAM, consequence_of="nonfinite_grad"), True)
    tally.record(2, finding(Kind.NONFINITE_PARAM, consequence_of="nonfinite_loss"), True)
    tally.record(1, finding(Kind.NONFINITE_GRAD), True)
    tally.record(2, finding(Kind.NONFINITE_GRAD, consequence_of="nonfinite_loss"), True)
    assert tally.kinds["nonfinite_param"]["consequence_of"] == "nonfinite_grad"
    assert "consequence_of" not in tally.kinds["nonfinite_grad"]


def test_a_tally_round_trips_without_sharing_its_entries() -> None:
    tally = Tally()
    tally.record(1, finding(), True)
    resumed = Tally()
    resumed.load_state_dict(tally.state_dict())
    resumed.record(2, finding(), False)
    assert tally.kinds["nonfinite_loss"]["steps"] == 1 and resumed.kinds["nonfinite_loss"]["steps"] == 2


# --- order ----------------------------------------------------------------------------------------

def test_root_of_follows_the_chain_and_stops_at_a_cycle_or_an_unknown_cause() -> None:
    chain = {"a": {"consequence_of": "b"}, "b": {"consequence_of": "c"}, "c": {}}
    assert root_of("a", chain) == "c"
    assert root_of("x", {"x": {"consequence_of": "gone"}}) == "x"
    cycle = {"a": {"consequence_of": "b"}, "b": {"consequence_of": "a"}}
    assert root_of("a", cycle) in {"a", "b"}


def test_order_is_severity_then_first_step_then_causal_rank() -> None:
    findings = {
        "slow_step": {"severity": "info", "first_step": 0},
        "exploding_grad": {"severity": "warning", "first_step": 7},
        "nonfinite_grad": {"severity": "error", "first_step": 5},
        "nonfinite_loss": {"severity": "error", "first_step": 5},
        "loss_spike": {"severity": "warning", "first_step": 2},
    }
    assert list(order_findings(findings)) == ["nonfinite_loss", "nonfinite_grad", "loss_spike", "exploding_grad",
                                              "slow_step"]


def test_a_consequence_follows_its_cause_even_when_milder() -> None:
    findings = {"exploding_grad": {"severity": "warning", "first_step": 4},
                "loss_spike": {"severity": "warning", "first_step": 3},
                "nonfinite_param": {"severity": "info", "first_step": 9, "consequence_of": "exploding_grad"}}
    assert list(order_findings(findings)) == ["loss_spike", "exploding_grad", "nonfinite_param"]


# --- how a monitor writes episodes ----------------------------------------------------------------

class Recorder(Monitor):
    area: ClassVar[Area] = Area.ANOMALY
    kinds = frozenset({Kind.NONFINITE_LOSS})
    max_episode_events = 3
    episode_grace = 1


@pytest.fixture()
def recorder() -> Iterator[tuple[Recorder, list[dict[str, Any]]]]:
    config = DebugConfig(save_debug_info=False, print_summary=False, save_plots=False)
    monitor = Recorder(config, "test", frequency=1)
    run = Run(config, RunContext(), [monitor])
    events: list[dict[str, Any]] = []
    run.session.event_listeners.append(events.append)
    run.start(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield monitor, events


Recording = tuple[Recorder, list[dict[str, Any]]]


def test_a_condition_that_persists_writes_one_start_and_one_end(recorder: Recording) -> None:
    monitor, events = recorder
    for step in range(5):
        assert monitor.record(finding(severity=Severity.ERROR), step, {"epoch": 0}) is (step == 0)
        monitor.close_episodes(step, {}, monitor.kinds)
    monitor.close_episodes(5, {}, monitor.kinds)
    # the episode ends at the first check without it
    assert [(e["step"], str(e["episode"])) for e in events] == [(0, "start"), (5, "end")]
    assert monitor.tally.kinds["nonfinite_loss"]["steps"] == 5


def test_episodes_past_the_cap_are_counted_but_not_written(recorder: Recording) -> None:
    monitor, events = recorder
    for step in range(0, 12, 2):  # six separate episodes
        monitor.record(finding(), step)
        monitor.close_episodes(step, {}, monitor.kinds)  # the check that saw it
        monitor.close_episodes(step + 1, {}, monitor.kinds)  # the next one, without it
    starts = [e for e in events if str(e["episode"]) == "start"]
    assert len(starts) == Recorder.max_episode_events and "later ones are counted" in starts[-1]["message"]
    assert len([e for e in events if str(e["episode"]) == "end"]) == Recorder.max_episode_events
    assert monitor.tally.kinds["nonfinite_loss"]["episodes"] == 6
    summaries = [e for e in events if str(e["episode"]) == "summary"]  # at 2N = 6 episodes
    assert [(e["details"]["episodes"], e["details"]["first_step"], e["details"]["last_step"]) for e in summaries] == [
        (6, 0, 10)]


def test_summary_lines_come_at_2n_4n_8n_episodes_and_at_the_end(recorder: Recording) -> None:
    monitor, events = recorder
    for step in range(0, 2 * 29, 2):  # 29 separate episodes, N = 3
        monitor.record(finding(), step)
        monitor.close_episodes(step, {}, monitor.kinds)
        monitor.close_episodes(step + 1, {}, monitor.kinds)
    monitor.finalize(58)
    summaries = [e["details"]["episodes"] for e in events if str(e["episode"]) == "summary"]
    assert summaries == [6, 12, 24, 29]
    assert len([e for e in events if str(e["episode"]) == "start"]) == 3


# --- the schedule ---------------------------------------------------------------------------------

def test_a_schedule_needs_a_positive_frequency() -> None:
    with pytest.raises(ValueError, match="frequency must be >= 1"):
        CheckSchedule(0)
    assert all(CheckSchedule(1).is_due(step) for step in range(5))
