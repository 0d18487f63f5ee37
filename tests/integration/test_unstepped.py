"""``learning_stalled`` (``optimizer_not_stepping``) in real runs: training batches that no optimizer step follows.

A forgotten ``opt.step()`` under manual optimization and a ``training_step`` that returns no loss leave the weights
as they were for the whole run (the first also keeps the optimizer-step counter at 0, so no check keyed to optimizer
steps ever runs): each is named, at the end of a short run and after 1,000 batches of a long one, and so is a
forgotten ``optimizer.step()`` in an Accelerate loop. The closest healthy runs stay quiet: an optimizer stepped outside
Lightning's wrapper (``use_pl_optimizer=False``: its gradient checks reported as not judged), a fit with no optimizer
at all, the Accelerate loop that steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch.utils.data import DataLoader

from lightning_debug import DebugConfig
from lightning_debug.monitors.gradients.unstepped import JUDGE_AT, SAMPLE_AT
from tests.harness.toolkit import (TinyRegressor, all_four, debug_dir, fit_seeded, fresh_accelerate, read_events,
                                   read_report, regression_data, run_dir)

BATCHES_PER_EPOCH = 16  # regression_data's 256 samples at 16 a batch


class Manual(TinyRegressor):
    """Manual optimization: ``step`` False forgets ``opt.step()``; ``raw`` steps the plain torch optimizer."""

    def __init__(self, step: bool = True, raw: bool = False) -> None:
        super().__init__(lr=0.01)
        self.automatic_optimization = False
        self.step, self.raw = step, raw

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers(use_pl_optimizer=not self.raw)
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.step:
            optimizer.step()
        return loss


class NoLoss(TinyRegressor):
    """Automatic optimization whose training step computes the loss and forgets to return it."""

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        x, y = batch
        self.log("train_loss", nn.functional.mse_loss(self(x), y))


class NoOptimizer(TinyRegressor):
    """A fit with no optimizer (``configure_optimizers`` returns None) that only keeps a running mean of the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.register_buffer("mean_output", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        with torch.no_grad():
            self.mean_output.mul_(0.9).add_(0.1 * self(batch[0]).mean())

    def configure_optimizers(self) -> None:  # type: ignore[override]
        return None


def fit(root: Path, model: TinyRegressor, epochs: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    trainer = fit_seeded(root, model, all_four(DebugConfig(save_plots=False)), max_steps=-1, max_epochs=epochs)
    directory = debug_dir(trainer)
    return read_events(directory), read_report(directory)


def serious(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("severity") in ("warning", "error", "critical") and e.get("episode") != "end"]


def test_a_forgotten_optimizer_step_is_named_at_the_end_of_a_run_that_never_stepped(tmp_path: Path) -> None:
    events, report = fit(tmp_path, Manual(step=False), epochs=25)
    found = serious(events)
    assert [(e["kind"], e["step"], e["details"]["cause"]) for e in found] == [
        ("learning_stalled", 0, "optimizer_not_stepping")]
    details = found[0]["details"]
    assert details["batches"] == details["backward_passes"] == 25 * BATCHES_PER_EPOCH
    assert "opt.step()" in found[0]["message"] and "ran at optimizer step 0 for the whole run" in found[0]["message"]
    assert report["status"] == "finished" and list(report["findings"]) == ["learning_stalled"]


def test_a_training_step_that_returns_no_loss_is_named(tmp_path: Path) -> None:
    events, _ = fit(tmp_path, NoLoss(), epochs=10)
    found = serious(events)
    assert [(e["kind"], e["details"]["cause"], e["details"]["backward_passes"]) for e in found] == [
        ("learning_stalled", "optimizer_not_stepping", 0)]
    assert "return loss" in found[0]["message"]


def test_a_long_run_is_named_once_it_reaches_the_judged_batch(tmp_path: Path) -> None:
    epochs = JUDGE_AT // BATCHES_PER_EPOCH + 2
    events, _ = fit(tmp_path, Manual(step=False), epochs=epochs)
    found = serious(events)
    assert [(e["kind"], e["details"]["batches"]) for e in found] == [("learning_stalled", JUDGE_AT)]
    assert "for the whole run" not in found[0]["message"]
    assert f"what they were {JUDGE_AT - SAMPLE_AT} batches before" in found[0]["message"]


def test_a_fit_with_no_optimizer_is_not_judged(tmp_path: Path) -> None:
    events, _ = fit(tmp_path, NoOptimizer(), epochs=10)  # twin of the missing `return loss`: no backward, no step
    assert serious(events) == []


def test_an_optimizer_stepped_outside_the_wrapper_is_quiet_and_its_gradient_checks_unavailable(tmp_path: Path) -> None:
    events, report = fit(tmp_path, Manual(step=True, raw=True), epochs=25)
    assert serious(events) == []
    unavailable = report["sections"]["gradients"]["unavailable"]
    assert "use_pl_optimizer=False" in unavailable["gradient checks"]


def accelerate_loop(root: Path, step: bool) -> list[dict[str, Any]]:
    """25 epochs of an Accelerate loop (400 batches), with ``optimizer.step()`` or without it."""
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    with fresh_accelerate():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, project_dir=str(root))
        model = TinyRegressor()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(regression_data(), batch_size=16, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        debugger = AccelerateDebugger(accelerator, model, optimizer, DebugConfig(save_plots=False, print_summary=False),
                                      train_dataloader=loader)
        with debugger:
            for _ in range(25):
                for x, y in loader:
                    debugger.backward(nn.functional.mse_loss(model(x), y))
                    if step:
                        optimizer.step()
                    optimizer.zero_grad()
    return read_events(run_dir(root / "debug_outputs"))


def test_a_forgotten_optimizer_step_in_an_accelerate_loop_is_named_and_its_twin_is_quiet(tmp_path: Path) -> None:
    found = serious(accelerate_loop(tmp_path / "forgotten", step=False))
    assert [(e["kind"], e["step"], e["details"]["cause"], e["details"]["backward_passes"]) for e in found] == [
        ("learning_stalled", 399, "optimizer_not_stepping", 400)]
    assert "optimizer.step()" in found[0]["message"]
    assert serious(accelerate_loop(tmp_path / "stepped", step=True)) == []
