"""The plugin beside Lightning's own tools: its profilers, DeviceStatsMonitor, ThroughputMonitor,
LearningRateMonitor, EarlyStopping and ModelCheckpoint.

The profiler fits run in a process of their own (tests/workers/profiler_worker.py): two torch profilers on one
thread once ended a fit in a segmentation fault, which must be a failed test here, not a dead test run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.harness.toolkit import REPO, read_report, run_children

WORKER = REPO / "tests" / "workers" / "profiler_worker.py"
PROFILERS = ("simple", "advanced", "pytorch", "outer", "pytorch-unseen")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict, dict, str]]:
    """One process fits beside each profiler in turn (one interpreter start for all): per profiler, its part of the
    output, its paths, the performance section of report.json and report.md."""
    out = tmp_path_factory.mktemp("profilers")
    done = run_children([sys.executable, str(WORKER), "--profilers", *PROFILERS, "--out", str(out)], 420, REPO)
    assert done.returncode == 0, f"exit {done.returncode} (-11 or 139: segmentation fault):\n{done.stdout[-3000:]}"
    fits = {}
    for part in done.stdout.split("=== ")[1:]:
        name, _, rest = part.partition("\n")
        if name in PROFILERS:
            marker = f"=== {name} done "
            paths = json.loads(done.stdout.split(marker)[1].splitlines()[0])
            debug = Path(paths["debug_dir"])
            fits[name] = (rest, paths, read_report(debug)["sections"]["performance"], (debug / "report.md").read_text())
    assert sorted(fits) == sorted(PROFILERS), done.stdout[-3000:]
    return fits


@pytest.mark.parametrize("profiler", ["simple", "advanced"])
def test_lightning_profiler_without_torch_profiler_keeps_the_window(profiled: dict, profiler: str) -> None:
    output, paths, section, report_md = profiled[profiler]

    assert "FIT Profiler Report" in output  # the user's profiler printed its report
    assert section["profiler_window"]["status"] == "written"
    assert Path(section["profiler_window"]["path"]).is_file()
    assert [(t["first_step"], t["last_step"]) for t in section["profiler_traces"]] == [(2, 4)]
    assert "## Top operators (torch.profiler, steps 2-4)" in report_md
    assert "skipped" not in report_md


def test_lightning_pytorch_profiler_is_no_crash_and_the_window_says_why_it_is_skipped(profiled: dict) -> None:
    output, paths, section, report_md = profiled["pytorch"]

    assert list(Path(paths["log_dir"]).glob("fit-*.pt.trace.json"))  # the user's profiler wrote its trace
    window = section["profiler_window"]
    assert (window["status"], window["first_step"], window["last_step"]) == ("skipped", 2, 4)
    assert "PyTorchProfiler" in window["reason"] and paths["log_dir"] in window["reason"]
    assert section["profiler_traces"] == []
    assert "## torch.profiler window" in report_md and "was skipped: Trainer(profiler=...) runs" in report_md
    said = [line for line in output.splitlines() if "window of profile_steps" in line]
    assert len(said) == 1 and "is skipped" in said[0], said  # said once


def test_a_users_torch_profiler_around_the_fit_keeps_its_trace(profiled: dict) -> None:
    output, paths, section, report_md = profiled["outer"]

    assert (Path(paths["log_dir"]).parents[1] / "user.pt.trace.json").stat().st_size > 0
    window = section["profiler_window"]
    assert window["status"] == "skipped" and "already recording" in window["reason"]
    assert "## torch.profiler window" in report_md
    assert sum("window of profile_steps" in line for line in output.splitlines()) == 1


def test_a_profiler_whose_start_failed_is_dropped(profiled: dict) -> None:
    """Nothing tells the plugin that Lightning's PyTorchProfiler records (as on a torch without the query): its
    own profiler raises as it starts or steps, and is dropped, never stepped, stopped or exported again (keeping it
    was the segmentation fault), so the fit ends and the user's trace is written."""
    output, paths, section, report_md = profiled["pytorch-unseen"]

    assert list(Path(paths["log_dir"]).glob("fit-*.pt.trace.json"))
    window = section["profiler_window"]
    assert window["status"] == "skipped" and "already enabled" in window["reason"], window
    assert section["profiler_traces"] == []
    assert sum("window of profile_steps" in line for line in output.splitlines()) == 1
