"""Faults a long real run meets: each ends in at most one clear warning and a run that goes on,
or in the user's own exception, untouched; never in a crash inside the plugin."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import console_lines, TinyRegressor, debug_dir, make_trainer, read_events, read_report, regression_data


def all_four(**overrides: Any) -> list[pl.Callback]:
    config = DebugConfig(gradient_checking_frequency=2, memory_profiling_frequency=2, performance_profiling_frequency=2,
                         log_gradients=True, log_weights=True, **overrides)
    return debug_callbacks(config)


def plugin_warnings(caught: list[str]) -> list[str]:
    return [line for line in caught if "lightning-debug" in line]


def fit_all_four(tmp_path: Path, model: pl.LightningModule, steps: int = 12, **kwargs: Any) -> tuple[pl.Trainer, list[str]]:
    trainer = make_trainer(tmp_path, kwargs.pop("callbacks", all_four()), max_steps=steps, **kwargs)
    with console_lines() as caught:
        trainer.fit(model)
    return trainer, plugin_warnings(caught)


def failures(messages: list[str]) -> list[str]:
    """Warnings that say a check itself broke (as opposed to findings)."""
    return [m for m in messages if re.search(r" failed (at step -?\d+ )?\(", m)]


def test_logger_without_histograms_is_one_warning(tmp_path: Path) -> None:
    trainer, messages = fit_all_four(tmp_path, TinyRegressor(), logger=CSVLogger(str(tmp_path)))
    assert trainer.global_step == 12 and failures(messages) == []
    assert len([m for m in messages if "histogram" in m.lower()]) == 1


class GrowingModel(TinyRegressor):
    """Adds a parameter at step 4 and removes one at step 8 (the optimizer keeps the originals)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 4 and not hasattr(self, "extra"):
            self.extra = nn.Linear(16, 1)
        if self.trainer.global_step == 8 and hasattr(self, "extra"):
            del self.extra
        loss = super().training_step(batch, batch_idx)
        return loss + (self.extra(torch.ones(1, 16)).sum() * 0 if hasattr(self, "extra") else 0)


def test_parameters_added_and_removed_mid_run(tmp_path: Path) -> None:
    trainer, messages = fit_all_four(tmp_path, GrowingModel())
    assert trainer.global_step == 12 and failures(messages) == []


class OddParameters(TinyRegressor):
    """Zero-size, complex, integer (frozen) and sparse-gradient parameters; a dict batch of mixed types."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.complex_weight = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        self.counter = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.unused_grad_none = nn.Parameter(torch.ones(2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch["x"], batch["y"]
        assert batch["name"] == "rows" and batch["index"] >= 0
        loss = nn.functional.mse_loss(self(x), y)
        extra = self.empty.sum() + self.complex_weight.abs().sum() * 1e-3
        extra = extra + self.embedding(torch.tensor([1, 2])).sum() * 1e-3
        return loss + extra

    def configure_optimizers(self) -> torch.optim.Optimizer:
        dense = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("embedding")]
        return torch.optim.SGD([{"params": dense}, {"params": self.embedding.parameters()}], lr=0.01)

    def train_dataloader(self) -> DataLoader:
        data = regression_data()
        rows = [{"x": data.tensors[0][i], "y": data.tensors[1][i], "name": "rows", "index": i} for i in range(len(data))]
        return DataLoader(rows, batch_size=16, collate_fn=lambda items: {
            "x": torch.stack([r["x"] for r in items]), "y": torch.stack([r["y"] for r in items]),
            "name": "rows", "index": items[0]["index"]})


def test_odd_parameters_and_non_tensor_batches(tmp_path: Path) -> None:
    """The plugin's own code raises no warning of its own in the user's log (a complex weight read with
    ``.float()`` did: "Casting complex values to real discards the imaginary part")."""
    import lightning_debug

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, messages = fit_all_four(tmp_path, OddParameters(), callbacks=all_four(level="advanced"))
    package = str(Path(lightning_debug.__file__).parent)
    assert [str(w.message) for w in caught if w.filename.startswith(package)] == []
    assert trainer.global_step == 12 and failures(messages) == []
    missing = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "missing_grad"]
    assert missing and "unused_grad_none" in json.dumps(missing[0]["details"])


def test_keyboard_interrupt_mid_step_leaves_readable_files(tmp_path: Path) -> None:
    class Interrupted(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 6:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, all_four(), max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SystemExit):  # Lightning turns Ctrl-C into a graceful exit(1)
            trainer.fit(Interrupted(log_zero_from_step=3))
    events = read_events(debug_dir(trainer))
    assert any(e["kind"] == "nonfinite_loss" for e in events)
    assert read_report(debug_dir(trainer))["status"] == "interrupted"


def test_nan_every_step_writes_one_line_per_episode(tmp_path: Path) -> None:
    trainer, _ = fit_all_four(tmp_path, TinyRegressor(log_zero_from_step=0), steps=60,
                              callbacks=all_four(anomaly_detection_mode="warn"))
    lines = (debug_dir(trainer) / "events.jsonl").read_text().splitlines()
    loss_lines = [json.loads(line) for line in lines if '"nonfinite_loss"' in line]
    assert [e["episode"] for e in loss_lines] == ["start", "end"]
    assert loss_lines[1]["details"]["steps"] == 60
    assert read_report(debug_dir(trainer))["findings"]["nonfinite_loss"]["steps"] == 60


def test_a_condition_that_keeps_coming_back_cannot_flood_the_events_file(tmp_path: Path) -> None:
    """Found by the 100,000-step run: a value flapping around a threshold opened and closed an episode
    on every check. Short gaps now continue the episode; past 25 episodes of a kind, more are counted
    in report.json but not written."""

    class Flapping(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            step = self.trainer.global_step
            flapping = step < 40 and step % 2 == 0  # one long episode with one-step gaps
            recurring = step >= 40 and step % 5 == 0  # step 40 continues the first episode, then 31 more
            return loss + torch.log(torch.zeros(())) if flapping or recurring else loss

    trainer, _ = fit_all_four(tmp_path, Flapping(), steps=200)
    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss"]
    starts = [e for e in events if e["episode"] == "start"]
    assert starts[0]["step"] == 0 and starts[1]["step"] == 45, "the flapping first 40 steps are one episode"
    assert len(starts) == 25 and "later ones are counted in summary lines" in starts[-1]["message"]
    assert len([e for e in events if e["episode"] == "end"]) == 25
    finding = read_report(debug_dir(trainer))["findings"]["nonfinite_loss"]
    assert finding["episodes"] == 32 and finding["steps"] == 20 + 32
    summaries = [e for e in events if e["episode"] == "summary"]  # the end of the run: the totals, once
    assert [(s["details"]["episodes"], s["details"]["steps"], s["details"]["last_step"]) for s in summaries] == [
        (32, 52, finding["last_step"])]


class UnreducibleParameter(nn.Parameter):
    """A parameter type (as a quantization or sharding library might define) whose values cannot be
    concatenated or reduced outside its own layer: the plugin's weight measurements must fail on it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("cat", "stack", "_foreach_norm", "vector_norm", "_foreach_mul"):
            raise NotImplementedError(f"{cls.__name__} does not support {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class WithUnreducibleWeights(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = UnreducibleParameter(self.head.weight.detach().clone())


def test_a_check_that_fails_on_purpose_is_reported_as_failed_not_clean(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    callbacks = debug_callbacks(DebugConfig(gradient_checking_frequency=3, log_weights=True, print_summary=True))
    trainer, messages = fit_all_four(tmp_path, WithUnreducibleWeights(), callbacks=callbacks)
    assert trainer.global_step == 12, "training goes on"
    report = read_report(debug_dir(trainer))
    failed = report["failed_checks"]
    expected = {"AnomalyMonitor.before_optimizer_step", "GradientMonitor.before_optimizer_step",
                "AnomalyMonitor.finalize"}
    assert set(failed) == expected
    assert failed["GradientMonitor.before_optimizer_step"]["count"] == 4, "steps 0, 3, 6 and 9"
    assert failed["AnomalyMonitor.before_optimizer_step"]["first_step"] == 0
    assert "UnreducibleParameter does not support" in next(iter(failed["AnomalyMonitor.finalize"]["reasons"]))
    assert sorted(m.split(" failed")[0] for m in failures(messages)) == sorted(f"lightning-debug: {name}"
                                                                                for name in expected), \
        "one warning per check, not one per step"

    markdown = (debug_dir(trainer) / "report.md").read_text()
    assert "## Checks that failed" in markdown and "No problems found." not in markdown
    assert all(f"| {name} |" in markdown for name in expected)
    console = " ".join(capsys.readouterr().out.split())  # the headline may wrap
    assert "nothing wrong found" not in console and "3 check(s) failed and did not run (since step 0)" in console
    assert all(f"failed {name} since step" in console for name in expected)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    text = accumulator.Tensors("debug/failed_checks/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert all(name in text for name in expected)


@pytest.mark.parametrize("nan_from", [4, None], ids=["with_findings", "healthy"])
def test_a_report_section_that_raises_is_a_failed_check_and_keeps_the_findings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        nan_from: int | None) -> None:
    from lightning_debug.monitors.anomaly import AnomalyMonitor

    def broken(self: AnomalyMonitor) -> dict[str, Any]:
        raise RuntimeError("section on purpose")

    monkeypatch.setattr(AnomalyMonitor, "report_section", broken)
    callbacks = debug_callbacks(DebugConfig(mode="anomaly_detection", print_summary=True))
    trainer, messages = fit_all_four(tmp_path, TinyRegressor(log_zero_from_step=nan_from), steps=8,
                                     callbacks=callbacks)
    assert trainer.global_step == 8
    report = read_report(debug_dir(trainer))
    assert set(report["failed_checks"]) == {"AnomalyMonitor.report_section"}
    assert "RuntimeError: section on purpose" in report["failed_checks"]["AnomalyMonitor.report_section"]["reasons"]
    assert report["sections"]["anomaly"]["error"] == "RuntimeError: section on purpose"
    markdown = (debug_dir(trainer) / "report.md").read_text()
    assert "## Checks that failed" in markdown and "| AnomalyMonitor.report_section |" in markdown
    assert "No problems found." not in markdown
    if nan_from is not None:
        finding = report["findings"]["nonfinite_loss"]
        assert finding["first_step"] == nan_from and finding["callback"] == "anomaly"
        assert "`nonfinite_loss`" in markdown
    console = " ".join(capsys.readouterr().out.split())
    assert "nothing wrong found" not in console and "1 check(s) failed" in console
    assert "failed AnomalyMonitor.report_section since step" in console
    assert [m.split(" failed")[0] for m in failures(messages)] == ["lightning-debug: AnomalyMonitor.report_section"]
