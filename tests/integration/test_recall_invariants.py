"""Recall that holds (issue 45): an explosion into Inf/NaN is named by GradientHealthCallback alone, from the first
check steps, as is one in the first 10 steps that is over by the second check step (at the defaults), and no report
calls a run with non-finite values clean. Real Trainer runs, CPU, a few seconds each."""

from __future__ import annotations

import warnings
from pathlib import Path
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback
from tests.integration.test_divergence import WideReluMLP
from tests.harness.toolkit import (
    TinyRegressor,
    all_four,
    console_lines,
    debug_dir,
    fit_seeded,
    make_trainer,
    read_events,
    read_report,
    read_scalars,
    regression_data,
)

pytestmark = pytest.mark.timeout(120)

EVERY_STEP = DebugConfig(gradient_checking_frequency=1)
SERIOUS = ("warning", "error", "critical")


class DeepMLP(pl.LightningModule):
    """4 hidden ReLU layers under plain SGD; ``lr=5`` on inputs scaled by 100 explodes into Inf and NaN at once
    (the global norm ~40-110 at step 0, ~1e17 or Inf at step 1, NaN after), ``lr=0.01`` on the data as it is
    trains. ``lr_from_step``: the learning rate is 1e-9 of ``lr`` before that step (the explosion comes then)."""

    def __init__(self, lr: float, input_scale: float, lr_from_step: int = 0) -> None:
        super().__init__()
        self.lr_from_step = lr_from_step
        layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(32, 1))
        self.lr, self.input_scale = lr, input_scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x * self.input_scale), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.lr_from_step:
            return optimizer
        later = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step >= self.lr_from_step else 1e-9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": later, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


class SqrtOfZero(TinyRegressor):
    """From step 5 the loss adds the square root of a sum that is 0: the loss stays finite, its gradient is NaN."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step >= 5:
            loss = loss + torch.sqrt(self.head.weight.pow(2).sum() * 0.0)
        return loss


def run(tmp_path: Path, model: Callable[[], pl.LightningModule], callbacks: list[pl.Callback],
        steps: int = 20, seed: int = 0) -> tuple[pl.Trainer, list[dict[str, Any]], str]:
    """Fit the model ``model()`` builds after seeding its initialisation with ``seed``."""
    torch.manual_seed(seed)
    trainer = fit_seeded(tmp_path, model(), callbacks, max_steps=steps)
    directory = debug_dir(trainer)
    return trainer, read_events(directory), (directory / "report.md").read_text()


def serious(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(e["step"], e["kind"]) for e in events if e.get("severity") in SERIOUS and e.get("episode") != "end"]


def exploding_starts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "exploding_grad" and e.get("episode") == "start"]


def console(capsys: pytest.CaptureFixture[str]) -> str:
    """The end-of-fit summary as printed (the headline may wrap)."""
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("seed", "judged_by", "nonfinite_from"),
                         [(0, "growth over the last check steps", 2), (1, "finite to non-finite", 1)],
                         ids=["grows 1e15x then NaN", "overflows to Inf"])
def test_an_explosion_into_inf_is_named_at_its_step_by_the_gradient_callback_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], seed: int, judged_by: str, nonfinite_from: int) -> None:
    """Seed 0: the global norm 66 at step 0, 1.3e18 at step 1, NaN from step 2 (the loss NaN with it); seed 1: 110,
    then Inf at step 1 with the loss 9e20, finite. exploding_grad at step 1 either way, where it grew; counted; the
    report and the console name it and the non-finite steps."""
    with console_lines(r"\[step 1\] Gradients are exploding at step 1"):
        trainer, events, markdown = run(tmp_path, lambda: DeepMLP(lr=5.0, input_scale=100.0),
                                        [GradientHealthCallback(EVERY_STEP)], seed=seed)
    exploding = exploding_starts(events)
    assert [e["step"] for e in exploding] == [1], serious(events)
    assert exploding[0]["callback"] == "GradientHealthCallback"
    assert exploding[0]["details"]["judged_by"] == judged_by
    assert "No problems found" not in markdown and "`exploding_grad` (warning)" in markdown
    assert f"**Non-finite gradients** (global norm Inf or NaN) at {20 - nonfinite_from} check step(s), " \
           f"steps {nonfinite_from}-19" in markdown
    report = read_report(debug_dir(trainer))
    assert report["sections"]["gradients"]["counts"]["exploding_checks"] == 1, "the check step it was labelled at"
    assert "Check steps with exploding gradients: 1," in markdown
    assert report["sections"]["gradients"]["nonfinite"]["gradients"]["last_step"] == 19
    counted = dict(read_scalars(trainer.log_dir)["debug/grad/exploding_count"])
    assert 0 not in counted and counted[19] == 1.0, "a count is first written once it is not 0"
    summary = console(capsys)
    assert "1 kind(s) of finding" in summary and "gradients were non-finite at steps" in summary


def test_the_same_explosion_with_all_four_callbacks(tmp_path: Path) -> None:
    _, events, markdown = run(tmp_path, lambda: DeepMLP(lr=5.0, input_scale=100.0), all_four(EVERY_STEP))
    assert [e["step"] for e in exploding_starts(events)] == [1]
    assert "No problems found" not in markdown and "exploding_grad" in markdown


@pytest.mark.parametrize("callbacks", [lambda: [GradientHealthCallback(EVERY_STEP)], lambda: all_four(EVERY_STEP)],
                         ids=["gradients alone", "all four"])
def test_the_healthy_twin_has_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str], callbacks: Any) -> None:
    """Same MLP, lr 0.01 on the inputs as they are: nothing of warning or above, and clean where it is; the
    gradient callback alone says what it did not watch, so its "No problems found" is not read as the whole run's."""
    made = callbacks()
    _, events, markdown = run(tmp_path, lambda: DeepMLP(lr=0.01, input_scale=1.0), made)
    summary = console(capsys)
    assert serious(events) == [] and "No problems found." in markdown and "nothing wrong found" in summary
    scope = ("Only the gradients checks ran: the loss and activations (`AnomalyDetectionCallback`), memory "
             "(`MemoryProfilerCallback`) and step time (`PerformanceProfilerCallback`) were not watched.")
    note = "nothing wrong found in gradients (the loss and activations, memory and step time not watched)"
    alone = len(made) == 1
    assert (scope in markdown, note in summary) == (alone, alone)
    assert "not watched" not in markdown + summary or alone


def test_a_nan_gradient_with_a_normal_loss_is_stated_by_the_gradient_callback_alone_not_an_explosion(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Invariant 1 for GradientHealthCallback: no rule names the sqrt of 0 (a singular operation, not a growth: no
    exploding_grad), yet neither report.md nor the console calls the run clean; both state the steps."""
    _, events, markdown = run(tmp_path, SqrtOfZero, [GradientHealthCallback(EVERY_STEP)], steps=12)
    assert serious(events) == []
    assert "No problems found" not in markdown
    assert "gradients were non-finite at steps 5-11 (7 check step(s)" in markdown
    summary = console(capsys)
    assert "nothing wrong found" not in summary and "no finding, but non-finite values measured" in summary


@pytest.mark.parametrize("model", [lambda: SqrtOfZero(), lambda: TinyRegressor(log_zero_from_step=5)],
                         ids=["nan gradient", "nan loss"])
@pytest.mark.parametrize("callback", [GradientHealthCallback, AnomalyDetectionCallback])
def test_no_callback_alone_calls_a_run_with_non_finite_values_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    model: Any, callback: Any) -> None:
    """Invariant 1, each callback that measures gradients or the loss planted alone (MemoryProfilerCallback and
    PerformanceProfilerCallback measure neither)."""
    _, _, markdown = run(tmp_path, model, [callback(EVERY_STEP)], steps=10)
    assert "No problems found" not in markdown and "nothing wrong found" not in console(capsys)



SPARSE = DebugConfig(gradient_checking_frequency=10)


def test_an_explosion_between_two_check_steps_is_named_by_the_gradient_callback_alone(tmp_path: Path) -> None:
    """Invariants 2 and 3 at a check frequency over 1 (the default is 100): the MLP's learning rate is 5 from step
    12 on, and it blows up into Inf/NaN at steps 12-13, between the check steps 10 and 20 (after the first steps,
    which are measured all). The norm went from finite at step 10 to NaN at step 20 with nothing seen between:
    exploding_grad, labelled at step 11 (the earliest it can have begun), its message saying the steps between
    were not checked."""
    _, events, markdown = run(tmp_path, lambda: DeepMLP(lr=5.0, input_scale=100.0, lr_from_step=12),
                              [GradientHealthCallback(SPARSE)], steps=22)
    exploding = exploding_starts(events)
    assert [e["step"] for e in exploding] == [11], serious(events)
    assert exploding[0]["callback"] == "GradientHealthCallback"
    details = exploding[0]["details"]
    assert details["judged_by"] == "finite to non-finite"
    assert (details["last_finite_step"], details["measured_step"]) == (10, 20)
    message = exploding[0]["message"]
    assert "Gradients exploded between steps 10 and 20" in message and "at step 20" in message
    assert "9 optimizer steps between were not checked" in message
    assert "No problems found" not in markdown and "`exploding_grad` (warning)" in markdown


def test_an_explosion_in_the_first_steps_is_named_where_it_grew_between_two_check_steps(tmp_path: Path) -> None:
    """The same MLP at lr 5 from the start: 66 at step 0, 1.3e18 at step 1, NaN from step 2, between the check steps
    0 and 10; the first 10 steps are measured all the same, so it is named at step 1 by its growth, not guessed."""
    _, events, _ = run(tmp_path, lambda: DeepMLP(lr=5.0, input_scale=100.0), [GradientHealthCallback(SPARSE)], steps=12)
    exploding = exploding_starts(events)
    assert [e["step"] for e in exploding] == [1], serious(events)
    assert exploding[0]["details"]["judged_by"] == "growth over the first steps"
    assert "last_finite_step" not in exploding[0]["details"]


def test_beside_the_anomaly_callback_the_blow_up_between_check_steps_is_its_nonfinite_grad_at_its_step(
        tmp_path: Path) -> None:
    """All four at the same frequencies: AnomalyDetectionCallback checks every step and names the first NaN gradient
    at its step (root cause first); the gradient area does not add a guess labelled at the first unchecked step."""
    _, events, markdown = run(tmp_path, lambda: DeepMLP(lr=5.0, input_scale=100.0), all_four(SPARSE), steps=12)
    found = serious(events)
    first_nan = min(step for step, kind in found if kind == "nonfinite_grad")
    assert first_nan <= 3, found
    assert not [e for e in exploding_starts(events) if e["details"].get("last_finite_step") is not None], found
    assert "No problems found" not in markdown and "nonfinite_grad" in markdown


# --- invariant 3: an explosion in the first steps, over long before the second check step -------------------------
def blobs(samples: int = 512, features: int = 16, classes: int = 4) -> TensorDataset:
    """Gaussian blobs around 4 centres (the fault benchmark's classification data)."""
    generator = torch.Generator().manual_seed(0)
    centres = 2.0 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=generator), labels)


class AdamClassifier(pl.LightningModule):
    """Two hidden ReLU layers under Adam, cross-entropy. ``lr=1000`` on inputs x10: the global norm ~13 at step 0,
    ~4e9 at step 1 and ~1e10 after it, the loss 1.4 -> 4e12; a few steps later every ReLU is dead and the loss is 0
    with a gradient of 0 for good: nothing is left to see at step 100, the second check step. ``lr=1e-3`` on the
    data as it is trains (1.3 -> ~0.02). ``grads_x1e6_from``: from this step on the gradients are 1e6x (a hook on
    the logits; Adam's step does not grow with them)."""

    def __init__(self, lr: float, input_scale: float, grads_x1e6_from: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lr, self.input_scale, self.grads_x1e6_from = lr, input_scale, grads_x1e6_from
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x * self.input_scale)
        if self.grads_x1e6_from is not None and self.trainer.global_step >= self.grads_x1e6_from:
            logits.register_hook(lambda grad: grad * 1e6)
        loss = nn.functional.cross_entropy(logits, y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(blobs(), batch_size=32)


class GlobalNorms(pl.Callback):
    """Every step's global gradient norm, measured apart from the callbacks under test (to show the plant)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.detach().double().norm() for p in module.parameters() if p.grad is not None]
        self.norms.append(float(torch.stack(grads).norm()))


@pytest.mark.parametrize("callbacks", [lambda: [GradientHealthCallback()], lambda: all_four()],
                         ids=["gradients alone", "all four"])
def test_an_adam_learning_rate_far_too_high_is_exploding_at_its_step_at_the_defaults(
        tmp_path: Path, callbacks: Callable[[], list[pl.Callback]]) -> None:
    """Checked every 100 steps, the explosion at step 1 is over by step 100 (the loss 0, the norm 0, nothing
    non-finite): the first 10 steps are measured all the same (no sync) and name it at step 1, where it grew,
    with the largest parameters; fails without them (nothing is found)."""
    norms = GlobalNorms()
    model = AdamClassifier(lr=1000.0, input_scale=10.0)
    _, events, markdown = run(tmp_path, lambda: model, [*callbacks(), norms], steps=110)
    assert norms.norms[1] > 1e6 * norms.norms[0] and norms.norms[100] == 0.0 and model.losses[100] == 0.0, \
        "the plant: a blow-up at step 1, over (every ReLU dead) at the second check step"
    exploding = exploding_starts(events)
    assert [e["step"] for e in exploding] == [1], serious(events)
    details = exploding[0]["details"]
    assert details["judged_by"] == "growth over the first steps"
    assert exploding[0]["callback"] == "GradientHealthCallback"
    assert details["parameters"] and all(name.startswith("net.") for name in details["parameters"])
    assert "within the run's first 10 steps" in exploding[0]["message"]
    assert "`exploding_grad` (warning)" in markdown


@pytest.mark.parametrize("model", [lambda: AdamClassifier(lr=1e-3, input_scale=1.0), WideReluMLP],
                         ids=["same model, sane lr", "norm growing 400x out of its initialisation"])
def test_healthy_first_steps_are_quiet_at_the_defaults(tmp_path: Path, model: Callable[[], pl.LightningModule]) -> None:
    """The twin (Adam at 1e-3 on the data as it is) and a healthy model whose norm grows from 0.9 to ~400 in its
    first 7 steps (WideReluMLP: under 1000x, and never 1000x the steps just before) have no warning, with the first
    steps measured."""
    norms = GlobalNorms()
    _, events, markdown = run(tmp_path, model, [GradientHealthCallback(), norms], steps=12)
    assert serious(events) == [] and "No problems found." in markdown
    if model is WideReluMLP:
        assert max(norms.norms[:10]) > 100 * norms.norms[0], f"the plant: a norm that grows a lot: {norms.norms}"


def test_the_first_steps_are_the_runs_not_those_after_a_resume(tmp_path: Path) -> None:
    """Gradients 1e6x from step 3 on are a growth at step 3; resumed from a checkpoint at step 12 with the same plant
    from step 13 on, the run is past its first steps and nothing is measured between check steps (the next is 100)."""
    _, events, _ = run(tmp_path / "fresh", lambda: AdamClassifier(1e-3, 1.0, grads_x1e6_from=3),
                       [GradientHealthCallback()], steps=16)
    assert [(e["step"], e["details"]["judged_by"]) for e in exploding_starts(events)] == [
        (3, "growth over the first steps")], serious(events)
    saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=12, save_top_k=-1)
    torch.manual_seed(0)
    fit_seeded(tmp_path / "first", AdamClassifier(1e-3, 1.0), [GradientHealthCallback(), saver], max_steps=12,
               enable_checkpointing=True)
    checkpoint = next((tmp_path / "checkpoints").glob("*step=12.ckpt"))
    norms = GlobalNorms()
    resumed = make_trainer(tmp_path / "resumed", [GradientHealthCallback(), norms], max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(AdamClassifier(1e-3, 1.0, grads_x1e6_from=13), ckpt_path=str(checkpoint))
    assert norms.norms[-1] > 1e4 * norms.norms[0], f"the plant after the resume: {norms.norms}"
    assert serious(read_events(debug_dir(resumed))) == []


class EmptyLoader(TinyRegressor):
    """``drop_last=True`` with a batch larger than the data set (``drop_last=False``: the twin, one short batch)."""

    def __init__(self, drop_last: bool) -> None:
        super().__init__()
        self.drop_last = drop_last

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=1024, drop_last=self.drop_last)


@pytest.mark.parametrize("drop_last", [True, False], ids=["no batch", "one short batch (twin)"])
def test_a_fit_that_ran_no_training_batch_is_never_called_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                drop_last: bool) -> None:
    """Every callback is quiet when Lightning stops a fit for want of training batches, since none of their checks
    ran: report.md, report.json and the console say so instead of "No problems found". The twin trains on its one
    short batch per epoch and is clean."""
    trainer, events, markdown = run(tmp_path, lambda: EmptyLoader(drop_last), all_four(), steps=3)
    report = read_report(debug_dir(trainer))
    summary = console(capsys)
    assert serious(events) == []
    assert report["training_batches"] == (0 if drop_last else 3)
    assert ("No training batch ran, so no check ran" in markdown) == drop_last
    assert ("No problems found." in markdown) != drop_last
    assert ("no training batch ran, so nothing was checked" in summary) == drop_last
    assert ("nothing wrong found" in summary) != drop_last
