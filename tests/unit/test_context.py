"""RunContext's own module and the run's status: the enum inside, its string in report.json."""

from __future__ import annotations

import json

import pytest

from lightning_debug import DebugConfig
from lightning_debug.core import monitor
from lightning_debug.core.context import RunContext, RunStatus
from lightning_debug.run import Run


def test_run_context_is_reexported_from_monitor() -> None:
    assert monitor.RunContext is RunContext


@pytest.mark.parametrize("given", [RunStatus.INTERRUPTED, "interrupted", "INTERRUPTED"])
def test_finish_takes_the_enum_or_its_string_and_writes_the_string(given: RunStatus | str) -> None:
    run = Run(DebugConfig(save_debug_info=False, print_summary=False, save_plots=False), RunContext())
    run.start(0)
    report = run.finish(given, 2)
    assert report is not None and report["status"] == "interrupted" and type(report["status"]) is str
    assert json.loads(json.dumps(report["status"])) == "interrupted"


def test_an_unknown_status_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="finished, failed, interrupted"):
        RunStatus.parse("done")


def test_status_of_an_error() -> None:
    assert RunStatus.of(None) is RunStatus.FINISHED
    assert RunStatus.of(KeyboardInterrupt()) is RunStatus.INTERRUPTED
    assert RunStatus.of(RuntimeError("boom")) is RunStatus.FAILED
