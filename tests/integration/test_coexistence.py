"""The plugin beside Lightning's own tools: its profilers, DeviceStatsMonitor, ThroughputMonitor,
LearningRateMonitor, EarlyStopping and ModelCheckpoint.

The profiler fits run in a process of their own (tests/workers/profiler_worker.py): two torch profilers on one
thread once ended a fit in a segmentation fault, which must be a failed test here, not a dead test run.
"""

from __future__ import annotations

import csv
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (DeviceStatsMonitor, EarlyStopping, LearningRateMonitor, ModelCheckpoint,
                                         ThroughputMonitor)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_debug import DebugConfig
from tests.harness.toolkit import (REPO, TinyRegressor, all_four, debug_dir, read_events, read_report, read_scalars,
                                   run_children)

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


# --- Lightning's callbacks ----------------------------------------------------------------------------------------
LOUD = ("warning", "error", "critical")
CONFIG = DebugConfig(gradient_checking_frequency=2, memory_profiling_frequency=4, performance_profiling_frequency=2,
                     save_plots=False)


class Validated(TinyRegressor):
    """TinyRegressor with a validation loss (what EarlyStopping and ModelCheckpoint monitor) and a StepLR."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def val_dataloader(self) -> Any:
        return self.train_dataloader()

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit_with_lightning_tools(root: Path, max_steps: int, early_stopping: EarlyStopping | None = None,
                             ckpt_path: str | None = None, **checkpoint: Any) -> pl.Trainer:
    """The four debug callbacks beside DeviceStatsMonitor, ThroughputMonitor, LearningRateMonitor, EarlyStopping
    and ModelCheckpoint, logging to TensorBoard and CSV; validation every 4 steps."""
    tools = [DeviceStatsMonitor(cpu_stats=True), ThroughputMonitor(batch_size_fn=lambda batch: batch[0].shape[0],
                                                                    window_size=2),
             LearningRateMonitor(logging_interval="step"),
             early_stopping or EarlyStopping(monitor="val_loss", patience=100),
             ModelCheckpoint(dirpath=root / "checkpoints", monitor="val_loss", save_last=True, **checkpoint)]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=[*all_four(CONFIG), *tools], default_root_dir=root, max_steps=max_steps,
                         accelerator="cpu", devices=1, logger=[TensorBoardLogger(root, name="tb"), CSVLogger(root)],
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         val_check_interval=4, limit_val_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Validated(), ckpt_path=ckpt_path)
    return trainer


def csv_columns(trainer: pl.Trainer) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv of the CSVLogger: name -> [(step, value)]."""
    rows = list(csv.DictReader((Path(trainer.loggers[1].log_dir) / "metrics.csv").open()))
    columns: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if value not in ("", None) and name != "step":
                columns.setdefault(name, []).append((int(row["step"]), float(value)))
    return columns


def test_lightning_callbacks_and_the_debug_callbacks_in_one_fit(tmp_path: Path) -> None:
    trainer = fit_with_lightning_tools(tmp_path, max_steps=24)

    events = read_events(debug_dir(trainer))
    assert not [e for e in events if e["severity"] in LOUD], events
    report = read_report(debug_dir(trainer))
    assert (report["status"], report["last_step"]) == ("finished", 24)
    theirs = ("DeviceStatsMonitor.on_train_batch_end/cpu_percent", "train/device/samples_per_sec", "lr-SGD", "val_loss")
    ours = ("debug/loss_finite", "debug/grad/global_norm", "debug/memory/cpu_rss_mb", "debug/perf/step_ms")
    for columns in (csv_columns(trainer), read_scalars(trainer.loggers[0].log_dir)):
        for name in theirs + ours:
            assert columns.get(name), (name, sorted(columns))
        assert sorted({round(value * 1e5) for _, value in columns["lr-SGD"]}) == [62, 125, 250, 500, 1000]
        assert [step for step, _ in columns["debug/perf/step_ms"]][:3] == [0, 2, 4]
        assert max(step for step, _ in columns["debug/loss_finite"]) == 23
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_early_stopping_ends_the_fit_early_and_the_report_says_where(tmp_path: Path) -> None:
    """An improvement of 100 never comes: EarlyStopping stops after two validations without one (step 8)."""
    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=100.0)
    trainer = fit_with_lightning_tools(tmp_path, max_steps=40, early_stopping=stopper)

    assert stopper.stopped_epoch >= 0 and trainer.global_step == 8
    report = read_report(debug_dir(trainer))
    assert (report["status"], report["last_step"]) == ("finished", 8)
    assert not [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD]
    assert max(step for step, _ in csv_columns(trainer)["debug/loss_finite"]) == 7


def test_a_fit_resumed_from_the_model_checkpoints_file_carries_the_plugins_counts(tmp_path: Path) -> None:
    first = fit_with_lightning_tools(tmp_path / "first", max_steps=12, every_n_train_steps=6, save_top_k=-1)
    checkpoint = tmp_path / "first" / "checkpoints" / "last.ckpt"
    first_steps = read_report(debug_dir(first))["stats"]["step_time_ms"]["count"]

    resumed = fit_with_lightning_tools(tmp_path / "resumed", max_steps=20, ckpt_path=str(checkpoint))
    report = read_report(debug_dir(resumed))
    assert (report["status"], report["last_step"]) == ("finished", 20)
    assert not [e for e in read_events(debug_dir(resumed)) if e["severity"] in LOUD]
    assert report["stats"]["step_time_ms"]["count"] > first_steps  # the statistics went on from the checkpoint's
    steps = [step for step, _ in csv_columns(resumed)["debug/loss_finite"]]
    assert min(steps) == 12 and max(steps) == 19
