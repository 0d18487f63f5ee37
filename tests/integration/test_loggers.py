"""A good citizen of Lightning's logging and of the loggers people use (issue 16).

Real loggers, read back from their own files: TensorBoard (EventAccumulator), CSVLogger (metrics.csv),
W&B offline (the run file), MLflow with a local file store (MlflowClient). Per-run output
directories, the trainer's logging cadence, parse-time config errors through LightningCLI, level
EXPERT in warn mode, the offline report's TensorBoard fallback, and the one-line console warnings.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from torch import nn

from lightning_debug import AnomalyDetectionCallback, DebugConfig, debug_callbacks
from lightning_debug.callbacks.base import RUN_ATTRIBUTE
from lightning_debug.checks.memory import heap_in_use
from lightning_debug.cli import main as cli
from tests.harness import wandb_offline
from tests.harness.toolkit import TinyRegressor, console_lines, make_trainer, read_events, read_report, read_scalars

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
QUIET: dict[str, Any] = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)


@pytest.fixture
def offline_loggers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B offline with every directory in the test's own folder; MLflow's file store allowed."""
    for key, value in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp_path / "wandb",
                           WANDB_CACHE_DIR=tmp_path / "wandb_cache", WANDB_CONFIG_DIR=tmp_path / "wandb_config",
                           WANDB_DATA_DIR=tmp_path / "wandb_data", MLFLOW_ALLOW_FILE_STORE="true").items():
        monkeypatch.setenv(key, str(value))
    (tmp_path / "wandb").mkdir()
    return tmp_path


def finish_wandb() -> None:
    import wandb

    wandb.finish()


class OddNames(TinyRegressor):
    """A module whose name is no valid metric-name component (a space, a slash)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.blocks = nn.ModuleDict({"odd block/x y": nn.Linear(16, 16)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks["odd block/x y"](torch.relu(self.inp(x)))
        return self.head(torch.relu(self.hidden(h)))


def csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as handle:
        return list(csv.DictReader(handle))


# --- every debug metric reaches every logger, with every option on ----------------------------------------------


def test_every_debug_metric_reaches_tensorboard_csv_wandb_and_mlflow(offline_loggers: Path) -> None:
    from mlflow.tracking import MlflowClient

    root = offline_loggers
    uri = f"file:{root / 'mlruns'}"
    loggers = [TensorBoardLogger(str(root), name="tb"), CSVLogger(str(root), name="csv"),
               WandbLogger(offline=True, save_dir=str(root / "wandb")), MLFlowLogger(tracking_uri=uri)]
    config = DebugConfig(level="advanced", anomaly_check_frequency=1, gradient_checking_frequency=1,
                         memory_profiling_frequency=1, performance_profiling_frequency=1, log_gradients=True,
                         log_weights=True, log_activations=True, profile_steps=(2, 2), print_summary=False)
    trainer = pl.Trainer(default_root_dir=str(root), max_steps=10, logger=loggers, log_every_n_steps=2,
                         callbacks=debug_callbacks(config), **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(OddNames(log_zero_from_step=8))
    wandb_run = Path(loggers[2].experiment.dir).parent
    finish_wandb()
    wandb_offline.finished(wandb_run)
    run = getattr(trainer, RUN_ATTRIBUTE)
    produced = {name for name in run.session.timeline.tags if name.startswith("debug/")}
    assert {"debug/loss_finite", "debug/anomaly/count", "debug/grad/global_norm", "debug/weight/update_ratio_global",
            "debug/memory/cpu_rss_mb", "debug/perf/step_ms",
            "debug/grad/norm/blocks.odd_block_x_y.weight"} <= produced, sorted(produced)
    for name in produced:  # valid for every logger, and no name is the folder of another
        assert SAFE_NAME.match(name) and len(name) <= 250, name
        assert not any(other.startswith(name + "/") for other in produced), name

    tensorboard = {tag for tag in read_scalars(loggers[0].log_dir) if tag.startswith("debug/")}
    rows = csv_rows(loggers[1])
    in_csv = {column for column in rows[0] if column.startswith("debug/")}
    in_wandb = {tag for tag in wandb_offline.metrics(wandb_run) if tag.startswith("debug/")}
    client = MlflowClient(tracking_uri=uri)
    in_mlflow = {name for name in client.get_run(loggers[3].run_id).data.metrics if name.startswith("debug/")}
    assert tensorboard == in_csv == in_wandb == in_mlflow == produced

    for column in in_csv:  # at most one value per logging window of log_every_n_steps=2 steps
        steps = [int(row["step"]) for row in rows if row[column]]
        assert len({step // 2 for step in steps}) == len(steps), (column, steps)
    finite = {int(row["step"]): float(row["debug/loss_finite"]) for row in rows if row["debug/loss_finite"]}
    assert finite == {1: 1.0, 3: 1.0, 5: 1.0, 7: 1.0, 9: 0.0}, "checked every step, logged where Lightning logs"

    debug_dir = Path(loggers[0].log_dir) / "debug_outputs"
    report = read_report(debug_dir)
    assert report["failed_checks"] == {}, "no logger rejected a name"
    assert report["findings"]["nonfinite_loss"]["first_step"] == 8
    files = ["debug_analysis.png", "events.jsonl", "report.json", "report.md"]
    assert wandb_offline.artifacts(wandb_run) == [{"name": f"lightning-debug-{loggers[2].version}",
                                                   "type": "lightning-debug-report", "files": files}]
    attached = sorted(Path(f.path).name for f in client.list_artifacts(loggers[3].run_id, "lightning_debug"))
    assert attached == files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(loggers[0].log_dir, size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == [], "the plot stays a file: no image card above the user's loss"
    text = accumulator.Tensors("debug/report/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("# lightning-debug report") and "nonfinite_loss" in text


# --- per-run outputs ----------------------------------------------------------------------------------------------


def _logger(kind: str, root: Path) -> Any:
    if kind == "wandb":
        return WandbLogger(offline=True, save_dir=str(root / "wandb"))
    if kind == "mlflow":
        return MLFlowLogger(tracking_uri=f"file:{root / 'mlruns'}")
    if kind == "tensorboard, fixed version":
        return TensorBoardLogger(str(root), name="tb", version=0)
    return False


@pytest.mark.parametrize("kind", ["no logger", "wandb", "mlflow", "tensorboard, fixed version",
                                  "absolute debug_output_dir"])
def test_two_runs_in_one_directory_write_two_separate_reports(offline_loggers: Path, kind: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    root = offline_loggers
    output = str(root / "shared_debug") if kind == "absolute debug_output_dir" else "debug_outputs"
    outcomes = []
    for planted in (3, None):  # the first run has a NaN from step 3, the second is healthy
        callback = AnomalyDetectionCallback(debug_output_dir=output)
        trainer = pl.Trainer(default_root_dir=str(root), max_steps=6, logger=_logger(kind, root),
                             callbacks=[callback], log_every_n_steps=1, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TinyRegressor(log_zero_from_step=planted))
        if kind == "wandb":
            finish_wandb()
        run = getattr(trainer, RUN_ATTRIBUTE)
        outcomes.append((run.session.output_dir, run.context.run_id))
    (first, first_id), (second, second_id) = outcomes
    assert first != second and first_id != second_id
    assert read_report(first)["run"] == first_id and read_report(second)["run"] == second_id
    assert "nonfinite_loss" in read_report(first)["findings"] and read_report(second)["findings"] == {}
    assert {event["run"] for event in read_events(first)} == {first_id}
    assert not (second / "events.jsonl").exists(), "a healthy run writes no events"
    searched = {"absolute debug_output_dir": root / "shared_debug",
                "tensorboard, fixed version": root / "tb"}.get(kind, root / "debug_outputs")
    assert sorted(path.parent for path in searched.rglob("report.json")) == sorted([first, second])
    capsys.readouterr()
    assert cli(["report", str(searched), "--no-plots"]) == 0
    assert "[2/2] rebuilt" in capsys.readouterr().out
    assert "nonfinite_loss" in read_report(first)["findings"]
    assert read_report(second)["findings"] == {}, "the healthy run's rebuilt report has nothing of the other run"


def test_the_offline_report_reads_the_last_run_of_a_shared_events_file(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """An events.jsonl that several runs appended to (before runs had their own directories)."""
    lines = [{"step": 4, "kind": "slow_step", "severity": "warning", "message": "slow", "run": "a"},
             {"step": 2, "kind": "nonfinite_loss", "severity": "error", "message": "nan", "run": "b"},
             {"step": 9, "kind": "slow_step", "severity": "warning", "message": "late line of a", "run": "a"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli(["report", str(tmp_path), "--no-plots"]) == 0
    report = read_report(tmp_path)
    assert list(report["findings"]) == ["nonfinite_loss"] and report["run"] == "b"
    assert "holds events of 1 earlier run(s); this report is of the last one (b) only" in capsys.readouterr().out


# --- cadence and callback_metrics -------------------------------------------------------------------------------


def test_scalars_follow_log_every_n_steps_and_a_nan_step_is_never_hidden(tmp_path: Path) -> None:
    class NaNAtOneStep(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss + (torch.log(torch.zeros(())) if self.trainer.global_step == 12 else 0)

    def fit(follow: bool) -> list[dict[str, str]]:
        logger = CSVLogger(str(tmp_path), name=f"follow_{follow}")
        callback = AnomalyDetectionCallback(DebugConfig(follow_log_cadence=follow, anomaly_detection_mode="skip"))
        trainer = pl.Trainer(max_steps=40, logger=logger, callbacks=[callback], log_every_n_steps=5, **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(NaNAtOneStep())
        return csv_rows(logger)

    rows = fit(True)
    lightning_steps = {int(r["step"]) for r in rows if r["train_loss"]}
    debug = {int(r["step"]): float(r["debug/loss_finite"]) for r in rows if r["debug/loss_finite"]}
    assert lightning_steps == {4, 9, 14, 19, 24, 29, 34, 39}
    assert debug == {4: 1.0, 9: 1.0, 14: 0.0, 19: 1.0, 24: 1.0, 29: 1.0, 34: 1.0, 39: 1.0}, \
        "debug values on Lightning's rows; the row after the NaN step holds its 0"
    counts = {int(r["step"]) for r in rows if r["debug/anomaly/count"]}
    assert counts == {14, 19, 24, 29, 34, 39}, "a count is first written once it is not 0"
    assert len(rows) == 8, "Lightning's 8 rows, no row of the plugin's own"
    every = {int(r["step"]) for r in fit(False) if r["debug/loss_finite"]}
    assert every == set(range(40)), "follow_log_cadence=False logs every check step"


def test_debug_values_in_callback_metrics_drive_early_stopping(tmp_path: Path) -> None:
    stopper = EarlyStopping(monitor="debug/anomaly/count", mode="min", divergence_threshold=0.5, patience=1000,
                            check_on_train_epoch_end=True, strict=True)
    callback = AnomalyDetectionCallback(DebugConfig(expose_callback_metrics=True))
    trainer = make_trainer(tmp_path, [callback, stopper], max_steps=200, limit_train_batches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyRegressor(log_zero_from_step=9))
    assert trainer.global_step == 12, "stopped at the end of the epoch in which the anomaly count rose"
    assert float(trainer.callback_metrics["debug/loss_finite"]) == 0.0
    assert float(trainer.callback_metrics["debug/anomaly/count"]) >= 2.0


# --- configuration errors at parse time ---------------------------------------------------------------------------


def _bad_yaml(directory: Path, init_args: dict[str, Any]) -> Path:
    import yaml

    document = {"trainer": {"logger": False, "max_steps": 1, "callbacks": [
        {"class_path": "lightning_debug.AnomalyDetectionCallback", "init_args": init_args}]}}
    path = directory / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_bad_enum_value_in_yaml_fails_at_parse_time_with_exit_2_and_no_traceback(tmp_path: Path) -> None:
    """From the command line, as a user runs it: ``--print_config`` used to print it and return 0."""
    _bad_yaml(tmp_path, {"anomaly_detection_mode": "explode"})
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config", "bad.yaml",
                                "--print_config"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr and completed.stdout == ""
    assert ".anomaly_detection_mode: " in completed.stderr and "given: explode" in completed.stderr


@pytest.mark.parametrize("init_args", [{"config": {"level": "deep"}}, {"level": "extreme"},
                                       {"config": {"anomaly_detection_mode": "sometimes"}}])
def test_bad_enum_values_anywhere_in_the_callbacks_are_usage_errors(tmp_path: Path, init_args: dict[str, Any],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    path = _bad_yaml(tmp_path, init_args)
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("ignore")
        LightningCLI(TinyRegressor, run=False, args=["--config", str(path)], save_config_callback=None)
    assert exit_info.value.code == 2
    field = next(iter(init_args["config"])) if "config" in init_args else next(iter(init_args))
    assert f'Parser key "{field}"' in capsys.readouterr().err


# --- EXPERT in warn mode --------------------------------------------------------------------------------------------


def test_expert_level_in_warn_mode_survives_a_nan_and_names_the_operation(tmp_path: Path) -> None:
    callback = AnomalyDetectionCallback(level="expert", anomaly_detection_mode="warn")
    trainer = make_trainer(tmp_path, [callback], max_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyRegressor(log_zero_from_step=5))
    assert trainer.global_step == 10 and trainer.state.status == "finished"
    debug_dir = Path(trainer.log_dir) / "debug_outputs"
    report = read_report(debug_dir)
    assert report["status"] == "finished" and report["failed_checks"] == {}
    start = next(e for e in read_events(debug_dir) if e["kind"] == "nonfinite_loss")
    assert start["step"] == 5 and start["details"]["cause"]["operation"] == "torch.log"
    assert start["details"]["cause"]["source"]["file"].endswith("toolkit.py"), "the user's line"
    assert not torch.is_anomaly_enabled(), "anomaly mode is restored after the run"


# --- the offline report falls back on TensorBoard -----------------------------------------------------------------


def test_offline_report_of_a_truncated_events_file_reports_the_nan_from_tensorboard(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(DebugConfig(print_summary=False))], max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyRegressor(log_zero_from_step=12))
    debug_dir = Path(trainer.log_dir) / "debug_outputs"
    events = (debug_dir / "events.jsonl").read_text()
    (debug_dir / "events.jsonl").write_text(events[: len(events.splitlines()[0]) // 2])  # cut in its first line
    (debug_dir / "report.json").unlink()
    assert cli(["report", str(debug_dir), "--no-plots"]) == 0
    report = read_report(debug_dir)
    finding = report["findings"]["nonfinite_loss"]
    assert (finding["first_step"], finding["last_step"], finding["source"]) == (12, 19, "tensorboard")
    assert report["rebuilt"]["findings_from_tensorboard"] == ["nonfinite_loss"]
    assert report["rebuilt"]["truncated_last_line"] is True
    markdown = (debug_dir / "report.md").read_text()
    assert "### 1. `nonfinite_loss` (error)" in markdown and "TensorBoard scalars" in markdown
    assert "from the TensorBoard scalars, not events.jsonl: nonfinite_loss" in capsys.readouterr().out


# --- the console ----------------------------------------------------------------------------------------------------


def test_each_finding_is_one_short_line_on_the_console(tmp_path: Path) -> None:
    config = DebugConfig(gradient_checking_frequency=1, anomaly_detection_mode="skip", print_summary=False)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=30)
    with console_lines() as caught:
        trainer.fit(TinyRegressor(nan_layer_from_step=4, unused_layer=True))
    ours = [line for line in caught if line.startswith("lightning-debug: [step")]
    assert ours and all("\n" not in line and len(line) <= 300 for line in ours), ours
    kinds = {re.search(r"\((\w+), epoch \d+, batch \d+\)", line).group(1) for line in ours}  # type: ignore[union-attr]
    assert {"missing_grad", "nonfinite_loss", "nonfinite_grad"} <= kinds, ours
    assert all(" Hint: " in line or " Cause: " in line for line in ours)


# --- the C heap reading is psutil's ---------------------------------------------------------------------------------


def test_heap_reading_is_psutil_heap_info() -> None:
    before = psutil.heap_info()
    reading = heap_in_use()
    after = psutil.heap_info()
    assert reading is not None
    low, high = sorted((before.heap_used + before.mmap_used, after.heap_used + after.mmap_used))
    assert low - (1 << 20) <= reading <= high + (1 << 20)
