"""The rest of the debugging checklist, planted in real Trainer runs and Accelerate loops (CPU):
activation statistics (dead ReLUs), runtime errors explained (shape mismatch, in-place), bad
batches (NaN in one sample), silent killers (a submodule left in eval mode, gradients never
zeroed), and healthy runs on models nobody here wrote that must stay quiet."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback, check_labels, debug_callbacks
from lightning_debug.checks.activations import metric_names
from lightning_debug.core.kinds import ErrorCategory, Severity
from lightning_debug.monitors.errors import classify
from tests.harness.toolkit import (
    TinyRegressor,
    debug_dir,
    make_trainer,
    read_events,
    read_histogram_tags,
    read_report,
    read_scalars,
    regression_data,
    run_dir,
)

pytestmark = pytest.mark.timeout(180)


QUIET = DebugConfig(print_summary=False, save_plots=False)


def starts(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and e.get("episode") != "end"]


def text_tags(log_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return list(accumulator.Tags()["tensors"])


TIMING_KINDS = ("slow_step", "dataloader_bottleneck", "straggler_rank")  # machine-speed dependent: not asserted here


def serious(report: dict[str, Any]) -> dict[str, str]:
    return {kind: entry["first_message"] for kind, entry in report["findings"].items()
            if Severity.parse(entry["severity"]).at_least(Severity.WARNING) and kind not in TIMING_KINDS}


def fit_quietly(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)


class SequentialNet(pl.LightningModule):
    """``net``: Linear -> ReLU -> Linear -> ReLU -> Linear, with the bugs planted by arguments.

    Args:
        dead_bias: The bias of ``net.2`` (feeding the second ReLU): -50 kills that ReLU.
        eval_block: Call ``.eval()`` on ``block`` (a trainable Linear + Dropout) in ``__init__``.
        frozen_eval_block: The same block in eval mode but frozen (a pretrained backbone): no finding.
        head_in: ``in_features`` of ``head``; not 16 plants a shape mismatch from ``mismatch_at``.
        inplace_at: From this step on, the forward adds 1 in place to a ReLU's output.
        nan_sample: (global batch index, sample) given a NaN input.
    """

    def __init__(self, dead_bias: float | None = None, eval_block: bool = False, frozen_eval_block: bool = False,
                 mismatch_at: int | None = None, inplace_at: int | None = None,
                 nan_sample: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
        self.head = nn.Linear(16, 1)
        self.mismatch_at, self.inplace_at, self.nan_sample = mismatch_at, inplace_at, nan_sample
        if dead_bias is not None:
            with torch.no_grad():
                self.net[2].bias.fill_(dead_bias)
        if eval_block or frozen_eval_block:
            self.block.eval()
        if frozen_eval_block:
            self.block.requires_grad_(False)

    def _from(self, step: int | None) -> bool:
        return step is not None and self.trainer.global_step >= step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net(x)
        if self._from(self.inplace_at):
            h += 1.0  # the ReLU's backward needs its output
        h = self.block(h)
        if self._from(self.mismatch_at):
            h = torch.cat([h, h], dim=1)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        data = regression_data()
        if self.nan_sample is not None:
            batch, sample = self.nan_sample
            data.tensors[0][batch * 16 + sample, 3] = float("nan")
        return DataLoader(data, batch_size=16)


def fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback] | None = None,
        max_steps: int = 8, **config: Any) -> pl.Trainer:
    options = dict(gradient_checking_frequency=1, print_summary=False, save_plots=False)
    options.update(config)
    trainer = make_trainer(tmp_path, callbacks if callbacks is not None else debug_callbacks(DebugConfig(**options)),
                           max_steps=max_steps)
    fit_quietly(trainer, model)
    return trainer


# --- activation statistics ------------------------------------------------------------------------

def test_a_dead_relu_is_named_with_the_layer_that_feeds_it(tmp_path: Path) -> None:
    trainer = fit(tmp_path, SequentialNet(dead_bias=-50.0), log_activations=True, gradient_checking_frequency=2)
    events = read_events(debug_dir(trainer))
    dead = starts(events, "dead_activation")
    # gradient check steps 0, 2, 4, 6; step 0 is timed by the performance profiler (every 10 steps), so step 1
    assert [(e["step"], e["details"]["modules"]) for e in dead] == [(1, ["net.3"])], dead
    assert dead[0]["details"]["fed_by"] == "net.2 (Linear)" and dead[0]["details"]["zero_fraction"] == 1.0
    assert "`net.3` (ReLU, fed by `net.2` (Linear)) outputs zero for 100.0%" in dead[0]["message"]
    scalars = read_scalars(trainer.log_dir)
    assert sorted(dict(scalars["debug/activation/net.3/zero_fraction"])) == [1, 2, 4, 6], "gradient check steps only"
    assert all(value == 1.0 for _, value in scalars["debug/activation/net.3/zero_fraction"])
    assert 0.2 < dict(scalars["debug/activation/net.1/zero_fraction"])[1] < 0.8, "the healthy ReLU"
    for stat in ("mean", "std", "max_abs"):
        assert f"debug/activation/head/{stat}" in scalars
    assert "debug/activation/head/nonfinite_count" not in scalars, "a count is first written once it is not 0"
    report = read_report(debug_dir(trainer))
    assert report["findings"]["dead_activation"]["severity"] == "warning"
    assert report["sections"]["activations"]["flagged"]["dead_activation"] == {"net.3": 4}
    markdown = (debug_dir(trainer) / "report.md").read_text()
    assert "## Activations" in markdown and "| `net.3` | ReLU | [16, 16] |" in markdown
    assert "debug/events/dead_activation/text_summary" in text_tags(trainer.log_dir)


class SigmoidNet(SequentialNet):
    """A hidden sigmoid fed by weights 1000 times too large (saturated), and a sigmoid output (not judged)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid())
        self.out = nn.Sequential(nn.Linear(16, 1), nn.Sigmoid())
        with torch.no_grad():
            self.gate[0].weight.mul_(1000.0)  # x100 leaves 5 of 200 initialisations under 90% saturated
            self.out[0].bias.fill_(20.0)  # confident predictions: the output sigmoid sits at 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(x))


def test_a_saturated_sigmoid_is_named_and_expert_level_writes_histograms(tmp_path: Path) -> None:
    callback = GradientHealthCallback(QUIET, log_activations=True, level="expert", gradient_checking_frequency=2)
    trainer = fit(tmp_path, SigmoidNet(), callbacks=[callback], max_steps=4)
    saturated = starts(read_events(debug_dir(trainer)), "saturated_activation")
    assert [(e["step"], e["details"]["modules"], e["details"]["fed_by"]) for e in saturated] == [
        (0, ["gate.1"], "gate.0 (Linear)")], "the output sigmoid (out.1) is not judged"
    assert saturated[0]["details"]["saturated_fraction"] > 0.9
    scalars = read_scalars(trainer.log_dir)
    assert dict(scalars["debug/activation/out.1/saturated_fraction"])[0] == 1.0
    assert "debug/activation/out.0/saturated_fraction" not in scalars, "only for bounded activations"
    assert {"debug/activation_hist/gate.1", "debug/activation_hist/out.0"} <= set(read_histogram_tags(trainer.log_dir))


def test_activation_hooks_exist_only_during_a_check_steps_forward(tmp_path: Path) -> None:
    """Zero cost elsewhere: no hook on any other forward; with log_activations off one hooked forward per 100 steps,
    for the verdicts. (The first forward also has the gradient check's one-time hooks that record the modules' order,
    removed before its backward, and batch_mixing's, which keep the step's first module call, removed at its end.)"""
    seen: list[tuple[int, int]] = []
    ordering: list[int] = []

    class Probe(SequentialNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hooks = [hook for m in self.modules() for hook in m._forward_hooks.values()]
            once = [hook for hook in hooks
                    if any(owner in getattr(hook, "__qualname__", "") for owner in ("ForwardOrder", "CallWatch"))]
            ordering.append(len(once))
            seen.append((self.trainer.global_step, len(hooks) - len(once)))
            return super().forward(x)

    fit(tmp_path / "on", Probe(), log_activations=True, gradient_checking_frequency=3)
    measured = (1, 3, 6)  # gradient check steps 0, 3, 6; the profiler times step 0 (every 10 steps), so step 1
    hooked = 7 + 3  # one per leaf module, and one per module with children (the model, net, block) noting its output
    assert seen == [(step, hooked if step in measured else 0) for step in range(8)], "one hook per module"
    assert ordering[0] > 0 and ordering[1:] == [0] * 7, "the order's hooks are there on the first forward only"
    trainer = fit(tmp_path / "timed", Probe(), log_activations=True, gradient_checking_frequency=3,
                  performance_profiling_frequency=1)
    perf = read_report(debug_dir(trainer))["sections"]["performance"]
    assert perf["excluded_steps"] == 2, "timing every step, every other check step is hooked (0 and 6, not 3)"
    seen.clear()
    seen.clear()
    trainer = fit(tmp_path / "off", Probe(), gradient_checking_frequency=1)
    # without log_activations the verdicts measure one forward per 100 steps: step 0's, deferred past the profiler
    assert seen == [(step, hooked if step == 1 else 0) for step in range(8)]
    assert not any(tag.startswith("debug/activation/") for tag in read_scalars(trainer.log_dir))


def test_metric_names_are_safe_for_every_logger() -> None:
    names = metric_names(["", "blocks.0.mlp.act", "heads[cls]", "heads_cls_", "a b"])
    assert names == ["model", "blocks.0.mlp.act", "heads_cls_", "heads_cls__2", "a_b"]


# --- runtime errors explained ------------------------------------------------------------------------

def test_a_shape_mismatch_names_the_module_and_both_shapes_and_the_error_propagates(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(QUIET)], max_steps=8)
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied \(16x32 and 16x1\)$"):
        fit_quietly(trainer, SequentialNet(mismatch_at=3))
    events = starts(read_events(debug_dir(trainer)), "exception")
    assert len(events) == 1 and events[0]["step"] == 3 and events[0]["severity"] == "error"
    details = events[0]["details"]
    assert details["category"] == "shape_mismatch" and details["modules"] == ["head"]
    assert details["module"]["inputs"] == {"input": {"shape": [16, 32], "dtype": "float32", "device": "cpu"}}
    assert details["module"]["parameters"]["weight"]["shape"] == [1, 16]
    assert details["module"]["expects"] == {"in_features": 16}
    assert details["source"]["code"] == "return self.head(h)"
    message = events[0]["message"]
    assert "in module `head` (Linear(in_features=16, out_features=1, bias=True))" in message
    assert ("it was called with `input` [16, 32] but expects in_features=16; its own tensors: `weight` [1, 16]"
            in message)
    report = read_report(debug_dir(trainer))
    assert report["status"] == "failed" and report["findings"]["exception"]["first_step"] == 3
    markdown = (debug_dir(trainer) / "report.md").read_text()
    assert "## Runtime error" in markdown and "### `shape_mismatch` at step 3" in markdown
    assert "debug/events/exception/text_summary" in text_tags(trainer.log_dir)


def test_an_inplace_error_names_the_operation_its_line_and_the_fix(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [GradientHealthCallback(QUIET)], max_steps=8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit_quietly(trainer, SequentialNet(inplace_at=2))
    event = starts(read_events(debug_dir(trainer)), "exception")[0]
    details = event["details"]
    assert event["step"] == 2 and details["category"] == "inplace_operation"
    assert details["modified"]["node"] in ("Relu", "ReluBackward0") and details["modified"]["shape"] == [16, 16]
    assert details["inplace"]["operation"] == "Tensor.add_"
    assert details["inplace"]["source"]["code"].startswith("h += 1.0")
    assert "`x = x + y`" in event["message"]
    assert "x = x + y" in (debug_dir(trainer) / "report.md").read_text()


def test_messages_are_classified() -> None:
    cases = {
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported":
            ErrorCategory.DEVICE_ASSERT,
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!":
            ErrorCategory.DEVICE_MISMATCH,
        "Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same":
            ErrorCategory.DEVICE_MISMATCH,
        "expected scalar type Long but found Float": ErrorCategory.DTYPE_MISMATCH,
        "Target 5 is out of bounds.": ErrorCategory.INDEX_OUT_OF_RANGE,
        "element 0 of tensors does not require grad and does not have a grad_fn": ErrorCategory.NO_GRAD,
        "Expected to have finished reduction in the prior iteration before starting a new one.":
            ErrorCategory.DDP_UNUSED_PARAMETERS,
        "Given groups=1, weight of size [8, 3, 3, 3], expected input[2, 1, 8, 8] to have 3 channels, but got 1 "
        "channels instead": ErrorCategory.SHAPE_MISMATCH,
        "something else entirely": ErrorCategory.OTHER,
    }
    assert {message: classify(RuntimeError(message)) for message in cases} == cases
    assert classify(torch.OutOfMemoryError("CUDA out of memory.")) is ErrorCategory.OOM


def test_a_label_out_of_range_and_a_device_mismatch_are_explained(tmp_path: Path) -> None:
    class Classifier(SequentialNet):
        def __init__(self, mistake: str) -> None:
            super().__init__()
            self.mistake = mistake

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            if self.mistake == "device":
                x = x.to("meta")  # a tensor on another device than the model
            labels = torch.full((x.shape[0],), 3 if self.trainer.global_step == 2 else 0)
            return nn.functional.cross_entropy(torch.cat([self(x)] * 3, dim=1), labels)

    trainer = make_trainer(tmp_path / "label", [AnomalyDetectionCallback(QUIET)], max_steps=5)
    with pytest.raises(IndexError, match="Target 3 is out of bounds"):
        fit_quietly(trainer, Classifier("label"))
    event = starts(read_events(debug_dir(trainer)), "exception")[0]
    assert event["details"]["category"] == "index_out_of_range" and event["step"] == 2
    assert event["details"]["label"] == 3 and event["details"]["num_classes"] == 3
    assert "a class label is 3 but the model's output has 3 classes" in event["message"]
    trainer = make_trainer(tmp_path / "device", [AnomalyDetectionCallback(QUIET)], max_steps=5)
    with pytest.raises(RuntimeError, match="device"):
        fit_quietly(trainer, Classifier("device"))
    details = starts(read_events(debug_dir(trainer)), "exception")[0]["details"]
    assert details["category"] == "device_mismatch" and details["modules"] == ["net.0"]
    assert details["module"]["inputs"]["input"]["device"] == "meta"
    assert details["module"]["parameters"]["weight"]["device"] == "cpu"


def test_check_labels_names_the_samples_and_its_error_is_explained(tmp_path: Path) -> None:
    class Labelled(SequentialNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            labels = torch.zeros(x.shape[0], dtype=torch.long)
            if self.trainer.global_step == 1:
                labels[[2, 9]] = torch.tensor([-1, 7])
            check_labels(labels, num_classes=2)
            return nn.functional.cross_entropy(torch.cat([self(x)] * 2, dim=1), labels)

    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(QUIET)], max_steps=4)
    match = r"2 class label\(s\) outside \[0, 2\): samples \[2, 9\] have labels \[-1, 7\]"
    with pytest.raises(ValueError, match=match):
        fit_quietly(trainer, Labelled())
    event = starts(read_events(debug_dir(trainer)), "exception")[0]
    assert event["step"] == 1 and event["details"]["category"] == "index_out_of_range"
    with pytest.raises(ValueError, match="must be integers"):
        check_labels(torch.tensor([0.0, 1.0]), num_classes=2)
    check_labels(torch.tensor([0, 1, -100]), num_classes=2)  # cross_entropy's ignore_index


# --- bad batches -------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_nan_in_sample_5_is_reported_with_its_sample_index(tmp_path: Path, level: str) -> None:
    trainer = fit(tmp_path, SequentialNet(nan_sample=(3, 5)), callbacks=[AnomalyDetectionCallback(
        QUIET, level=level, anomaly_detection_mode="skip")])
    events = read_events(debug_dir(trainer))
    bad = starts(events, "nonfinite_input")
    assert len(bad) == 1 and bad[0]["step"] == 3 and bad[0]["batch"] == 3
    assert bad[0]["details"]["samples"] == [5] and bad[0]["details"]["tensor"] == "batch[0]"
    assert bad[0]["details"]["shape"] == [16, 8] and bad[0]["details"]["count"] == 1
    loss = starts(events, "nonfinite_loss")[0]
    assert loss["step"] == 3 and "the batch itself holds NaN/Inf" in loss["message"]
    if level == "advanced":
        assert loss["details"]["cause"]["inputs"]["samples"] == [5]
    report = read_report(debug_dir(trainer))
    assert report["sections"]["anomaly"]["nonfinite_inputs"][0]["samples"] == [5]
    assert "## Batches with NaN/Inf" in (debug_dir(trainer) / "report.md").read_text()
    assert report["sections"]["anomaly"]["skipped_steps"] == 1



@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_nan_marking_missing_values_that_the_model_imputes_is_an_info_naming_its_samples(tmp_path: Path,
                                                                                          level: str) -> None:
    """Tabular data marks a missing value with NaN and the model imputes it: the step is finite, nothing to skip."""

    class Imputes(SequentialNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(torch.where(x.isnan(), 0.0, x)), y)

    trainer = fit(tmp_path, Imputes(nan_sample=(3, 5)), callbacks=[AnomalyDetectionCallback(
        QUIET, level=level, anomaly_detection_mode="skip")])
    events = read_events(debug_dir(trainer))
    bad = starts(events, "nonfinite_input")
    assert [(e["step"], e["severity"], e["details"]["samples"], e["details"]["handled"]) for e in bad] == [
        (3, "info", [5], True)]
    assert "the model handles them" in bad[0]["message"]
    assert [(e["kind"], e["severity"]) for e in events if e["severity"] in ("warning", "error", "critical")] == []
    report = read_report(debug_dir(trainer))
    assert report["sections"]["anomaly"]["skipped_steps"] == 0
    assert report["sections"]["anomaly"]["nonfinite_inputs"][0]["samples"] == [5]

def test_a_float_mask_filled_with_the_dtype_minimum_is_not_an_infinity(tmp_path: Path) -> None:
    class Masked(SequentialNet):
        def train_dataloader(self) -> DataLoader:
            data = regression_data()
            mask = torch.zeros(len(data), 8).index_fill_(1, torch.tensor([7]), torch.finfo(torch.float32).min)
            return DataLoader(TensorDataset(data.tensors[0], data.tensors[1], mask), batch_size=16)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, mask = batch
            return nn.functional.mse_loss(self(x * (mask == 0)), y)

    trainer = fit(tmp_path, Masked(), callbacks=[AnomalyDetectionCallback(QUIET)])
    assert not starts(read_events(debug_dir(trainer)), "nonfinite_input")


# --- silent killers ----------------------------------------------------------------------------------

def test_a_trainable_submodule_left_in_eval_mode_is_named(tmp_path: Path) -> None:
    trainer = fit(tmp_path / "eval", SequentialNet(eval_block=True),
                  callbacks=[AnomalyDetectionCallback(QUIET)])
    events = starts(read_events(debug_dir(trainer)), "eval_mode_in_training")
    assert [(e["step"], e["details"]["modules"], e["details"]["affected"]) for e in events] == [
        (0, ["block"], ["block.1"])]
    assert "`block` is in eval mode while the model trains" in events[0]["message"]
    assert "Training loop" in (debug_dir(trainer) / "report.md").read_text()
    trainer = fit(tmp_path / "frozen", SequentialNet(frozen_eval_block=True),
                  callbacks=[AnomalyDetectionCallback(QUIET)])
    assert not starts(read_events(debug_dir(trainer)), "eval_mode_in_training"), "a frozen backbone may stay in eval"


class FrozenStatistics(SequentialNet):
    """The ``norm_eval`` recipe of small-batch fine-tuning: BatchNorm layers kept in eval mode (running statistics as
    pretrained) by ``train()``, their affine parameters trained; every other layer trains normally."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                                 nn.ReLU())
        self.train()

    def train(self, mode: bool = True) -> FrozenStatistics:
        super().train(mode)
        for module in self.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.eval()
        return self


def test_normalization_layers_kept_in_eval_on_purpose_are_an_info(tmp_path: Path) -> None:
    trainer = fit(tmp_path, FrozenStatistics(), callbacks=[AnomalyDetectionCallback(QUIET)])
    events = starts(read_events(debug_dir(trainer)), "eval_mode_in_training")
    assert [(e["severity"], e["details"]["modules"]) for e in events] == [("info", ["net.1", "net.4"])], events
    assert events[0]["details"]["frozen_statistics"] and "frozen-statistics recipe" in events[0]["message"]
    assert all(e["severity"] == "info" for e in read_events(debug_dir(trainer))), "a healthy run"


class ManualNoZeroGrad(pl.LightningModule):
    """Manual optimization that forgets ``zero_grad()`` (``zero_grad`` True: the healthy control); two losses
    with a backward each, so the second backward adds to the first one's gradients, as intended."""

    def __init__(self, zero_grad: bool, set_to_none: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.zero_grad_each_step = zero_grad
        self.set_to_none = set_to_none

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        if self.zero_grad_each_step:
            optimizer.zero_grad(set_to_none=self.set_to_none)
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.model(x), y))
        self.manual_backward(self.model(x).abs().mean() * 1e-3)
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


class TwoOptimizers(pl.LightningModule):
    """A GAN-style step: each optimizer zeroes its own gradients right before its own backward, so when the
    discriminator steps the generator still holds its previous gradients, and the other way round."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.critic = nn.Linear(4, 8), nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        g_opt, d_opt = self.optimizers()
        real, noise = batch[0], torch.randn(batch[0].shape[0], 4)
        d_opt.zero_grad()
        self.manual_backward(self.critic(self.generator(noise).detach()).mean() - self.critic(real).mean())
        d_opt.step()
        g_opt.zero_grad()
        self.manual_backward(-self.critic(self.generator(noise)).mean())
        g_opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.generator.parameters(), lr=0.01), torch.optim.SGD(self.critic.parameters(), lr=0.01)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(features=8), batch_size=16)


def test_manual_optimization_without_zero_grad_is_named(tmp_path: Path) -> None:
    trainer = fit(tmp_path / "bug", ManualNoZeroGrad(zero_grad=False), gradient_checking_frequency=2)
    events = starts(read_events(debug_dir(trainer)), "grad_not_zeroed")
    assert [e["step"] for e in events] == [2] and events[0]["severity"] == "error"
    assert events[0]["details"]["parameters"] == ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    trainer = fit(tmp_path / "ok", ManualNoZeroGrad(zero_grad=True), gradient_checking_frequency=2)
    assert not starts(read_events(debug_dir(trainer)), "grad_not_zeroed")
    trainer = fit(tmp_path / "zeros", ManualNoZeroGrad(zero_grad=True, set_to_none=False), gradient_checking_frequency=2)
    assert not starts(read_events(debug_dir(trainer)), "grad_not_zeroed"), "gradients zeroed in place are zeroed too"
    trainer = fit(tmp_path / "gan", TwoOptimizers(), gradient_checking_frequency=1, max_steps=12)
    assert not starts(read_events(debug_dir(trainer)), "grad_not_zeroed"), "each optimizer zeroes its own"


# --- healthy runs on code nobody here wrote ----------------------------------------------------------

def healthy_config(**overrides: Any) -> DebugConfig:
    options: dict[str, Any] = dict(log_activations=True, gradient_checking_frequency=2, memory_profiling_frequency=4,
                                   performance_profiling_frequency=2, print_summary=False, save_plots=False)
    options.update(overrides)
    return DebugConfig(**options)


def test_a_healthy_toy_run_with_every_check_reports_nothing_serious(tmp_path: Path) -> None:
    trainer = fit(tmp_path, SequentialNet(), callbacks=debug_callbacks(healthy_config()), max_steps=16)
    report = read_report(debug_dir(trainer))
    assert serious(report) == {} and report["sections"]["activations"]["checks"] == 8


class HuggingFace(pl.LightningModule):
    """A ``transformers`` model built from a tiny config, trained on random tokens."""

    def __init__(self, model: nn.Module, classify: bool) -> None:
        super().__init__()
        self.model, self.classify = model, classify

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 100, (64, 16), generator=generator)
        labels = torch.randint(0, 2, (64,), generator=generator) if self.classify else ids
        return DataLoader(TensorDataset(ids, labels), batch_size=8)


def test_healthy_transformers_models_report_nothing_serious(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32))
    # attention.self.key.bias gets an exactly zero gradient by construction (softmax is shift-invariant):
    # vanishing_grad's own judgment is issue 13's; the threshold 0 keeps it out of this test of the new checks
    trainer = fit(tmp_path / "bert", HuggingFace(bert, classify=True), max_steps=10,
                  callbacks=debug_callbacks(healthy_config(gradient_vanishing_threshold=0.0)))
    report = read_report(debug_dir(trainer))
    assert serious(report) == {}
    assert report["sections"]["activations"]["latest"]["model.bert.pooler.activation"]["type"] == "Tanh"
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32, activation_function="relu"))
    trainer = fit(tmp_path / "gpt2", HuggingFace(gpt2, classify=False), max_steps=10,
                  callbacks=debug_callbacks(healthy_config()))
    report = read_report(debug_dir(trainer))
    assert serious(report) == {}
    relu = report["sections"]["activations"]["latest"]["model.transformer.h.0.mlp.act"]
    assert relu["type"] == "ReLU" and 0.2 < relu["zero_fraction"] < 0.8


def test_healthy_lightning_demo_models_report_nothing_serious(tmp_path: Path) -> None:
    from lightning.pytorch.demos import LightningTransformer

    class RandomTokens(LightningTransformer):
        def prepare_data(self) -> None:
            pass

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, 50, (64, 12), generator=generator)
            return DataLoader(TensorDataset(tokens, torch.roll(tokens, -1, dims=1)), batch_size=8)

    torch.manual_seed(0)
    # its healthy global gradient norm is ~12 at lr 0.1; the fixed explosion threshold (10) is issue 13's to judge
    trainer = fit(tmp_path, RandomTokens(vocab_size=50), max_steps=10,
                  callbacks=debug_callbacks(healthy_config(gradient_explosion_threshold=100.0)))
    report = read_report(debug_dir(trainer))
    assert serious(report) == {}
    assert report["sections"]["activations"]["checks"] == 5


# --- the same checks in an Accelerate loop -----------------------------------------------------------

@pytest.fixture
def accelerate_state() -> Any:
    """Accelerate keeps process-wide singletons; each loop starts from a clean one."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerate_loop(root: Path, *, steps: int = 8, zero_grad: bool = True, accumulation: int = 1,
                    forget_train_after_eval_at: int | None = None, **model_options: Any) -> Path:
    """A plain Accelerate loop over :class:`SequentialNet`'s modules with the debugger's three lines."""
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(root),
                              gradient_accumulation_steps=accumulation)
    accelerator.init_trackers("run")
    net = SequentialNet(**model_options)
    model = nn.ModuleDict({"net": net.net, "block": net.block, "head": net.head})
    data = regression_data()
    if net.nan_sample is not None:
        data.tensors[0][net.nan_sample[0] * 16 + net.nan_sample[1], 3] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    class Forward(nn.Module):  # the loop calls one module, as with a real model
        def __init__(self) -> None:
            super().__init__()
            self.layers = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.layers["net"](x)
            if net.inplace_at is not None and debugger.step >= net.inplace_at:
                h += 1.0
            h = self.layers["block"](h)
            if net.mismatch_at is not None and debugger.step >= net.mismatch_at:
                h = torch.cat([h, h], dim=1)
            return self.layers["head"](h)

    forward = Forward()
    debugger = AccelerateDebugger(accelerator, forward, optimizer, DebugConfig(
        gradient_checking_frequency=1, print_summary=False, save_plots=False, log_activations=True))
    with warnings.catch_warnings(), debugger:
        warnings.simplefilter("ignore")
        while debugger.step < steps:
            for x, y in loader:
                with accelerator.accumulate(forward):
                    loss = nn.functional.mse_loss(forward(x), y)
                    debugger.backward(loss)
                    optimizer.step()
                    if zero_grad:
                        optimizer.zero_grad()
                if forget_train_after_eval_at is not None and debugger.step == forget_train_after_eval_at:
                    forward.eval()
                    with torch.no_grad():
                        forward(x)  # an evaluation, and no forward.train() afterwards
                if debugger.step >= steps:
                    break
    accelerator.end_training()
    return run_dir(root / "debug_outputs")


def test_accelerate_loop_without_zero_grad_is_named(tmp_path: Path, accelerate_state: Any) -> None:
    events = read_events(accelerate_loop(tmp_path / "bug", zero_grad=False, steps=4))
    found = starts(events, "grad_not_zeroed")
    assert [e["step"] for e in found] == [1] and found[0]["callback"] == "AccelerateDebugger"
    assert {"layers.net.0.weight", "layers.head.bias"} <= set(found[0]["details"]["parameters"])
    ends = [e for e in events if e["kind"] == "grad_not_zeroed" and e.get("episode") == "end"]
    assert ends and ends[0]["details"]["steps"] == 3, "one episode over every step after the first"
    healthy = read_events(accelerate_loop(tmp_path / "ok", steps=4, accumulation=4))
    assert not starts(healthy, "grad_not_zeroed"), "accumulating over micro-batches of one step is intended"


def test_accelerate_loop_explains_errors_and_bad_batches_and_names_dead_relus(tmp_path: Path,
                                                                                accelerate_state: Any) -> None:
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        accelerate_loop(tmp_path / "shape", mismatch_at=2)
    event = starts(read_events(run_dir(tmp_path / "shape" / "debug_outputs")), "exception")[0]
    assert event["step"] == 2 and event["details"]["category"] == "shape_mismatch"
    assert event["details"]["modules"] == ["layers.head"]
    assert event["details"]["module"]["inputs"]["input"]["shape"] == [16, 32]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        accelerate_loop(tmp_path / "inplace", inplace_at=1)
    event = starts(read_events(run_dir(tmp_path / "inplace" / "debug_outputs")), "exception")[0]
    assert event["step"] == 1 and event["details"]["category"] == "inplace_operation"
    assert event["details"]["inplace"]["operation"] == "Tensor.add_"
    assert event["details"]["inplace"]["source"]["code"] == "h += 1.0"
    events = read_events(accelerate_loop(tmp_path / "bad", nan_sample=(3, 5), dead_bias=-50.0, steps=5))
    bad = starts(events, "nonfinite_input")
    assert [(e["step"], e["details"]["samples"], e["details"]["tensor"]) for e in bad] == [(3, [5], "batch")]
    dead = starts(events, "dead_activation")
    assert [(e["step"], e["details"]["modules"]) for e in dead] == [(1, ["layers.net.3"])], "step 0 is timed"


def test_accelerate_loop_left_in_eval_mode_after_evaluation_is_named(tmp_path: Path, accelerate_state: Any) -> None:
    events = read_events(accelerate_loop(tmp_path, forget_train_after_eval_at=2, steps=5))
    found = starts(events, "eval_mode_in_training")
    assert [(e["step"], e["details"]["modules"]) for e in found] == [(2, [""])]
    assert found[0]["message"].startswith("The whole model is in eval mode while the model trains (step 2)")


class FrozenBehindTheWrapper(TinyRegressor):
    """``inp`` is frozen at step 2, after DDP built its reducer over every trainable parameter; at step 3 DDP
    numbers the parameters it got no gradient for, in the order it built (the message recorded from
    torch 2.x's DDP, raised here on one process)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            self.inp.requires_grad_(False)
        if self.trainer.global_step == 3:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new "
                               "one. This error indicates that your module has parameters that were not used in "
                               "producing loss. Parameter indices which did not receive grad for rank 0: 0 1\n")
        return super().training_step(batch, batch_idx)


def test_ddp_indices_are_named_through_the_parameters_ddp_was_built_over(tmp_path: Path) -> None:
    """A stage frozen after the wrapper was built is still in DDP's numbering: indices 0 and 1 are ``inp``'s,
    not those of the first parameters that require a gradient now."""
    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig(save_plots=False, print_summary=False)),
                           max_steps=6)
    with pytest.raises(RuntimeError, match="did not receive grad"):
        trainer.fit(FrozenBehindTheWrapper())
    [event] = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "exception"]
    assert event["details"]["category"] == "ddp_unused_parameters"
    assert event["details"]["parameters"] == ["inp.weight", "inp.bias"]
