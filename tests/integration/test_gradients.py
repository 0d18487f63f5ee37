"""GradientHealthCallback on real Trainer runs with planted causes (CPU, a few dozen steps each)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_debug.core.numerics.queue as numerics_module
from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback
from lightning_debug.checks.gradients import (
    _summary_row,
    histogram_from_row,
    histogram_summaries,
    round_significant,
    suggest_clip_value,
)
from lightning_debug.checks.numerics import NormPlan
from lightning_debug.checks.trends import jump_limit
from lightning_debug.core.numerics import StepNumerics
from tests.harness.toolkit import (console_lines, 
    TinyRegressor,
    debug_dir,
    make_trainer,
    read_events,
    read_histogram_tags,
    read_report,
    read_scalars,
    regression_data,
)

pytestmark = pytest.mark.timeout(120)


# --- planted causes ------------------------------------------------------------------------------
class DeepSigmoidNet(pl.LightningModule):
    """Sigmoids with tiny weights: each layer shrinks the backward signal ~100x.

    ``stem`` runs first but is registered last, so only execution order puts it first.
    """

    def __init__(self, depth: int = 8, width: int = 16, std: float = 0.01) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.stem = nn.Linear(8, width)
        with torch.no_grad():
            for layer in (self.stem, *self.blocks):
                layer.weight.normal_(0.0, std)
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.stem(x))
        for block in self.blocks:
            h = torch.sigmoid(block(h))
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


class UnnormalizedHugeLr(TinyRegressor):
    """Inputs scaled by 2 (not normalized) and plain SGD whose lr jumps from 0.01 to a huge 1.0 after a few steps."""

    def __init__(self, calm_steps: int = 6) -> None:
        super().__init__(lr=1.0)
        self.calm_steps = calm_steps

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        calm = self.calm_steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.01 if step < calm else 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        inputs, targets = regression_data().tensors
        return DataLoader(TensorDataset(inputs * 2.0, targets * 0.5), batch_size=16, shuffle=True)


class OptimizerMistakes(TinyRegressor):
    """``inp.bias`` frozen on purpose; ``head.bias`` left out of the optimizer; ``head.weight`` at lr 0;
    ``hidden.*`` at an lr too small to change float32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp.bias.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([
            {"params": [self.inp.weight]},
            {"params": list(self.hidden.parameters()), "lr": 1e-30},
            {"params": [self.head.weight], "lr": 0.0},
        ], lr=0.05)


class WarmupFromZero(TinyRegressor):
    """Adam with a linear warm-up that starts at lr 0, as many schedules do: healthy."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=1e-3)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class GradientRecorder(Callback):
    """Reference values, measured independently at the hook where the plugin measures."""

    def __init__(self) -> None:
        self.global_norms: dict[int, float] = {}
        self.parameter_norms: dict[int, dict[str, float]] = {}
        self.first_grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        step = trainer.global_step
        self.global_norms[step] = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()])).item()
        self.parameter_norms[step] = {n: torch.linalg.vector_norm(g).item() for n, g in grads.items()}
        if not self.first_grads:
            self.first_grads = grads


def fit(root: Path, model: pl.LightningModule, callbacks: list[Callback], max_steps: int, **kwargs: Any
        ) -> tuple[pl.Trainer, list[str]]:
    pl.seed_everything(0, verbose=False)
    with console_lines() as caught:
        trainer = make_trainer(root, callbacks, max_steps=max_steps, **kwargs)
        trainer.fit(model)
    return trainer, caught


def ours(caught: list[str]) -> list[str]:
    return [line for line in caught if "lightning-debug" in line]


def starts(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and e.get("episode") == "start"]


# --- the planted causes are named ----------------------------------------------------------------
def test_vanishing_gradients_name_the_earliest_layers_in_execution_order(tmp_path: Path) -> None:
    trainer, caught = fit(tmp_path, DeepSigmoidNet(), [GradientHealthCallback(gradient_checking_frequency=2)], 10)
    events = read_events(debug_dir(trainer))
    vanishing = starts(events, "vanishing_grad")
    assert len(vanishing) == 1, "a condition on every check step is one episode, not one event per step"
    event = vanishing[0]
    assert event["step"] == 0 and event["severity"] == "warning"
    names = event["details"]["parameters"]
    assert names[:4] == ["stem.weight", "stem.bias", "blocks.0.weight", "blocks.0.bias"]
    block_indices = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    assert block_indices == sorted(block_indices) and block_indices[-1] < 7
    assert not any(n.startswith("head.") for n in names)
    healthy = event["details"]["healthy_from"]
    assert healthy.startswith("blocks.") and int(healthy.split(".")[1]) == block_indices[-1] + 1
    assert "forward execution order" in event["details"]["order"]
    assert "sigmoid" in event["message"] and any("vanishing" in m or "below" in m for m in ours(caught))
    scalars = read_scalars(trainer.logger.log_dir)
    # confirmed on the third check step in a row (step 4), then counted on each of the three; a count is first
    # written once it is not 0
    assert scalars["debug/grad/vanishing_count"] == [(4, 3.0), (6, 4.0), (8, 5.0)]
    report = read_report(debug_dir(trainer))
    assert report["findings"]["vanishing_grad"]["steps"] == 5
    assert report["sections"]["gradients"]["most_flagged"]["vanishing_grad"][0][1] == 5


def test_huge_learning_rate_on_unnormalized_inputs_explodes_with_a_clip_value_from_the_run(tmp_path: Path) -> None:
    callback = GradientHealthCallback(gradient_checking_frequency=1, log_gradients=True)
    trainer, caught = fit(tmp_path, UnnormalizedHugeLr(calm_steps=6), [callback], 12)
    scalars = read_scalars(trainer.logger.log_dir)
    norms = dict(scalars["debug/grad/global_norm"])
    # no threshold set: a step explodes when its norm jumps 10x over the median of the run's recent norms
    first_above = min(step for step, norm in norms.items()
                      if step >= 3 and norm > jump_limit([norms[s] for s in range(max(0, step - 16), step)], 10, 6, 3))
    assert first_above >= 6, "the calm phase must be healthy for this test to mean anything"
    exploding = starts(read_events(debug_dir(trainer)), "exploding_grad")
    assert exploding and exploding[0]["step"] == first_above
    details = exploding[0]["details"]
    assert details["judged_by"] == "jump over recent norms" and details["threshold"] is None
    assert details["global_norm"] == pytest.approx(norms[first_above], rel=1e-5)
    assert f"{details['global_norm'] / details['recent_median']:.3g}x its median" in exploding[0]["message"]
    per_parameter = {tag.removeprefix("debug/grad/norm/"): dict(values)[first_above]
                     for tag, values in scalars.items() if tag.startswith("debug/grad/norm/")}
    largest = max(per_parameter, key=per_parameter.get)
    assert details["worst"][0][0] == largest
    assert details["worst"][0][1] == pytest.approx(per_parameter[largest], rel=1e-5)
    assert details["parameters"] == [name for name, _ in details["worst"]]
    healthy = sorted(norms[s] for s in range(first_above))
    assert details["suggested_clip_val"] == round_significant(healthy[int(0.9 * len(healthy))])
    assert f"gradient_clip_val={details['suggested_clip_val']:g}" in exploding[0]["message"]
    assert any("exploding" in m for m in ours(caught))
    counts = dict(scalars["debug/grad/exploding_count"])
    assert min(counts) == first_above + 2 and counts[first_above + 2] == 1.0, \
        "a jump is confirmed by the 2 steps after it, then counted (a count is first written once it is not 0)"


def test_unused_layer_is_named_as_missing_gradient(tmp_path: Path) -> None:
    trainer, _ = fit(tmp_path, TinyRegressor(unused_layer=True, optimizer="adam", lr=1e-3),
                     [GradientHealthCallback(gradient_checking_frequency=5)], 12)
    missing = starts(read_events(debug_dir(trainer)), "missing_grad")
    assert len(missing) == 1 and missing[0]["step"] == 0
    assert missing[0]["details"]["parameters"] == ["unused.weight", "unused.bias"]
    assert "find_unused_parameters" in missing[0]["message"]
    scalars = read_scalars(trainer.logger.log_dir)
    assert scalars["debug/grad/missing_count"] == [(0, 1.0), (5, 2.0), (10, 3.0)]
    assert not starts(read_events(debug_dir(trainer)), "vanishing_grad")


class CheckpointedAfterFrozenStem(TinyRegressor):
    """A frozen (pretrained) stem, then blocks under reentrant activation checkpointing: the blocks' input needs
    no gradient, so reentrant checkpointing returns an output without a graph and the blocks never train."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.inp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self.hidden, h, use_reentrant=True)
        return self.head(torch.relu(h))


def test_layers_cut_off_by_reentrant_checkpointing_are_named_as_run_without_a_graph(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "None of the inputs have requires_grad=True"
        trainer, _ = fit(tmp_path, CheckpointedAfterFrozenStem(), [GradientHealthCallback()], 12)
    missing = starts(read_events(debug_dir(trainer)), "missing_grad")
    assert [e["step"] for e in missing] == [0]
    details = missing[0]["details"]
    assert details["parameters"] == details["no_graph"] == ["hidden.weight", "hidden.bias"]
    assert details["steps_without_gradient"] == 8, "its module ran without a graph: the short window"
    assert "without building a graph" in missing[0]["message"]
    assert "checkpoint(use_reentrant=True)" in missing[0]["message"]


class WithAveragedCopyAndTeacher(TinyRegressor):
    """Healthy: an exponential moving average of the network held as a submodule (torch's ``AveragedModel``, whose
    copy has ``requires_grad=True``), updated after every batch and, as ``self.parameters()`` goes, in the
    optimizer's param group; a teacher run under ``torch.no_grad()`` that the optimizer does not hold and nobody
    froze. ``mistake``: ``"head left out"`` gives the optimizer everything but ``head`` (which the loss uses),
    ``"unused layer"`` adds a layer no forward calls to the optimizer."""

    def __init__(self, mistake: str | None = None) -> None:
        super().__init__(optimizer="adam", lr=1e-3, unused_layer=mistake == "unused layer")
        self.mistake = mistake
        self.averaged = torch.optim.swa_utils.AveragedModel(
            nn.Sequential(self.inp, self.hidden), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        self.teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            target = self.teacher(x)
        out = self(x)
        return nn.functional.mse_loss(out, y) + 0.1 * nn.functional.mse_loss(out, target)

    def on_train_batch_end(self, *args: Any) -> None:
        self.averaged.update_parameters(nn.Sequential(self.inp, self.hidden))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        teacher = {id(p) for p in self.teacher.parameters()}
        head = {id(p) for p in self.head.parameters()} if self.mistake == "head left out" else set()
        return torch.optim.Adam([p for p in self.parameters() if id(p) not in teacher | head], lr=self.lr)


@pytest.mark.parametrize("mistake", [None, "head left out", "unused layer"])
def test_an_averaged_copy_and_a_teacher_are_outside_training(tmp_path: Path, mistake: str | None) -> None:
    trainer, _ = fit(tmp_path, WithAveragedCopyAndTeacher(mistake), [GradientHealthCallback(gradient_checking_frequency=5)],
                     80)
    events = read_events(debug_dir(trainer))
    outside = sorted(name for e in events if e["kind"] == "outside_training" for name in e["details"]["parameters"])
    expected = ["averaged.module.0.bias", "averaged.module.0.weight", "averaged.module.1.bias",
                "averaged.module.1.weight", "teacher.0.bias", "teacher.0.weight", "teacher.2.bias", "teacher.2.weight"]
    assert outside == expected and all(e["severity"] == "info" for e in events if e["kind"] == "outside_training")
    warned = [(e["kind"], e["details"].get("cause"), e["details"].get("parameters"), e["step"])
              for e in events if e["severity"] == "warning"]
    assert warned == {None: [],
                      "head left out": [("frozen_param", "not_in_optimizer", ["head.weight", "head.bias"], 0)],
                      "unused layer": [("missing_grad", None, ["unused.weight", "unused.bias"], 0)]}[mistake]


class UnfrozenAtEpoch1(TinyRegressor):
    """A frozen ``backbone`` (``inp`` and ``hidden``) made trainable at the second epoch. Healthy with Lightning's
    ``BackboneFinetuning``, which also hands it to the optimizer; ``forgets_optimizer`` unfreezes it by hand and
    forgets that: it gets gradients that no optimizer applies."""

    def __init__(self, forgets_optimizer: bool) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.backbone = nn.Sequential(self.inp, nn.ReLU(), self.hidden)
        self.forgets_optimizer = forgets_optimizer
        if forgets_optimizer:
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))

    def on_train_epoch_start(self) -> None:
        if self.forgets_optimizer and self.current_epoch == 1:
            self.backbone.requires_grad_(True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


@pytest.mark.parametrize("forgets_optimizer", [False, True])
def test_a_backbone_unfrozen_during_the_run_is_judged_with_the_optimizer_it_has_then(tmp_path: Path,
                                                                                     forgets_optimizer: bool) -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    callbacks: list[Callback] = [GradientHealthCallback(gradient_checking_frequency=10)]
    if not forgets_optimizer:
        callbacks.append(BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    trainer, _ = fit(tmp_path, UnfrozenAtEpoch1(forgets_optimizer), callbacks, 90)
    events = read_events(debug_dir(trainer))
    warned = [(e["kind"], e["details"].get("cause"), e["details"].get("parameters"), e["step"])
              for e in events if e["severity"] == "warning"]
    if not forgets_optimizer:
        assert warned == []
        return
    # requires_grad is compared every 16 uses of the index (here: check steps), so it is named within 16 checks;
    # the gradients no optimizer zeroes also pile up (an exploding_grad, a consequence of the same mistake)
    frozen = [w for w in warned if w[0] == "frozen_param"]
    assert [w[:3] for w in frozen] == [("frozen_param", "not_in_optimizer",
                                        ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias"])], warned
    assert trainer.num_training_batches <= frozen[0][3] <= trainer.num_training_batches + 16 * 10, warned
    assert {w[0] for w in warned} <= {"frozen_param", "exploding_grad"}, warned


class HeadReplacedAtTrainStart(TinyRegressor):
    """A head swapped for a fresh one in the module's ``on_train_start`` (a head sized for the data once it is
    known), after ``configure_optimizers`` built the optimizer over the old one; the twin swaps it in ``setup``,
    before the optimizer is built. Lightning runs the callbacks' ``on_train_start`` before the module's."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at = at

    def _swap(self) -> None:
        self.head = nn.Linear(self.head.in_features, 1)

    def setup(self, stage: str) -> None:
        if self.at == "setup":
            self._swap()

    def on_train_start(self) -> None:
        if self.at == "on_train_start":
            self._swap()


@pytest.mark.parametrize("at", ["on_train_start", "setup"])
def test_a_layer_replaced_after_the_optimizer_was_built_is_frozen_param(tmp_path: Path, at: str) -> None:
    """Before, the parameters the fit started with were looked up in the param groups, and the check steps' index
    (the new head) only when it changed later: the new head trained nothing and the run ended in "No problems
    found"."""
    trainer, _ = fit(tmp_path, HeadReplacedAtTrainStart(at), [GradientHealthCallback(gradient_checking_frequency=5)],
                     20)
    held = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    in_optimizer = id(trainer.lightning_module.head.weight) in held
    warned = [(e["kind"], e["details"].get("cause"), e["details"].get("parameters"), e["step"])
              for e in read_events(debug_dir(trainer)) if e["severity"] == "warning"]
    if at == "setup":
        assert in_optimizer and warned == []
        return
    assert not in_optimizer, "the plant: the optimizer holds the old head"
    assert warned[0] == ("frozen_param", "not_in_optimizer", ["head.weight", "head.bias"], 0), warned


def test_parameters_the_optimizer_cannot_move_are_frozen_param(tmp_path: Path) -> None:
    callback = GradientHealthCallback(gradient_checking_frequency=2, log_weights=True)
    trainer, caught = fit(tmp_path, OptimizerMistakes(), [callback], 6)
    events = read_events(debug_dir(trainer))
    by_cause = {e["details"]["cause"]: e for e in starts(events, "frozen_param")}
    assert set(by_cause) == {"not_in_optimizer", "lr_zero", "no_update"}
    assert by_cause["not_in_optimizer"]["details"]["parameters"] == ["head.bias"]
    assert by_cause["not_in_optimizer"]["step"] == 0
    assert by_cause["lr_zero"]["details"]["parameters"] == ["head.weight"]
    assert by_cause["no_update"]["details"]["parameters"] == ["hidden.weight", "hidden.bias"]
    assert by_cause["no_update"]["step"] == 0
    info = [e for e in events if e["kind"] == "requires_grad_false"]
    assert len(info) == 1 and info[0]["details"]["parameters"] == ["inp.bias"] and info[0]["severity"] == "info"
    scalars = read_scalars(trainer.logger.log_dir)
    assert all(v > 0 for _, v in scalars["debug/weight/update_ratio/inp.weight"])
    assert all(v == 0 for _, v in scalars["debug/weight/update_ratio/hidden.weight"])
    assert [s for s, _ in scalars["debug/weight/update_ratio/inp.weight"]] == [0, 2, 4]
    assert "debug/weight/update_ratio/inp.bias" not in scalars
    warned = ours(caught)
    named = ("head.bias", "head.weight", "hidden.weight")
    assert [sum(f"`{name}`" in m for m in warned) for name in named] == [1, 1, 1]
    trainability = read_report(debug_dir(trainer))["sections"]["gradients"]["trainability"]
    assert trainability["requires_grad_false_parameters"] == 1


# --- what is measured, and when ------------------------------------------------------------------
def test_logged_global_norm_equals_vector_norm_of_all_gradients(tmp_path: Path) -> None:
    recorder = GradientRecorder()
    trainer, _ = fit(tmp_path, TinyRegressor(), [recorder, GradientHealthCallback(gradient_checking_frequency=1,
                                                                                 log_gradients=True)], 8)
    scalars = read_scalars(trainer.logger.log_dir)
    logged = scalars["debug/grad/global_norm"]
    assert [step for step, _ in logged] == list(range(8))
    for step, value in logged:
        assert value == pytest.approx(recorder.global_norms[step], rel=1e-5)
        for name, reference in recorder.parameter_norms[step].items():
            assert dict(scalars[f"debug/grad/norm/{name}"])[step] == pytest.approx(reference, rel=1e-5)
    stats = read_report(debug_dir(trainer))["stats"]["gradient_norm"]
    assert stats["count"] == 8 and stats["max"] == pytest.approx(max(recorder.global_norms.values()), rel=1e-5)


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path) -> None:
    recorder = GradientRecorder()
    callback = GradientHealthCallback(gradient_checking_frequency=3)
    trainer, _ = fit(tmp_path, TinyRegressor(), [recorder, callback], 10, accumulate_grad_batches=2)
    assert trainer.global_step == 10
    logged = read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"]
    assert [step for step, _ in logged] == [0, 3, 6, 9]
    for step, value in logged:
        assert value == pytest.approx(recorder.global_norms[step], rel=1e-5)
    assert read_report(debug_dir(trainer))["sections"]["gradients"]["checks"] == 4


def test_histograms_are_tensorboard_histograms_at_their_steps(tmp_path: Path) -> None:
    recorder = GradientRecorder()
    callback = GradientHealthCallback(gradient_checking_frequency=2, log_gradients=True)
    trainer, caught = fit(tmp_path / "basic", TinyRegressor(optimizer="adam", lr=1e-3), [recorder, callback], 22)
    tags = read_histogram_tags(trainer.logger.log_dir)
    names = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "head.weight", "head.bias"]
    assert sorted(tags) == sorted(f"debug/grad_hist/{n}" for n in names)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"histograms": 0})
    accumulator.Reload()
    histograms = accumulator.Histograms("debug/grad_hist/inp.weight")
    assert [h.step for h in histograms] == [0, 20], "every 10th check step below EXPERT"
    first = histograms[0].histogram_value
    reference = recorder.first_grads["inp.weight"]
    assert first.num == reference.numel()
    assert first.min == pytest.approx(reference.min().item(), rel=1e-5)
    assert first.max == pytest.approx(reference.max().item(), rel=1e-5)
    assert first.sum == pytest.approx(reference.sum().item(), rel=1e-4, abs=1e-6)
    assert sum(first.bucket) == reference.numel()
    assert not ours(caught)

    expert = GradientHealthCallback(gradient_checking_frequency=3, log_weights=True, level="expert")
    trainer, _ = fit(tmp_path / "expert", TinyRegressor(optimizer="adam", lr=1e-3), [expert], 7)
    accumulator = EventAccumulator(trainer.logger.log_dir, size_guidance={"histograms": 0})
    accumulator.Reload()
    assert sorted(accumulator.Tags()["histograms"]) == sorted(f"debug/weight_hist/{n}" for n in names)
    assert [h.step for h in accumulator.Histograms("debug/weight_hist/head.weight")] == [0, 3, 6]


def test_logger_without_histograms_warns_once_and_training_continues(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    callback = GradientHealthCallback(gradient_checking_frequency=1, log_gradients=True, level="expert")
    trainer, caught = fit(tmp_path, TinyRegressor(optimizer="adam", lr=1e-3), [callback], 6,
                          logger=CSVLogger(str(tmp_path), name="csv"))
    assert trainer.global_step == 6
    histogram_warnings = [m for m in ours(caught) if "histogram" in m]
    assert len(histogram_warnings) == 1 and "CSVLogger" in histogram_warnings[0]
    header = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
    assert "debug/grad/norm/inp.weight" in header and "debug/grad/global_norm" in header


def test_healthy_run_is_silent(tmp_path: Path) -> None:
    callbacks = [GradientHealthCallback(gradient_checking_frequency=1, log_gradients=True, log_weights=True,
                                        level="advanced"), AnomalyDetectionCallback()]
    trainer, caught = fit(tmp_path, WarmupFromZero(), callbacks, 20)
    assert ours(caught) == []
    assert not [line for line in caught if " failed" in line]
    events = read_events(debug_dir(trainer))
    assert not [e for e in events if e["severity"] in ("warning", "error", "critical")]
    report = read_report(debug_dir(trainer))
    assert report["findings"] == {}
    section = report["sections"]["gradients"]
    assert section["checks"] == 20 and set(section["parameter_norms"]) >= {"inp.weight", "head.bias"}
    assert report["stats"]["update_ratio"]["count"] == 20
    assert dict(read_scalars(trainer.logger.log_dir)["debug/weight/update_ratio_global"])[0] == 0.0, "lr 0 at step 0"


def test_anomaly_and_gradient_callbacks_share_one_pass_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    constructed: list[int] = []

    class CountingStepNumerics(StepNumerics):
        def __init__(self, step: int, *args: Any, **kwargs: Any) -> None:
            constructed.append(step)
            super().__init__(step, *args, **kwargs)

    monkeypatch.setattr(numerics_module, "StepNumerics", CountingStepNumerics)
    config = DebugConfig(gradient_checking_frequency=2, anomaly_check_frequency=1)
    trainer, _ = fit(tmp_path, TinyRegressor(), [GradientHealthCallback(config), AnomalyDetectionCallback(config)], 10)
    assert constructed == list(range(10))
    scalars = read_scalars(trainer.logger.log_dir)
    assert [s for s, _ in scalars["debug/grad/global_norm"]] == [0, 2, 4, 6, 8]
    assert [s for s, _ in scalars["debug/loss_finite"]] == list(range(10))


def test_counts_survive_a_resume_from_checkpoint(tmp_path: Path) -> None:
    config = DebugConfig(gradient_checking_frequency=2, gradient_explosion_threshold=1e-3)
    first = GradientHealthCallback(config)
    trainer, _ = fit(tmp_path / "a", TinyRegressor(optimizer="adam", lr=1e-3), [first], 10)
    assert first.state_dict()["counts"]["exploding"] == 5
    checkpoint = tmp_path / "run.ckpt"
    trainer.save_checkpoint(checkpoint)

    second = GradientHealthCallback(config)
    pl.seed_everything(0, verbose=False)
    resumed = make_trainer(tmp_path / "b", [second], max_steps=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit(TinyRegressor(optimizer="adam", lr=1e-3), ckpt_path=str(checkpoint))
    scalars = read_scalars(resumed.logger.log_dir)
    assert scalars["debug/grad/exploding_count"] == [(10, 6.0), (12, 7.0), (14, 8.0)]
    state = second.state_dict()
    assert state["counts"]["exploding"] == 8 and state["checks"] == 8
    assert state["global_norms"]["count"] == 8

    copy = GradientHealthCallback(config)
    copy.load_state_dict(state)
    assert copy.state_dict() == state


def test_invalid_configuration_names_the_field() -> None:
    with pytest.raises(ValueError, match="gradient_checking_frequency"):
        GradientHealthCallback(gradient_checking_frequency=0)
    with pytest.raises(ValueError, match="gradient_explosion_threshold"):
        GradientHealthCallback(gradient_explosion_threshold=-1.0)
    with pytest.raises(ValueError, match="level"):
        GradientHealthCallback(level="verbose")


# --- the pure functions --------------------------------------------------------------------------
def test_histogram_summaries_match_a_host_computation() -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=generator)
    values[3] = float("nan")
    values[7] = float("inf")
    row = histogram_summaries([values, torch.zeros(0)], bins=10)
    assert row.shape == (2, 15)
    histogram = histogram_from_row(row[0].tolist(), bins=10)
    finite = values[torch.isfinite(values)]
    assert histogram["num"] == finite.numel() == sum(histogram["bucket_counts"])
    assert histogram["min"] == pytest.approx(finite.min().item())
    assert histogram["max"] == pytest.approx(finite.max().item())
    assert histogram["sum"] == pytest.approx(finite.sum().item(), abs=1e-3)
    assert histogram["sum_squares"] == pytest.approx(finite.square().sum().item(), rel=1e-5)
    expected = torch.histc(finite, bins=10, min=finite.min().item(), max=finite.max().item())
    assert histogram["bucket_counts"][1:] == pytest.approx(expected.tolist(), abs=1)
    assert len(histogram["bucket_limits"]) == len(histogram["bucket_counts"])


def test_histograms_of_many_small_tensors_are_computed_together_and_match_one_by_one() -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(int(n), generator=generator) * (i + 1)
               for i, n in enumerate(torch.randint(0, 40, (60,), generator=generator))]
    tensors[5][0] = float("nan")
    tensors[9] = torch.full((4,), float("inf"))
    tensors.append(torch.randn(70_000, generator=generator))  # large: measured on its own
    tensors.append(torch.randn(3, 3, dtype=torch.bfloat16, generator=generator).t())
    rows = histogram_summaries(tensors, bins=12)
    for tensor, row in zip(tensors, rows):
        assert row.tolist() == pytest.approx(_summary_row(tensor, 12).tolist(), rel=1e-5, abs=1e-4)


def test_update_norms_and_clip_suggestion() -> None:
    before = [torch.zeros(2), torch.ones(3), torch.zeros(5000, dtype=torch.float64)]
    after = [torch.tensor([3.0, 4.0]), torch.ones(3), torch.full((5000,), 2.0, dtype=torch.float64)]
    plan = NormPlan(before)
    snapshot = plan.snapshot(before)
    before[0].add_(1.0)  # the snapshot is a copy
    assert plan.distance_squares(snapshot, after).sqrt().tolist() == pytest.approx([5.0, 0.0, 2.0 * 5000 ** 0.5])
    value, basis = suggest_clip_value([float(v) for v in range(1, 11)], threshold=100.0)
    assert value == 10.0 and "90th percentile of the last 10" in basis
    assert suggest_clip_value([1.0, math.nan], threshold=7.0)[0] == 7.0


class ScheduledExperts(pl.LightningModule):
    """Four experts picked by a schedule (a router that is not learnt): expert 3 gets its first input at step 12,
    expert 0 none on steps 2-7, experts 1 and 2 always; ``unused`` never (the planted bug, when asked)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.unused = nn.Linear(4, 2) if unused else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        step = self.trainer.global_step
        picked = [1, 2] + ([0] if not 2 <= step <= 7 else []) + ([3] if step >= 12 else [])
        return sum(self.experts[i](x).square().mean() for i in picked)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)


@pytest.mark.parametrize("unused", [False, True])
def test_a_lone_expert_waiting_for_its_first_input_at_the_default_frequency(unused: bool, tmp_path: Path) -> None:
    """Checks every 100 steps see, at step 0, one expert without a gradient and its replicas with one. Watched
    with it between checks, a replica going without one for 6 steps makes the lone expert wait longer than the
    fixed window, and it gets its first input at step 12: not missing. A layer nothing uses is still named."""
    trainer, _ = fit(tmp_path, ScheduledExperts(unused), [GradientHealthCallback(DebugConfig())], 16)
    events = read_events(debug_dir(trainer))
    if not unused:
        assert not [e for e in events if e["severity"] in ("warning", "error", "critical")], "a healthy run"
    missing = starts(events, "missing_grad")
    assert [event["details"]["parameters"] for event in missing] == ([["unused.weight", "unused.bias"]] if unused
                                                                     else [])


class FrozenByAccident(TinyRegressor):
    """Issue 45: the first layer gets ``requires_grad=False`` after the optimizer was built over every parameter (a
    freeze left over); with ``on_purpose`` it is frozen before and left out of the optimizer (the twin). The bulk of a
    model frozen with the optimizer over every parameter (peft's LoRA, a frozen backbone) is the sweep's."""

    def __init__(self, on_purpose: bool = False) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.on_purpose = on_purpose

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.on_purpose:
            self.inp.requires_grad_(False)
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        self.inp.requires_grad_(False)
        return optimizer


@pytest.mark.parametrize("on_purpose,all_four", [(False, False), (True, False), (False, True)])
def test_a_layer_frozen_but_held_by_the_optimizer_is_a_warning_and_named_in_the_report(tmp_path: Path,
                                                                                        on_purpose: bool,
                                                                                        all_four: bool) -> None:
    """Invariant 6 of issue 45: "not trained by design" only when no optimizer holds the parameter; with its
    callback alone and with all four."""
    from lightning_debug import debug_callbacks

    callbacks = debug_callbacks("full_debug") if all_four else [GradientHealthCallback()]
    trainer, _ = fit(tmp_path, FrozenByAccident(on_purpose), callbacks, 12)
    events = read_events(debug_dir(trainer))
    loud = [e for e in events if e["severity"] in {"warning", "error", "critical"}]
    markdown = (debug_dir(trainer) / "report.md").read_text()
    trainability = read_report(debug_dir(trainer))["sections"]["gradients"]["trainability"]
    if on_purpose:
        assert loud == []
        info = [e for e in events if e["kind"] == "requires_grad_false"]
        assert info and info[0]["details"]["parameters"] == ["inp.weight", "inp.bias"]
        assert trainability["requires_grad_false_parameters"] == 2 and "not trained by design" in markdown
        return
    frozen = starts(events, "frozen_param")
    assert [(e["step"], e["details"]["cause"], e["details"]["parameters"]) for e in frozen] == [
        (0, "requires_grad_false", ["inp.weight", "inp.bias"])], loud
    assert {e["kind"] for e in loud} == {"frozen_param"}, loud
    assert not [e for e in events if e["kind"] == "requires_grad_false"]
    assert trainability["requires_grad_false_parameters"] == 0 and trainability["requires_grad_false_in_optimizer"] == 2
    assert "`inp.weight`" in markdown and "not trained by design" not in markdown
    assert "No problems found" not in markdown
