"""Adding a check edits no monitor: a rule registered from this test module (``core.rules``) runs in a real
``lightning.Trainer`` fit, its result taken down the one path by type (a ``Finding``: one-off; suspicions: the
monitor's verdict engine, confirmed by the kind's policy), and is gone once unregistered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_debug import DebugConfig, GradientHealthCallback, MemoryProfilerCallback
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.rules import CheckRead, CheckStep, FitStart, Moment, registered
from lightning_debug.core.verdicts import Suspicion
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events

PLANTED = "planted by tests/integration/test_rules.py"


def told_at_fit_start(facts: FitStart) -> Finding:
    """A one-off fact from what the fit starts with: the number of named parameters and of param groups."""
    return Finding(Kind.WEIGHT_DECAY_ON_NORM, Severity.INFO,
                   f"{PLANTED}: {len(facts.parameters)} parameters in {len(facts.param_groups)} group(s)",
                   {"parameters": len(facts.parameters), "owners": sum(owner is not None for _, _, owner in
                                                                      facts.parameters)})


def suspect_from_step_3(facts: CheckStep) -> list[Suspicion]:
    """A suspicion on every check step from step 3 on, held by ``learning_stalled``'s policy (3 in a row)."""
    if facts.step < 3:
        return []
    return [Suspicion(Kind.LEARNING_STALLED, "planted", facts.step, finding=Finding(
        Kind.LEARNING_STALLED, Severity.WARNING, f"{PLANTED} at step {facts.step}", {"lrs": [
            group["lr"] for group in facts.param_groups]}))]


def memory_seen(facts: CheckRead) -> Finding | None:
    """A one-off fact from a memory check step's reading (the process's resident memory is above 0)."""
    if facts.step == 2 and facts.numbers.cpu_rss > 0:
        return Finding(Kind.MEMORY_HIGH, Severity.INFO, f"{PLANTED}: memory read at step 2", {})
    return None


def fit(root: Path) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    config = DebugConfig(gradient_checking_frequency=1, memory_profiling_frequency=1)
    trainer = make_trainer(root, [GradientHealthCallback(config), MemoryProfilerCallback(config)], max_steps=8)
    trainer.fit(TinyRegressor(lr=0.01))
    return read_events(debug_dir(trainer))


def planted(events: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    return [(e["kind"], e["step"], e.get("episode")) for e in events if PLANTED in e.get("message", "")]


def test_a_rule_registered_from_a_test_runs_in_a_real_fit_without_editing_a_monitor(tmp_path: Path) -> None:
    with registered(told_at_fit_start, Kind.WEIGHT_DECAY_ON_NORM, at=Moment.FIT_START), \
            registered(suspect_from_step_3, Kind.LEARNING_STALLED, at=Moment.CHECK_STEP, suspects=True), \
            registered(memory_seen, Kind.MEMORY_HIGH, at=Moment.CHECK_READ):
        events = fit(tmp_path / "registered")
    # one-off at fit start; the suspicion confirmed on its third check step in a row (the kind's policy, not
    # backdated), then one episode; the memory area's rule ran on its check step's reading
    assert planted(events) == [("weight_decay_on_norm", 0, None), ("memory_high", 2, None),
                               ("learning_stalled", 5, "start")]
    told = next(e for e in events if e["kind"] == "weight_decay_on_norm" and PLANTED in e["message"])
    assert told["details"]["parameters"] == told["details"]["owners"] > 0
    # once unregistered, the same fit says none of it
    assert planted(fit(tmp_path / "unregistered")) == []
