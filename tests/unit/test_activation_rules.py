"""Dead ReLUs and saturated sigmoid/tanh layers, fed recorded output statistics: no Trainer, milliseconds."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_debug import DebugConfig
from lightning_debug.checks.activations import ROW, dead_units_pushed, output_stats, saturation_range
from lightning_debug.checks.output_gradient import average_guess
from lightning_debug.core.context import RunContext
from lightning_debug.core.kinds import Kind
from lightning_debug.monitors.activations import (
    DEAD_FRACTION,
    LOSS_KEPT,
    MIN_ELEMENTS,
    SATURATED_FRACTION,
    VERDICT_SPACING,
    ActivationMonitor,
    Output,
    activation_findings,
    split_stats,
)
from lightning_debug.run import Run

SHAPE = [8, 16]  # 128 values, above MIN_ELEMENTS


def relu(label: str = "act", shape: list[int] | None = None, fed_by: str | None = "fc (Linear)") -> Output:
    return Output(label, "ReLU", shape or SHAPE, relu_like=True, saturating=False, fed_by=fed_by)


def sigmoid(label: str = "gate", shape: list[int] | None = None) -> Output:
    return Output(label, "Sigmoid", shape or SHAPE, relu_like=False, saturating=True, fed_by=None)


def linear(label: str = "head") -> Output:
    return Output(label, "Linear", SHAPE, relu_like=False, saturating=False, fed_by=None)


def stats(zero: float = 0.5, saturated: float = math.nan, mean: float = 0.3, max_abs: float = 2.0) -> dict[str, float]:
    return {"mean": mean, "std": 1.0, "max_abs": max_abs, "zero_fraction": zero, "saturated_fraction": saturated,
            "nonfinite_count": 0.0}


def kinds(outputs: list[Output], rows: list[dict[str, float]]) -> list[tuple[Kind, str]]:
    return [(f.kind, f.details["modules"][0]) for f in activation_findings(4, outputs, rows)]


def test_a_relu_that_outputs_only_zeros_is_dead() -> None:
    found = activation_findings(4, [relu(), linear()], [stats(zero=1.0, max_abs=0.0), stats()])
    assert [f.kind for f in found] == [Kind.DEAD_ACTIVATION]
    finding = found[0]
    assert finding.details == {"modules": ["act"], "module_type": "ReLU", "fed_by": "fc (Linear)", "shape": SHAPE,
                               "zero_fraction": 1.0, "max_abs": 0.0}
    assert "`act` (ReLU, fed by `fc` (Linear))" in finding.message
    assert "to `fc` (Linear) and the layers" in finding.message


@pytest.mark.parametrize("zero", [0.0, 0.5, 0.95, DEAD_FRACTION - 1e-6, math.nan])
def test_a_sparse_but_living_relu_is_not_dead(zero: float) -> None:
    assert kinds([relu(), linear()], [stats(zero=zero), stats()]) == []


def test_the_dead_threshold_is_inclusive() -> None:
    assert kinds([relu(), linear()], [stats(zero=DEAD_FRACTION), stats()]) == [(Kind.DEAD_ACTIVATION, "act")]


def test_zeros_of_a_module_that_is_no_relu_are_not_dead() -> None:
    assert kinds([linear("fc"), linear()], [stats(zero=1.0), stats()]) == []


def test_tiny_outputs_are_not_judged() -> None:
    tiny = [1, MIN_ELEMENTS - 1]
    assert kinds([relu(shape=tiny), sigmoid(shape=tiny), linear()],
                 [stats(zero=1.0), stats(saturated=1.0), stats()]) == []


def test_a_hidden_sigmoid_stuck_at_its_ends_is_saturated() -> None:
    found = activation_findings(2, [sigmoid(), linear()], [stats(saturated=0.97, mean=0.99), stats()])
    assert [f.kind for f in found] == [Kind.SATURATED_ACTIVATION]
    assert found[0].details["saturated_fraction"] == 0.97 and found[0].details["mean"] == 0.99
    assert "97.0% of its 128 outputs" in found[0].message


@pytest.mark.parametrize("saturated", [0.0, 0.5, SATURATED_FRACTION - 1e-6, math.nan])
def test_a_sigmoid_inside_its_range_is_not_saturated(saturated: float) -> None:
    assert kinds([sigmoid(), linear()], [stats(saturated=saturated), stats()]) == []


def test_the_models_last_output_may_be_saturated() -> None:
    """A confident classifier's final sigmoid sits at 0 or 1 by design."""
    assert kinds([linear(), sigmoid()], [stats(), stats(saturated=1.0)]) == []


def regression_output(saturated: float, loss: float, first_loss: float = 9.5,
                      first_saturated: float = 0.0) -> list[tuple[Kind, str]]:
    outputs = [relu("act"), Output("out_act", "Tanh", [32, 1], relu_like=False, saturating=True, fed_by=None)]
    found = activation_findings(4, outputs, [stats(), stats(saturated=saturated)], loss, first_loss, first_saturated)
    return [(f.kind, f.details["modules"][0]) for f in found]


def test_the_models_output_saturated_while_the_loss_stays_where_it_was_is_named_a_confident_one_is_not() -> None:
    """A tanh on a regression output whose targets reach +-5: 97% of the batch of 32 at +-1, the loss 47% of its
    first value; the same outputs after the loss fell under LOSS_KEPT are a classifier's confident predictions."""
    assert regression_output(0.97, loss=4.46) == [(Kind.SATURATED_ACTIVATION, "out_act")]
    assert regression_output(0.97, loss=LOSS_KEPT * 9.5 * 0.9) == []
    assert regression_output(0.97, loss=math.nan) == []  # the loss unknown: not judged
    assert regression_output(SATURATED_FRACTION - 1e-6, loss=4.46) == []
    assert regression_output(0.97, loss=4.46, first_saturated=1.0) == []  # built saturated: not pushed by training
    assert regression_output(0.97, loss=4.46, first_saturated=math.nan) == [(Kind.SATURATED_ACTIVATION, "out_act")]


def test_a_unit_of_the_models_output_zero_for_every_sample_is_dead_a_hidden_one_is_not() -> None:
    """A ReLU on the logits: one class of four gets no gradient; a hidden ReLU with dead units is ordinary."""
    logits = Output("out_act", "ReLU", [32, 4], relu_like=True, saturating=False, fed_by="head (Linear)")
    one_dead = dict(stats(zero=0.6), dead_unit_fraction=0.25)
    assert kinds([linear(), logits], [stats(), one_dead]) == [(Kind.DEAD_ACTIVATION, "out_act")]
    assert kinds([relu("hidden", [32, 32]), linear()], [one_dead, stats()]) == []
    assert kinds([linear(), logits], [stats(), dict(stats(zero=0.6), dead_unit_fraction=0.0)]) == []
    assert kinds([linear(), logits], [stats(), stats(zero=0.6)]) == []  # fewer than MIN_SAMPLES rows: not measured


def test_a_sparse_layer_is_not_dead_a_layer_with_few_units_left_or_most_samples_off_is() -> None:
    """99.5% zeros three ways: a sparse autoencoder's features (every sample has some on, many features serve the
    batch) is no finding; 5 units of 1000 on for every sample and none else (the rest died), and most samples with no
    unit on, are dead; unmeasured (fewer than 8 samples) stays named."""
    hidden = relu("features", [256, 1000])
    mostly_zero = stats(zero=0.995)
    cases = {"sparse": dict(mostly_zero, dead_unit_fraction=0.6, zero_row_fraction=0.01),
             "few_units_left": dict(mostly_zero, dead_unit_fraction=0.995, zero_row_fraction=0.0),
             "most_samples_off": dict(mostly_zero, dead_unit_fraction=0.7, zero_row_fraction=0.8),
             "unmeasured": mostly_zero}
    named = {name: kinds([hidden, linear()], [row, stats()]) for name, row in cases.items()}
    assert named == {"sparse": [], "few_units_left": [(Kind.DEAD_ACTIVATION, "features")],
                     "most_samples_off": [(Kind.DEAD_ACTIVATION, "features")],
                     "unmeasured": [(Kind.DEAD_ACTIVATION, "features")]}


def test_a_convolution_with_all_but_one_channel_dead_has_its_rows_off() -> None:
    """The unit dimension of a feature map [N, C, H, W] is its width: with 99 of 100 channels dead, every width
    position is on somewhere (no dead unit) but 99% of the rows are zero, so the layer reads as dead, not sparse."""
    maps = torch.zeros(8, 100, 6, 6)
    maps[:, 0] = torch.rand(8, 6, 6) + 0.1
    row = dict(zip(ROW, output_stats(maps, units=True).tolist()))
    assert row["zero_fraction"] >= 0.99 and row["dead_unit_fraction"] == 0.0
    assert row["zero_row_fraction"] == pytest.approx(0.99)
    assert kinds([relu("conv_act", [8, 100, 6, 6]), linear()], [row, stats()]) == [(Kind.DEAD_ACTIVATION, "conv_act")]


def test_dead_output_units_the_loss_does_not_push_up_are_at_their_target() -> None:
    """``dead_pushed``, read from the output's gradient: 0 (every dead unit's gradient is 0: targets of 0, as an
    autoencoder's blank pixels) is no finding; one or more is named with the count; NaN (not read) is named."""
    logits = Output("decoder.3", "ReLU", [32, 64], relu_like=True, saturating=False, fed_by="decoder.2 (Linear)")
    dead = dict(stats(zero=0.6), dead_unit_fraction=25 / 64)
    assert activation_findings(100, [linear(), logits], [stats(), dead], dead_pushed=0.0) == []
    found = activation_findings(100, [linear(), logits], [stats(), dead], dead_pushed=3.0)
    assert [f.kind for f in found] == [Kind.DEAD_ACTIVATION] and found[0].details["dead_units_pushed"] == 3
    assert "25 of its 64 output units are zero for every sample at step 100, 3 of them where the loss asks" in \
        found[0].message
    unread = activation_findings(100, [linear(), logits], [stats(), dead], dead_pushed=math.nan)
    assert [f.kind for f in unread] == [Kind.DEAD_ACTIVATION] and "dead_units_pushed" not in unread[0].details


@pytest.mark.parametrize("loss", ["mse_zero_targets", "mse_positive_targets", "cross_entropy", "l1_zero_targets"])
def test_dead_units_pushed_reads_what_each_loss_asks_of_a_dead_unit(loss: str) -> None:
    """Two of four ReLU outputs dead for every sample: with their targets at 0 (mse, l1) nothing pushes them; with
    positive targets, or as the logits of classes that appear in the batch, the loss asks both to rise."""
    torch.manual_seed(0)
    pre = torch.randn(16, 4).abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])
    pre.requires_grad_(True)
    out = torch.relu(pre)
    out.retain_grad()
    targets = torch.rand(16, 4) + 0.1
    if loss.endswith("zero_targets"):
        targets[:, 1::2] = 0.0
    if loss == "cross_entropy":
        value = F.cross_entropy(out, torch.arange(16) % 4)
    elif loss.startswith("l1"):
        value = F.l1_loss(out, targets)
    else:
        value = F.mse_loss(out, targets)
    value.backward()
    pushed = dead_units_pushed(out.grad, out.detach()).item()
    assert pushed == (0.0 if loss.endswith("zero_targets") else 2.0)


def saturated_run(steps: int, **options: Any) -> tuple[ActivationMonitor, dict[str, Any] | None, list[bool]]:
    """A hidden sigmoid saturated from the start (inputs x1000), measured on ``steps`` steps of frequency 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Sigmoid(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].weight.mul_(1000.0)
    config = DebugConfig(gradient_checking_frequency=1, save_debug_info=False, print_summary=False,
                         save_plots=False, **options)
    monitor = ActivationMonitor(config, "test")
    run = Run(config, Loop(model), [monitor])
    run.start(0)
    flagged = []
    for step in range(steps):
        run.batch_start(step, None)
        run.before_backward(step, model(torch.randn(8, 4)).sum())
        run.batch_end()
        run.after_optimizer_step(step + 1)
        monitor.poll(final=True)
        flagged.append(bool(monitor.flagged["saturated_activation"]))
    return monitor, run.finish("finished", steps), flagged


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_saturation_is_held_two_check_steps_and_recorded_from_the_first() -> None:
    _, report, flagged = saturated_run(2, log_activations=True)
    assert flagged == [False, True]
    assert report is not None and report["findings"]["saturated_activation"]["first_step"] == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_without_log_activations_a_forward_is_measured_once_per_spacing_and_no_table_is_kept() -> None:
    monitor, report, flagged = saturated_run(VERDICT_SPACING + 1)
    assert monitor.checks == 2 and flagged[-1] and not flagged[-2]  # steps 0 and VERDICT_SPACING
    assert report is not None and report["sections"]["activations"]["latest"] == {}


def test_findings_come_in_forward_order() -> None:
    outputs = [relu("a"), sigmoid("b"), relu("c"), linear()]
    rows = [stats(zero=1.0), stats(saturated=1.0), stats(zero=1.0), stats()]
    assert kinds(outputs, rows) == [(Kind.DEAD_ACTIVATION, "a"), (Kind.SATURATED_ACTIVATION, "b"),
                                    (Kind.DEAD_ACTIVATION, "c")]


def test_split_stats_keeps_the_saturated_fraction_of_bounded_modules_only() -> None:
    values = list(range(2 * len(ROW)))
    rows = split_stats([float(v) for v in values], [relu(), sigmoid()])
    assert "saturated_fraction" not in rows[0] and rows[1]["saturated_fraction"] == float(len(ROW) + 4)
    assert rows[1]["mean"] == float(len(ROW))


def test_measured_outputs_of_a_dead_and_a_saturated_layer() -> None:
    """From real tensors through output_stats, as the monitor reads them back."""
    dead = torch.relu(torch.full((8, 16), -3.0))
    saturated = torch.sigmoid(torch.full((8, 16), 20.0))
    values = torch.cat([output_stats(dead), output_stats(saturated, saturation_range(nn.Sigmoid())),
                        output_stats(torch.randn(8, 16))]).tolist()
    outputs = [relu(), sigmoid(), linear()]
    assert kinds(outputs, split_stats(values, outputs)) == [(Kind.DEAD_ACTIVATION, "act"),
                                                           (Kind.SATURATED_ACTIVATION, "gate")]


# --- the monitor in a hand-written loop -----------------------------------------------------------


class Loop(RunContext):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def module(self) -> nn.Module:
        return self.model


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_monitor_counts_flagged_modules_and_resumes_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    config = DebugConfig(log_activations=True, gradient_checking_frequency=1, save_debug_info=False,
                         print_summary=False, save_plots=False)
    monitor = ActivationMonitor(config, "test")
    run = Run(config, Loop(model), [monitor])
    run.start(0)
    for step in range(3):
        run.batch_start(step, None)
        run.before_backward(step, model(torch.randn(8, 4)).sum())
        run.batch_end()
        run.after_optimizer_step(step + 1)
    report = run.finish("finished", 3)
    assert report is not None and report["findings"]["dead_activation"]["episodes"] == 1
    section: dict[str, Any] = report["sections"]["activations"]
    assert section["checks"] == 3 and section["flagged"] == {"dead_activation": {"1": 3}}
    assert set(section["latest"]) == {"0", "1", "2"} and "saturated_fraction" not in section["latest"]["1"]
    restored = ActivationMonitor(config, "test")
    restored.load_state_dict(monitor.state_dict())
    assert restored.checks == 3 and restored.flagged["dead_activation"] == {"1": 3}


def test_report_md_has_an_activations_section_at_the_defaults_only_when_a_module_was_flagged() -> None:
    from lightning_debug.report.sections import activations_markdown

    quiet = {"logged": False, "checks": 3, "check_frequency": 100, "flagged": {}, "latest": {}}
    assert activations_markdown(quiet) == {}
    flagged = dict(quiet, flagged={"dead_activation": {"out_act": 2}})
    assert "| dead_activation | `out_act` | 2 |" in activations_markdown(flagged)["Activations"]
    assert "Activations" in activations_markdown(dict(quiet, logged=True))


@pytest.mark.parametrize("contiguous", [True, False])
def test_the_average_guess_of_a_wide_output_reads_rows_spread_over_it(contiguous: bool) -> None:
    """A language model's (B, T, V) logits over 40,000 tokens: 65,536 values hold one row and a half, and one row is
    its own average. 64 rows are read, across the batch's sequences where the tensors are contiguous (the first
    rows, of the first sequences, otherwise); rows that predict their own labels pay far less than their average,
    rows that give one answer for all exactly as much."""
    torch.manual_seed(0)
    labels = torch.randint(0, 40_000, (8, 16))
    fitted = 12.0 * F.one_hot(labels, 40_000).float()
    for logits, same in ((fitted, False), (torch.randn(40_000).expand(8, 16, 40_000).contiguous(), True)):
        logits = logits.requires_grad_() if contiguous else logits.transpose(0, 1).requires_grad_()
        target = labels if contiguous else labels.T
        grad = torch.autograd.grad(F.cross_entropy(logits.flatten(0, 1), target.flatten()), logits)[0]
        rows, own, average = average_guess(grad, logits).tolist()
        assert rows == 64
        assert own == pytest.approx(average, rel=1e-5) if same else own < 0.1 * average
