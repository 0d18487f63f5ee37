"""``learning_stalled`` (``optimizer_not_stepping``) in real runs: training batches that no optimizer step follows.

A forgotten ``opt.step()`` under manual optimization and a ``training_step`` that returns no loss leave the weights
as they were for the whole run (the first also keeps the optimizer-step counter at 0, so no check keyed to optimizer
steps ever runs): each is named, at the end of a short run and after 1,000 batches of a long one, and so is a
forgotten ``optimizer.step()`` in an Accelerate loop. The closest healthy runs stay quiet: a fit with no optimizer
at all, the Accelerate loop that steps. An optimizer stepped outside Lightning's wrapper (``use_pl_optimizer=False``)
or made in ``training_step`` learns while Lightning's step counter stays at 0: ``steps_not_counted``. Beside them, the other stillness of weights: an Accelerate loop that steps every
batch on gradients clipped to 0 (``learning_stalled``, ``negligible_updates``: bit for bit the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch.utils.data import DataLoader

from lightning_debug import DebugConfig
from lightning_debug.monitors.gradients.unstepped import JUDGE_AT, SAMPLE_AT
from tests.harness.toolkit import (TinyRegressor, accelerate_regression, all_four, debug_dir, fit_seeded, read_events,
                                   read_report)

BATCHES_PER_EPOCH = 16  # regression_data's 256 samples at 16 a batch


class Manual(TinyRegressor):
    """Manual optimization: ``step`` False forgets ``opt.step()``; ``raw`` steps the plain torch optimizer;
    ``step_epochs``: it steps in these first epochs only (a condition around ``opt.step()`` that turns false);
    ``every``: it steps on every ``every``-th batch, accumulating the gradients between."""

    def __init__(self, step: bool = True, raw: bool = False, step_epochs: int | None = None, every: int = 1) -> None:
        super().__init__(lr=0.01)
        self.automatic_optimization = False
        self.step, self.raw, self.step_epochs, self.every = step, raw, step_epochs, every
        self.batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers(use_pl_optimizer=not self.raw)
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss / self.every)
        self.batches += 1
        stepping = self.step and (self.step_epochs is None or self.current_epoch < self.step_epochs)
        if stepping and self.batches % self.every == 0:
            optimizer.step()
            optimizer.zero_grad()
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


class FreshOptimizer(Manual):
    """Manual optimization with an optimizer made anew in every training step (plain SGD, so it learns as the
    configured one would) instead of the one ``configure_optimizers`` returns."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_an_optimizer_stepped_past_the_wrapper_is_named_and_its_gradient_checks_unavailable(tmp_path: Path) -> None:
    """``self.optimizers(use_pl_optimizer=False)``: the model learns, Lightning's step counter stays at 0 (a max_steps
    run never ends, step checkpoints are never saved): named once the optimizer stepped for 100 batches at one step
    count. The twin steps the wrapper: the counter moves, quiet."""
    events, report = fit(tmp_path / "raw", Manual(step=True, raw=True), epochs=25)
    found = serious(events)
    assert [(e["kind"], e["step"], e["details"]["cause"], e["details"]["batches"], e["details"]["optimizer_steps"])
            for e in found] == [("steps_not_counted", 0, "stepped_past_wrapper", SAMPLE_AT, SAMPLE_AT)]
    assert "use_pl_optimizer=False" in found[0]["message"] and "max_steps is never reached" in found[0]["message"]
    unavailable = report["sections"]["gradients"]["unavailable"]
    assert "use_pl_optimizer=False" in unavailable["gradient checks"]
    events, report = fit(tmp_path / "wrapped", Manual(step=True), epochs=25)
    assert serious(events) == [] and "gradient checks" not in report["sections"]["gradients"].get("unavailable", {})


def test_an_optimizer_made_in_the_training_step_is_named_and_its_twin_is_quiet(tmp_path: Path) -> None:
    """A torch optimizer made in ``training_step``: no optimizer the run holds steps, the weights change and the step
    counter stays at 0; named once the weights moved over 200 batches at that count. Its twin steps the configured
    optimizer through ``self.optimizers()``."""
    events, _ = fit(tmp_path / "fresh", FreshOptimizer(), epochs=15)
    found = serious(events)
    assert [(e["kind"], e["step"], e["details"]["cause"], e["details"]["batches"]) for e in found] == [
        ("steps_not_counted", 0, "trained_unseen", 2 * SAMPLE_AT)]
    assert "made outside configure_optimizers" in found[0]["message"]
    assert serious(fit(tmp_path / "configured", Manual(), epochs=15)[0]) == []


def accelerate_loop(root: Path, step: bool) -> list[dict[str, Any]]:
    """25 epochs of an Accelerate loop (400 batches), with ``optimizer.step()`` or without it."""
    def after_backward(accelerator: Any, model: nn.Module, optimizer: Any) -> None:
        if step:
            optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    return accelerate_regression(root, TinyRegressor(), lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                                 after_backward)


def test_a_forgotten_optimizer_step_in_an_accelerate_loop_is_named_and_its_twin_is_quiet(tmp_path: Path) -> None:
    found = serious(accelerate_loop(tmp_path / "forgotten", step=False))
    assert [(e["kind"], e["step"], e["details"]["cause"], e["details"]["backward_passes"]) for e in found] == [
        ("learning_stalled", 399, "optimizer_not_stepping", 400)]
    assert "optimizer.step()" in found[0]["message"]
    assert serious(accelerate_loop(tmp_path / "stepped", step=True)) == []


def test_an_optimizer_that_stops_stepping_is_named_at_the_end(tmp_path: Path) -> None:
    """``opt.step()`` only in the first 2 epochs: 48 batches after them run a backward no step follows, to the end."""
    events, _ = fit(tmp_path, Manual(step_epochs=2), epochs=2 + (SAMPLE_AT + 50) // BATCHES_PER_EPOCH)
    found = serious(events)
    assert [(e["kind"], e["details"]["cause"], e["details"]["learned_before"]) for e in found] == [
        ("learning_stalled", "optimizer_not_stepping", True)]
    assert found[0]["details"]["since_step"] == 2 * BATCHES_PER_EPOCH
    assert "stopped stepping" in found[0]["message"] and "to the end of the run" in found[0]["message"]


def test_an_accumulation_the_end_cuts_short_is_quiet(tmp_path: Path) -> None:
    """The twin: a step every 128 batches (manual accumulation); the run's last 112 batches, after its third step,
    are an accumulation cut short, no longer than the ones the run completed."""
    events, _ = fit(tmp_path, Manual(every=128), epochs=31)  # 496 batches: steps at 128, 256, 384
    assert serious(events) == []


class BatchNormRegressor(TinyRegressor):
    """A BatchNorm after the first layer; ``batches`` batches of 2 an epoch."""

    def __init__(self, batches: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.batches = batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.norm(self.inp(x))))))

    def train_dataloader(self) -> DataLoader:
        inputs = torch.randn(2 * self.batches, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(torch.utils.data.TensorDataset(inputs, inputs[:, :1] * 0.5), batch_size=2, shuffle=True)


@pytest.mark.parametrize("batches", [SAMPLE_AT + 28, JUDGE_AT + 24], ids=["an epoch of 128", "an epoch of 1,024"])
def test_stochastic_weight_averagings_forward_only_epoch_is_quiet(tmp_path: Path, batches: int) -> None:
    """Lightning's StochasticWeightAveraging on a model with BatchNorm adds an epoch of training batches without
    backward or step after training, to recompute the BatchNorm statistics of the averaged weights: batches that leave
    the weights as they are, on purpose, until the step its last batch takes (an epoch of 1,024 was named at its
    1,000th batch)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    trainer = fit_seeded(tmp_path, BatchNormRegressor(batches), all_four(DebugConfig(save_plots=False)) + [
        StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)], max_steps=-1, max_epochs=2)
    assert trainer.current_epoch == 3, "the statistics epoch ran"
    assert serious(read_events(debug_dir(trainer))) == []


def accelerate_clipped(root: Path, max_norm: float) -> list[dict[str, Any]]:
    """25 epochs of an Accelerate loop that clips every gradient to ``max_norm`` before each step."""
    def after_backward(accelerator: Any, model: nn.Module, optimizer: Any) -> None:
        accelerator.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(0)
    return accelerate_regression(root, TinyRegressor(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                                 after_backward)


def test_gradients_clipped_to_zero_before_every_step_are_named_and_its_twin_is_quiet(tmp_path: Path) -> None:
    """The optimizer steps every batch and the weights stay bit for bit the same: the gradients were read healthy, then
    clipped with max_norm 0. The single batches' losses wander far below the first check step's (20.2 against 5.3 to
    10.3), which kept the stall unnamed while it asked for a loss within 10% of the first."""
    found = serious(accelerate_clipped(tmp_path / "zero", 0.0))
    assert [(e["kind"], e["step"], e["details"]["cause"], e["details"]["update_per_step"]) for e in found] == [
        ("learning_stalled", 300, "negligible_updates", 0.0)]
    assert "bit for bit" in found[0]["message"] and "max_norm 0" in found[0]["message"]
    assert serious(accelerate_clipped(tmp_path / "one", 1.0)) == []
