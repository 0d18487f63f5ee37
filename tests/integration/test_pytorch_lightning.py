"""The same callbacks under ``pytorch_lightning.Trainer``, the standalone package, as under ``lightning``'s (issue 44).

Both packages installed side by side and used in one process: a ``pytorch_lightning`` fit with that package's own
TensorBoardLogger names a planted NaN and writes events, report and the TensorBoard layout and text into the logger's
version folder; a healthy one is quiet; its checkpoint carries the counts into a resumed fit; its LightningCLI takes
the callbacks from YAML with the compact parser; and a ``lightning`` fit beside them is unchanged. Without the
standalone package the module is skipped (it stays optional).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

ptl = pytest.importorskip("pytorch_lightning")

from lightning_debug import AnomalyDetectionCallback, DebugConfig, debug_callbacks  # noqa: E402
from lightning_debug.callbacks import frameworks  # noqa: E402
from lightning_debug.report.tensorboard import LAYOUT_CATEGORIES  # noqa: E402
from tests.harness.toolkit import (TinyRegressor, make_trainer, read_events, read_report, read_scalars,  # noqa: E402
                                   regression_data)

pytestmark = pytest.mark.timeout(180)

SERIOUS = {"warning", "error", "critical"}
CATEGORIES = [name for name in LAYOUT_CATEGORIES if not name.endswith("activations")]  # log_activations is off
NAN_FROM = 6
CONFIG = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=2, memory_profiling_frequency=4,
                     performance_profiling_frequency=2, save_plots=False, print_summary=False)


class StandaloneRegressor(ptl.LightningModule):
    """A ``pytorch_lightning`` module: an MLP whose loss adds ``log(0)`` from optimizer step ``nan_from`` on."""

    def __init__(self, nan_from: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.nan_from = nan_from

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.nan_from is not None and self.global_step >= self.nan_from:
            loss = loss + torch.log(torch.zeros((), device=loss.device))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


def standalone_fit(root: Path, model: StandaloneRegressor, callbacks: list[Any], max_steps: int,
                   ckpt_path: str | None = None, **options: Any) -> Any:
    from pytorch_lightning.loggers import TensorBoardLogger

    ptl.seed_everything(0)
    options = dict(dict(logger=TensorBoardLogger(str(root), name="tb"), enable_checkpointing=False), **options)
    trainer = ptl.Trainer(default_root_dir=str(root), max_steps=max_steps, accelerator="cpu", devices=1,
                          enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                          callbacks=callbacks, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def serious(events: list[dict[str, Any]]) -> list[str]:
    return [f"{e['kind']}@{e['step']}: {e['message'][:200]}" for e in events
            if e.get("severity") in SERIOUS and e.get("episode") != "end"]


def read_layout(log_dir: str) -> tuple[Any, str]:
    """The Custom Scalars layout and the last report text that a run wrote into its TensorBoard files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    accumulator = EventAccumulator(log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    config = accumulator.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0]
    text = accumulator.Tensors("debug/report/text_summary")[-1].tensor_proto.string_val[0].decode()
    return layout_pb2.Layout.FromString(config), text


def test_the_callbacks_are_callbacks_of_both_packages() -> None:
    from lightning.pytorch.callbacks import Callback

    callback = AnomalyDetectionCallback()
    assert isinstance(callback, Callback) and isinstance(callback, ptl.Callback)


def test_a_nan_under_a_pytorch_lightning_trainer_is_named_in_the_loggers_folder(tmp_path: Path) -> None:
    trainer = standalone_fit(tmp_path, StandaloneRegressor(nan_from=NAN_FROM), debug_callbacks(CONFIG), max_steps=10)
    log_dir = Path(trainer.logger.log_dir)
    debug = log_dir / "debug_outputs"
    assert log_dir == tmp_path / "tb" / "version_0" and not (tmp_path / "debug_outputs").exists()
    starts = [e for e in read_events(debug) if e["kind"] == "nonfinite_loss" and e.get("episode") != "end"]
    assert [(e["step"], e["callback"]) for e in starts] == [(NAN_FROM, "AnomalyDetectionCallback")]
    report = read_report(debug)
    assert report["findings"]["nonfinite_loss"]["first_step"] == NAN_FROM and report["failed_checks"] == {}
    assert "nonfinite_loss" in (debug / "report.md").read_text()

    layout, text = read_layout(str(log_dir))
    assert [category.title for category in layout.category] == CATEGORIES
    assert "global gradient norm" in {chart.title for category in layout.category for chart in category.chart}
    assert text.startswith("# lightning-debug report") and "nonfinite_loss" in text
    scalars = read_scalars(log_dir)
    finite = dict(scalars["debug/loss_finite"])
    assert finite[NAN_FROM - 1] == 1.0 and finite[NAN_FROM] == 0.0, "the plugin's scalars on pytorch_lightning's rows"
    assert "train_loss" in scalars and "debug/grad/global_norm" in scalars


def test_a_healthy_pytorch_lightning_fit_is_quiet(tmp_path: Path) -> None:
    trainer = standalone_fit(tmp_path, StandaloneRegressor(), debug_callbacks(CONFIG), max_steps=12)
    debug = Path(trainer.logger.log_dir) / "debug_outputs"
    assert serious(read_events(debug)) == []
    report = read_report(debug)
    assert report["status"] == "finished" and report["failed_checks"] == {}
    assert not {kind for kind, entry in report["findings"].items() if entry["severity"] in SERIOUS}


def test_pytorch_lightning_csv_and_mlflow_loggers_get_the_folder_the_scalars_and_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from pytorch_lightning.loggers import CSVLogger, MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    loggers = [CSVLogger(str(tmp_path), name="csv"), MLFlowLogger(tracking_uri=uri)]
    standalone_fit(tmp_path, StandaloneRegressor(nan_from=4), [AnomalyDetectionCallback(CONFIG)], max_steps=6,
                   logger=loggers)
    debug = Path(loggers[0].log_dir) / "debug_outputs"
    assert read_report(debug)["findings"]["nonfinite_loss"]["first_step"] == 4
    client = MlflowClient(tracking_uri=uri)
    assert sorted(Path(f.path).name for f in client.list_artifacts(loggers[1].run_id, "lightning_debug")) \
        == ["events.jsonl", "report.json", "report.md"]
    assert "debug/loss_finite" in client.get_run(loggers[1].run_id).data.metrics


def test_a_lightning_fit_beside_pytorch_lightning_is_unchanged(tmp_path: Path) -> None:
    """``lightning``'s Trainer and loggers in the process that ran the standalone package's fits above."""
    import lightning.pytorch as pl

    assert "pytorch_lightning" in sys.modules
    pl.seed_everything(0)
    trainer = make_trainer(tmp_path, debug_callbacks(CONFIG), max_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyRegressor(log_zero_from_step=NAN_FROM))
    debug = Path(trainer.logger.log_dir) / "debug_outputs"
    assert [e["step"] for e in read_events(debug) if e["kind"] == "nonfinite_loss" and e.get("episode") != "end"] \
        == [NAN_FROM]
    layout, text = read_layout(trainer.logger.log_dir)
    assert [category.title for category in layout.category] == CATEGORIES and "nonfinite_loss" in text


def test_a_pytorch_lightning_checkpoint_carries_the_counts_into_the_resumed_fit(tmp_path: Path) -> None:
    first = standalone_fit(tmp_path, StandaloneRegressor(nan_from=3), [AnomalyDetectionCallback(CONFIG)], max_steps=6)
    checkpoint = tmp_path / "mid.ckpt"
    first.save_checkpoint(str(checkpoint))
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    assert [key for key in saved if key.startswith("AnomalyDetectionCallback")], list(saved)
    resumed = standalone_fit(tmp_path, StandaloneRegressor(nan_from=3), [AnomalyDetectionCallback(CONFIG)],
                             max_steps=10, ckpt_path=str(checkpoint))
    count = read_scalars(resumed.logger.log_dir)["debug/anomaly/count"]
    assert count[-1] == (9, 7.0), "steps 3-5 before the checkpoint and 6-9 after it"


def test_pytorch_lightning_cli_takes_the_callbacks_from_yaml_with_the_compact_parser(tmp_path: Path) -> None:
    """``pytorch_lightning.cli.LightningCLI`` with ``parser_class=CompactArgumentParser`` (that argument exists from
    2.5.1; before, the plain parser) builds the callbacks from YAML; a bad value is the compact usage error."""
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI

    from lightning_debug.callbacks.cli import CompactArgumentParser

    compact = "parser_class" in inspect.signature(LightningCLI).parameters
    parser = {"parser_class": CompactArgumentParser} if compact else {}
    document = {"trainer": {"max_steps": 8, "enable_progress_bar": False, "enable_model_summary": False,
                            "enable_checkpointing": False, "log_every_n_steps": 1,
                            "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                                       "init_args": {"save_dir": str(tmp_path), "name": "tb"}},
                            "callbacks": [{"class_path": "lightning_debug.AnomalyDetectionCallback",
                                           "init_args": {"anomaly_check_frequency": 1}}]},
                "model": {"nan_from": 4}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = LightningCLI(StandaloneRegressor, save_config_callback=None, args=["fit", "--config", str(path)],
                           **parser)
    debug = Path(cli.trainer.logger.log_dir) / "debug_outputs"
    assert [e["step"] for e in read_events(debug) if e["kind"] == "nonfinite_loss" and e.get("episode") != "end"] \
        == [4]
    if not compact:
        return
    document["trainer"]["callbacks"][0]["init_args"]["anomaly_check_frequency"] = 0
    path.write_text(yaml.safe_dump(document))
    printed = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LightningCLI(StandaloneRegressor, save_config_callback=None, args=["fit", "--config", str(path)], **parser)
    assert exit_info.value.code == 2
    assert printed.getvalue().startswith("error: trainer.callbacks[0] (lightning_debug.AnomalyDetectionCallback)"
                                         ".anomaly_check_frequency: invalid value"), printed.getvalue()


def test_a_pytorch_lightning_too_old_to_serve_is_named_with_what_to_install(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What an installed ``pytorch_lightning`` 1.x gets: the version and the install line, before any step; a
    ``lightning`` trainer in the same process is not concerned."""
    import lightning.pytorch as pl

    monkeypatch.setattr(frameworks, "STANDALONE_PROBLEM", frameworks.unserved_reason("1.9.5"))
    with pytest.raises(RuntimeError, match=r'pytorch_lightning 1\.9\.5: pip install -U "pytorch-lightning>=2\.2"'):
        standalone_fit(tmp_path, StandaloneRegressor(), [AnomalyDetectionCallback(CONFIG)], max_steps=2)
    frameworks.check_trainer(pl.Trainer(logger=False, enable_progress_bar=False))


def test_without_the_standalone_package_only_lightning_is_a_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # what find_spec says when it is not installed
    assert frameworks._standalone_callback() == (None, None)
