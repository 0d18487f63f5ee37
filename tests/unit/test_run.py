"""The run itself, fed events through a minimal context and stub monitors: decisions, failures, the report's
failed checks, the checkpoint format and the step record. No Trainer, milliseconds each."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig
from lightning_debug.config import Area
from lightning_debug.core.context import RunContext
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.ledger import StepRecord
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource
from lightning_debug.errors import AnomalyError
from lightning_debug.report.summary import _headline
from lightning_debug.core.monitor_states import load_monitor_states, monitor_states
from lightning_debug.run import Run

CONFIG = DebugConfig(save_debug_info=False, print_summary=False, save_plots=False)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Failures and findings warn once each; the tests read them from the report instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Stub(Monitor):
    """A monitor that decides ``decision`` at every optimizer step, or raises ``raises`` there."""

    area: ClassVar[Area] = Area.ANOMALY
    kinds = frozenset({Kind.NONFINITE_LOSS})
    events = frozenset({Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_START})

    def __init__(self, decision: Decision = Decision.CONTINUE, raises: Exception | None = None,
                 area: Area | None = None) -> None:
        super().__init__(CONFIG, "stub", frequency=1)
        if area is not None:
            self.area = area  # type: ignore[misc]
        self.decision, self.raises = decision, raises
        self.calls: list[int] = []
        self.records: list[StepRecord] = []

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self.records.append(self.ledger.record)

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        self.calls.append(step)
        self.records.append(self.ledger.record)
        if self.raises is not None:
            raise self.raises
        return self.decision


class Loop(RunContext):
    def __init__(self, model: nn.Module | None = None, optimizers: list[Any] | None = None) -> None:
        self.model, self._optimizers = model, optimizers or []

    def module(self) -> nn.Module | None:
        return self.model

    def optimizers(self) -> list[Any]:
        return list(self._optimizers)


def started(*monitors: Monitor, context: RunContext | None = None) -> Run:
    run = Run(CONFIG, context or Loop(), monitors)
    run.start(0)
    return run


def optimizer_with_gradients() -> torch.optim.Optimizer:
    model = nn.Linear(2, 1)
    model(torch.ones(3, 2)).sum().backward()
    return torch.optim.SGD(model.parameters(), lr=0.1)


def has_gradients(optimizer: torch.optim.Optimizer) -> bool:
    return all(p.grad is not None for group in optimizer.param_groups for p in group["params"])


# --- decisions ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("decisions", "expected"), [
    ((Decision.CONTINUE, Decision.CONTINUE), Decision.CONTINUE),
    ((Decision.CONTINUE, Decision.SKIP), Decision.SKIP),
    ((Decision.SKIP, Decision.CONTINUE, Decision.STOP), Decision.STOP),
    ((Decision.STOP, Decision.SKIP), Decision.STOP),
])
def test_the_largest_decision_wins(decisions: tuple[Decision, ...], expected: Decision) -> None:
    areas = [Area.ANOMALY, Area.LOOP, Area.MEMORY]
    run = started(*(Stub(decision, area=area) for decision, area in zip(decisions, areas)))
    optimizer = optimizer_with_gradients()
    assert run.before_optimizer_step(0, optimizer) is expected
    assert has_gradients(optimizer) is (expected is Decision.CONTINUE)  # skip and stop drop the step's gradients


def test_every_monitor_is_asked_even_after_a_stop() -> None:
    first, second = Stub(Decision.STOP), Stub(area=Area.LOOP)
    run = started(first, second)
    run.before_optimizer_step(3, optimizer_with_gradients())
    assert first.calls == [3] and second.calls == [3]


# --- failures -------------------------------------------------------------------------------------

def test_a_raising_check_becomes_a_failed_check_and_training_continues() -> None:
    broken, healthy = Stub(raises=ZeroDivisionError("division by zero")), Stub(Decision.SKIP, area=Area.LOOP)
    run = started(broken, healthy)
    for step in range(3):
        run.batch_start(step, None)  # the step a failure is counted at
        assert run.before_optimizer_step(step, optimizer_with_gradients()) is Decision.SKIP
        run.batch_end()
    assert healthy.calls == [0, 1, 2] and broken.calls == [0, 1, 2]
    report = run.finish("finished", 3)
    assert report is not None
    failed = report["failed_checks"]["Stub.before_optimizer_step"]
    assert failed["count"] == 3 and failed["first_step"] == 0 and failed["last_step"] == 2
    assert failed["reasons"] == {"ZeroDivisionError: division by zero": 3}


def test_a_raising_check_alone_leaves_the_step_alone() -> None:
    run = started(Stub(raises=RuntimeError("boom")))
    optimizer = optimizer_with_gradients()
    assert run.before_optimizer_step(0, optimizer) is Decision.CONTINUE and has_gradients(optimizer)


def test_the_anomaly_error_the_user_asked_for_leaves_the_run() -> None:
    run = started(Stub(raises=AnomalyError("non-finite loss", 0, ["nonfinite_loss"])))
    with pytest.raises(AnomalyError):
        run.before_optimizer_step(0, optimizer_with_gradients())


class BrokenSection(Stub):
    def report_section(self) -> dict[str, Any]:
        raise KeyError("stats")


def test_a_failing_report_section_is_listed_and_keeps_the_areas_findings() -> None:
    monitor = BrokenSection()
    run = started(monitor, Stub(area=Area.LOOP))
    monitor.record(Finding(Kind.NONFINITE_LOSS, Severity.ERROR, "loss is NaN"), step=1)
    report = run.finish("finished", 2)
    assert report is not None
    assert report["failed_checks"]["BrokenSection.report_section"]["count"] == 1
    assert report["findings"]["nonfinite_loss"]["first_step"] == 1
    assert report["sections"]["anomaly"]["error"] == "KeyError: 'stats'"
    assert "loop" in report["sections"]  # the other sections are built


class OddSection(Stub):
    """A section the gradients area's Markdown cannot render (it has none of the keys it expects)."""

    def report_section(self) -> dict[str, Any]:
        return {"unexpected": True}


def test_a_section_that_cannot_be_rendered_is_a_failed_check_not_a_lost_report() -> None:
    run = started(OddSection(area=Area.GRADIENTS), Stub(area=Area.LOOP))
    report = run.finish("finished", 1)
    assert report is not None
    assert report["failed_checks"]["rendering the gradients section"]["count"] == 1
    assert "markdown" not in report["sections"]["gradients"]


def test_the_summary_never_says_nothing_wrong_over_a_failed_section() -> None:
    run = started(BrokenSection())
    report = run.finish("finished", 1)
    assert report is not None and report["findings"] == {}
    headline = _headline(report)
    assert "nothing wrong found" not in headline and "1 check(s) failed" in headline


def test_finish_is_idempotent() -> None:
    run = started(Stub())
    assert run.finish("finished", 1) is run.finish("failed", 5)


# --- the checkpoint format ------------------------------------------------------------------------

def test_monitor_states_round_trip() -> None:
    monitor = Stub()
    started(monitor)
    monitor.record(Finding(Kind.NONFINITE_LOSS, Severity.ERROR, "loss is NaN"), step=4)
    states = monitor_states([monitor, Stub(area=Area.LOOP)])
    assert sorted(states) == ["anomaly", "loop"]
    resumed, added = Stub(), Stub(area=Area.MEMORY)
    load_monitor_states([resumed, added], states)
    assert resumed.tally.state_dict() == monitor.tally.state_dict()
    assert resumed.episodes.open == monitor.episodes.open and ("nonfinite_loss", "") in resumed.episodes.open
    assert added.tally.kinds == {}  # an area the checkpoint lacks starts fresh


# --- the step record ------------------------------------------------------------------------------

def test_the_step_record_follows_several_optimizers() -> None:
    generator, discriminator = optimizer_with_gradients(), optimizer_with_gradients()
    context = Loop(optimizers=[generator, discriminator])
    monitor = Stub()
    run = started(monitor, context=context)
    assert run.ledger.record == StepRecord(several_optimizers=True)
    seen = []
    for step in range(2):
        run.batch_start(step, None)
        for optimizer in (discriminator, generator):
            run.before_optimizer_step(step, optimizer)
            seen.append((context.optimizer_index, run.ledger.record.optimizer_step))
        run.after_optimizer_step(step + 1)
        run.batch_end()
    assert seen == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert [(r.step, r.optimizer_index) for r in monitor.records[::3]] == [(0, None), (1, None)]  # batch_start
    assert run.ledger.record.steps_done == 2 and run.ledger.record.step == 1


def test_one_optimizer_has_no_index() -> None:
    optimizer = optimizer_with_gradients()
    run = started(Stub(), context=Loop(optimizers=[optimizer]))
    run.batch_start(0, None)
    run.before_optimizer_step(0, optimizer)
    record = run.ledger.record
    assert not record.several_optimizers and record.optimizer_index is None and record.optimizer_step is None


def test_sharded_optimizers_count_no_own_steps() -> None:
    first, second = optimizer_with_gradients(), optimizer_with_gradients()
    context = Loop(optimizers=[first, second])
    context.grads_sharded = True
    run = started(Stub(), context=context)
    run.before_optimizer_step(0, first)
    record = run.ledger.record
    assert record.several_optimizers and record.optimizer_index is None and record.optimizer_step is None


class Unlisted(Loop):
    def optimizers(self) -> list[Any]:
        raise RuntimeError("no trainer attached")


def test_optimizers_that_cannot_be_listed_are_a_failed_check() -> None:
    run = started(Stub(), context=Unlisted())
    optimizer = optimizer_with_gradients()
    assert run.before_optimizer_step(0, optimizer) is Decision.CONTINUE
    assert run.ledger.record.optimizer_step is None
    report = run.finish("finished", 1)
    assert report is not None and "listing the optimizers" in report["failed_checks"]


# --- events on check steps only ---------------------------------------------------------------------

class EveryThird(Monitor):
    """Wants the step's events on its check steps only (every third step), and every batch's start."""

    area: ClassVar[Area] = Area.MEMORY
    events = frozenset({Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END})
    due_events = frozenset({Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP, Event.BATCH_END})

    def __init__(self) -> None:
        super().__init__(CONFIG, "gated", frequency=3)
        self.seen: list[tuple[str, int]] = []

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self.seen.append(("batch_start", step))

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self.seen.append(("before_backward", step))

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        self.seen.append(("before_optimizer_step", step))
        return Decision.CONTINUE

    def batch_end(self, step: int, batch: Any) -> None:
        self.seen.append(("batch_end", step))


def test_a_monitors_due_events_run_on_its_check_steps_only_and_the_phase_is_kept() -> None:
    from lightning_debug.checks.memory import MemoryPhase

    monitor, optimizer = EveryThird(), optimizer_with_gradients()
    run = started(monitor)
    phases = []
    for step in range(7):
        run.batch_start(step, None)
        phases.append(run.ledger.phase)
        run.before_backward(step, torch.ones(()))
        phases.append(run.ledger.phase)
        run.before_optimizer_step(step, optimizer)
        phases.append(run.ledger.phase)
        run.after_optimizer_step(step + 1)
        run.batch_end()
        phases.append(run.ledger.phase)
    assert [step for event, step in monitor.seen if event == "batch_start"] == list(range(7))
    for event in ("before_backward", "before_optimizer_step", "batch_end"):
        assert [step for seen, step in monitor.seen if seen == event] == [0, 3, 6]
    assert phases == [MemoryPhase.FORWARD, MemoryPhase.BACKWARD, MemoryPhase.OPTIMIZER, None] * 7


def test_due_events_outside_the_step_are_refused() -> None:
    class Wrong(EveryThird):
        due_events = frozenset({Event.EVALUATION})

    with pytest.raises(TypeError, match="due_events"):
        Run(CONFIG, Loop(), [Wrong()])
