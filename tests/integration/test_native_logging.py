"""Debug scalars through Lightning's own logging and at the Accelerate loop's steps (issue 26).

Under a Trainer the scalars are added to the rows Lightning writes
(``log_every_n_steps``), on the user's step axis, also in manual optimization with two optimizers;
read back from CSVLogger's metrics.csv. Under Accelerate they are logged at the loop's steps, so a
tracker that drops lower steps (W&B) keeps every one; read back from the offline W&B run file.
"""

from __future__ import annotations

import csv
import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_debug import DebugConfig, debug_callbacks
from lightning_debug.callbacks.base import RUN_ATTRIBUTE
from tests.harness.toolkit import TinyRegressor, regression_data
from tests.integration.test_multi_optimizer import TinyGAN

pytestmark = pytest.mark.timeout(240)

QUIET: dict[str, Any] = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)
EVERY_STEP = dict(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                  performance_profiling_frequency=1, log_gradients=True, log_weights=True, log_activations=True)


class LoggingRegressor(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class LoggingGAN(TinyGAN):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        super().training_step(batch, batch_idx)
        self.log("batch_seen", float(batch_idx))


def csv_rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as handle:  # type: ignore[union-attr]
        return list(csv.DictReader(handle))


def fit_csv(root: Path, name: str, model: pl.LightningModule, callbacks: list[pl.Callback],
            **trainer_options: Any) -> pl.Trainer:
    torch.manual_seed(0)
    options = dict(max_steps=60, log_every_n_steps=5, **QUIET)
    options.update(trainer_options)
    trainer = pl.Trainer(logger=CSVLogger(str(root), name=name), callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return trainer


@pytest.mark.parametrize("config", [DebugConfig(print_summary=False, save_plots=False),
                                    DebugConfig(print_summary=False, save_plots=False, level="advanced",
                                                profile_steps=(10, 5), **EVERY_STEP)],
                         ids=["defaults", "every check every step"])
def test_debug_scalars_are_on_the_trainers_own_rows_and_add_none(tmp_path: Path, config: DebugConfig) -> None:
    plain = csv_rows(fit_csv(tmp_path, "plain", LoggingRegressor(), []))
    trainer = fit_csv(tmp_path, "debug", LoggingRegressor(), debug_callbacks(config))
    rows = csv_rows(trainer)
    assert len(rows) == len(plain) == 12, "no row more than the run without the plugin"
    lightning_steps = [int(row["step"]) for row in rows]
    assert lightning_steps == [int(row["step"]) for row in plain] == list(range(4, 60, 5))
    columns = [column for column in rows[0] if column.startswith("debug/")]
    assert {"debug/loss_finite", "debug/grad/global_norm", "debug/perf/step_ms",
            "debug/memory/cpu_rss_mb"} <= set(columns), columns
    assert "debug/anomaly/count" not in columns, "a count is first written once it is not 0"
    for row in rows:
        assert row["train_loss"], "every row is one of the user's rows"
    run = getattr(trainer, RUN_ATTRIBUTE)
    assert not [kind for kind, entry in run.session.timeline.findings().items()
                if entry.get("severity") in ("warning", "error", "critical")], "a healthy run is quiet"
    observed = {tag for tag in run.session.timeline.tags if tag.startswith("debug/")}
    assert observed == set(columns), "every measured scalar reaches the logger"
    if config.gradient_checking_frequency == 1:
        for column in columns:  # measured on every step: on every row (timings leave out the profiled steps 10-14)
            assert all(row[column] for row in rows if column.startswith("debug/grad") or row["step"] != "14"), column
        assert not rows[2]["debug/perf/step_ms"], "no stale timing repeated on a row where none was measured"
        norms = [float(row["debug/grad/global_norm"]) for row in rows]
        assert len(set(norms)) == len(norms), "each row carries its own step's norm"
        measured = dict(zip(*run.session.timeline.values("debug/grad/global_norm")))
        on_rows = {int(row["step"]): norm for row, norm in zip(rows, norms) if int(row["step"]) in measured}
        assert len(on_rows) >= 6 and all(norm == pytest.approx(measured[step]) for step, norm in on_rows.items())
    else:
        finite = [int(row["step"]) for row in rows if row["debug/loss_finite"]]
        assert finite and all(step in lightning_steps for step in finite)


class DebugNamesInLightningsWalk(pl.Callback):
    """How many debug names Lightning's end-of-batch walk over its result collection meets, per step (read
    after every callback's batch start)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.counts.append(sum(name.split(".", 1)[-1].startswith("debug/") for name, _ in trainer._results.valid_items()))


def test_debug_names_leave_lightnings_per_batch_walk_once_their_row_is_written(tmp_path: Path) -> None:
    walk = DebugNamesInLightningsWalk()
    config = DebugConfig(print_summary=False, save_plots=False)
    trainer = fit_csv(tmp_path, "walk", LoggingRegressor(), [*debug_callbacks(config), walk], max_steps=30)
    rows = csv_rows(trainer)
    assert [float(row["debug/loss_finite"]) for row in rows] == [1.0] * 6, "every row still has its values"
    assert len(walk.counts) == 30 and not any(walk.counts), walk.counts
    assert trainer.callback_metrics["debug/loss_finite"] == 1.0, "callback_metrics keeps the last row's values"
    run = getattr(trainer, RUN_ATTRIBUTE)
    assert not [kind for kind, entry in run.session.timeline.findings().items()
                if entry.get("severity") in ("warning", "error", "critical")], "a healthy run is quiet"


def test_debug_scalars_share_the_users_rows_beside_lightnings_monitors_and_with_accumulation(tmp_path: Path) -> None:
    """Lightning's row is told from the writes of ``DeviceStatsMonitor`` (after the plugin, at the same step) and
    ``LearningRateMonitor``; batches that only accumulate write no row."""

    def monitors() -> list[pl.Callback]:
        return [DeviceStatsMonitor(cpu_stats=True), LearningRateMonitor()]

    options = dict(max_steps=20, accumulate_grad_batches=2)
    plain = csv_rows(fit_csv(tmp_path, "plain", LoggingRegressor(), monitors(), **options))
    config = DebugConfig(print_summary=False, save_plots=False)
    rows = csv_rows(fit_csv(tmp_path, "debug", LoggingRegressor(), [*debug_callbacks(config), *monitors()], **options))
    assert len(rows) == len(plain), "no row more than the run without the plugin"
    user_steps = [int(row["step"]) for row in rows if row["train_loss"]]
    assert user_steps == [4, 9, 14, 19]
    debug_steps = [int(row["step"]) for row in rows if row["debug/loss_finite"]]
    assert debug_steps == user_steps
    assert all(row["train_loss"] for row in rows if row["debug/loss_finite"]), "on the user's own rows"


def test_debug_scalars_have_rows_of_their_own_when_the_user_logs_nothing_per_step(tmp_path: Path) -> None:
    config = DebugConfig(print_summary=False, save_plots=False)
    rows = csv_rows(fit_csv(tmp_path, "silent", TinyRegressor(), debug_callbacks(config), max_steps=30))
    assert [int(row["step"]) for row in rows if row["debug/loss_finite"]] == list(range(4, 30, 5))
    assert len(rows) == 6, "one row per logging step"


def test_a_nan_between_two_rows_shows_on_the_next_row(tmp_path: Path) -> None:
    class NaNAtOneStep(LoggingRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss + (torch.log(torch.zeros(())) if self.trainer.global_step == 12 else 0)

    config = DebugConfig(anomaly_check_frequency=1, anomaly_detection_mode="skip", print_summary=False,
                         save_plots=False)
    rows = csv_rows(fit_csv(tmp_path, "nan", NaNAtOneStep(), debug_callbacks(config), max_steps=30))
    finite = {int(row["step"]): float(row["debug/loss_finite"]) for row in rows}
    assert finite == {4: 1.0, 9: 1.0, 14: 0.0, 19: 1.0, 24: 1.0, 29: 1.0}


def test_gan_debug_scalars_share_the_users_step_axis_with_one_norm_series_per_optimizer(tmp_path: Path) -> None:
    config = DebugConfig(print_summary=False, save_plots=False, level="advanced", **EVERY_STEP)
    trainer = fit_csv(tmp_path, "gan", LoggingGAN(), debug_callbacks(config), max_steps=-1, max_epochs=1,
                      limit_train_batches=16)
    assert trainer.global_step == 32, "two optimizer steps per batch"
    rows = csv_rows(trainer)
    user_steps = [int(row["step"]) for row in rows if row["batch_seen"]]
    assert user_steps == [4, 9, 14], "Lightning's axis counts batches, not optimizer steps"
    assert len(rows) == 3, "no debug row of its own"
    columns = [column for column in rows[0] if column.startswith("debug/")]
    assert {"debug/grad/global_norm_optimizer_0", "debug/grad/global_norm_optimizer_1",
            "debug/weight/update_ratio_global_optimizer_0", "debug/weight/update_ratio_global_optimizer_1"} <= set(columns)
    assert "debug/grad/global_norm" not in columns, "no series that zig-zags between the two optimizers"
    for row in rows:
        generator, discriminator = (float(row[f"debug/grad/global_norm_optimizer_{i}"]) for i in (0, 1))
        assert generator > 0 and discriminator > 0 and generator != discriminator


def test_follow_log_cadence_off_logs_every_check_step(tmp_path: Path) -> None:
    config = DebugConfig(anomaly_check_frequency=1, follow_log_cadence=False, print_summary=False, save_plots=False)
    rows = csv_rows(fit_csv(tmp_path, "every", LoggingRegressor(), debug_callbacks(config), max_steps=20))
    assert {int(row["step"]) for row in rows if row["debug/loss_finite"]} == set(range(20))


# --- Accelerate: trackers never drop a value --------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
@pytest.mark.parametrize("user_step", ["0-based loop counter", "optimizer steps done", "micro-batches"])
def test_accelerate_with_wandb_keeps_every_debug_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fresh_accelerate_state: None, user_step: str) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness import wandb_offline

    for key, value in dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp_path / "wandb",
                           WANDB_CACHE_DIR=tmp_path / "wandb_cache", WANDB_CONFIG_DIR=tmp_path / "wandb_config",
                           WANDB_DATA_DIR=tmp_path / "wandb_data").items():
        monkeypatch.setenv(key, str(value))
    (tmp_path / "wandb").mkdir()
    torch.manual_seed(0)
    accumulation = 2 if user_step == "micro-batches" else 1
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=str(tmp_path),
                              gradient_accumulation_steps=accumulation)
    accelerator.init_trackers("native", init_kwargs={"wandb": {"dir": str(tmp_path / "wandb")}})
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(regression_data(), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    debugger = AccelerateDebugger(accelerator, model, optimizer, anomaly_check_frequency=1,
                                  gradient_checking_frequency=1, print_summary=False, save_plots=False)
    micro_batches = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            done_before = debugger.step
            debugger.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro_batches += 1
        step = {"0-based loop counter": done_before, "optimizer steps done": debugger.step,
                "micro-batches": micro_batches}[user_step]
        accelerator.log({"train_loss": float(loss)}, step=step)
        if debugger.step >= 12:
            break
    debugger.finish()
    wandb_dir = Path(accelerator.get_tracker("wandb", unwrap=True).dir).parent
    accelerator.end_training()
    history = wandb_offline.metrics(wandb_offline.finished(wandb_dir))
    timeline = debugger.run.session.timeline
    measured = len(timeline.values("debug/grad/global_norm")[0])
    assert measured == 12
    assert len(history["train_loss"]) == micro_batches, "the loop's own values are all kept"
    norms = history["debug/grad/global_norm"]
    assert len(norms) == measured, f"W&B dropped debug values: {len(norms)} of {measured} kept"
    assert [step for step, _ in norms] == sorted(step for step, _ in norms)


# --- the end of a run is labelled with the last batch's epoch ---------------------------------------------------


def test_end_of_run_events_carry_the_epoch_and_batch_of_the_last_batch(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from tests.harness.toolkit import debug_dir, make_trainer, read_events

    class LongEpoch(TinyRegressor):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(), batch_size=4)

    config = DebugConfig(print_summary=False, save_plots=False)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LongEpoch(log_zero_from_step=20))
    ended = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss" and e.get("episode") == "end"]
    assert [(e["epoch"], e["batch"]) for e in ended] == [(0, 29)], "64 batches per epoch: step 29 is in epoch 0"
