"""Issue 45: probabilities fed to ``cross_entropy`` (a softmax applied twice) is ``learning_stalled``
(``probabilities_into_log_softmax``), judged from the model's output and the loss only; its healthy twins stay
quiet (``nll_loss(log(p))``, MSE against one-hot targets, an output that is not on the simplex)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_debug import DebugConfig
from lightning_debug.checks.output_gradient import scaled_cross_entropy, simplex_stats, softmax_twice
from lightning_debug.core.context import RunContext
from lightning_debug.core.kinds import Kind
from lightning_debug.core.verdicts import policy_of
from lightning_debug.monitors.activations import ActivationMonitor
from lightning_debug.monitors.gradients.probabilities import (JUDGED_EVERY, KEY, floor_of, probability_finding,
                                                              simplex_tolerance)
from lightning_debug.run import Run

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def confident(classes: int = 4, rows: int = 32, sharpness: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax rows of a model that predicts every target (logits ``sharpness`` apart), and the targets."""
    targets = torch.arange(rows) % classes
    return torch.softmax(sharpness * F.one_hot(targets, classes).float(), -1), targets


def judge(p: torch.Tensor, loss: torch.Tensor, step: int = 300, gradient: bool = False) -> tuple[Any, bool]:
    """The rule on ``p`` and ``loss``; ``gradient``: with the output gradient's readings too, as the monitor gives
    them on a judged step (``loss`` must then be in a graph from ``p``)."""
    grad = torch.autograd.grad(loss, p, retain_graph=True)[0] if gradient else None
    read = (softmax_twice(grad, p.detach()).tolist() + scaled_cross_entropy(grad, p.detach(), loss.detach()).tolist()
            if grad is not None else [])
    return probability_finding(step, step, "`out` (Softmax)", "out", list(p.shape), simplex_stats(p.detach()).tolist(),
                               float(loss.detach()), simplex_tolerance(p.dtype), read)


def with_graph(sharpness: float, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    p, y = confident(classes, sharpness=sharpness)
    return p.requires_grad_(), y


@pytest.mark.parametrize("sharpness", [1.0, 2.0, 20.0])
@pytest.mark.parametrize("smoothing", [0.1, 0.2, 0.3])
def test_cross_entropy_with_label_smoothing_on_probabilities_is_named_with_its_smoothing(smoothing: float,
                                                                                         sharpness: float) -> None:
    """``CrossEntropyLoss(label_smoothing=0.1)`` after an ``nn.Softmax``: the loss is not cross_entropy of the rows
    as logits (it is above by about the smoothing times (C - 1)/C), so the loss alone said nothing; read with the
    gradient's labels, it is that loss with ``label_smoothing`` = the smoothing, at any confidence."""
    p, y = with_graph(sharpness)
    loss = F.cross_entropy(p, y, label_smoothing=smoothing)
    assert judge(p, loss)[0] is None or sharpness == 20.0 and smoothing == 0.1
    finding, below = judge(p, loss, gradient=True)
    assert finding is not None and not below and finding.details["cause"] == KEY
    assert finding.details["label_smoothing"] == pytest.approx(smoothing, abs=1e-4)
    assert f"label_smoothing={smoothing:.2g}" in finding.message
    assert finding.details["floor"] == pytest.approx(floor_of(4) + smoothing * 3 / 4)


def test_half_confident_rows_with_the_gradient_of_cross_entropy_are_named() -> None:
    """Rows of maximum ~0.5 are not judged on the loss alone (nll_loss(log(p)) crosses it there); the gradient's form
    tells them apart, so cross_entropy on them is named, smoothing 0."""
    p, y = with_graph(1.0)
    loss = F.cross_entropy(p, y)
    assert judge(p, loss)[0] is None
    finding, _ = judge(p, loss, gradient=True)
    assert finding is not None and finding.details["label_smoothing"] == 0.0
    assert "label_smoothing" not in finding.message


def ignored(y: torch.Tensor) -> torch.Tensor:
    """Every fourth label set to ``ignore_index`` (padding)."""
    y = y.clone()
    y[::4] = -100
    return y


SCALED: dict[str, tuple[float, Loss]] = {
    "half": (0.5, lambda p, y: 0.5 * F.cross_entropy(p, y)),
    "quarter": (0.25, lambda p, y: F.cross_entropy(p, y) / 4),
    "sum": (32.0, lambda p, y: F.cross_entropy(p, y, reduction="sum")),
    "ignored_half": (0.5, lambda p, y: 0.5 * F.cross_entropy(p, ignored(y))),
    "smoothed_sum": (32.0, lambda p, y: F.cross_entropy(p, y, label_smoothing=0.2, reduction="sum")),
}


@pytest.mark.parametrize("sharpness", [1.0, 20.0])
@pytest.mark.parametrize("case", sorted(SCALED))
def test_cross_entropy_on_probabilities_scaled_by_hand_is_named_with_its_factor(case: str, sharpness: float) -> None:
    """``loss * 0.5``, ``loss / 4`` (accumulation written by hand) or ``reduction="sum"`` move the loss from the
    floor by their factor: under it, the loss alone cleared the run. The gradient reads the factor; padding
    (``ignore_index``) does not change it."""
    factor, loss_of = SCALED[case]
    p, y = with_graph(sharpness)
    loss = loss_of(p, y)
    finding, below = judge(p, loss, gradient=True)
    assert finding is not None and not below and finding.details["cause"] == KEY
    assert finding.details["loss_scale"] == pytest.approx(factor, rel=1e-3)
    assert f"{factor:.3g} times what cross_entropy gives" in finding.message
    smoothing = 0.2 if case == "smoothed_sum" else 0.0
    assert finding.details["floor"] == pytest.approx(factor * (floor_of(4) + smoothing * 3 / 4), rel=1e-3)
    if factor < 1:
        assert judge(p, loss) == (None, True)  # the loss alone: under the floor


@pytest.mark.parametrize("loss_of", [
    lambda p, y: 0.5 * F.nll_loss(torch.log(p), y),
    lambda p, y: F.mse_loss(p, F.one_hot(y, 4).float(), reduction="sum"),
    lambda p, y: 0.25 * F.mse_loss(p, F.one_hot(y, 4).float()),
    lambda p, y: 0.5 * F.binary_cross_entropy(p, F.one_hot(y, 4).float()),
], ids=["nll_of_log", "mse_sum", "mse_quarter", "bce_half"])
@pytest.mark.parametrize("sharpness", [0.5, 1.0, 20.0])
def test_losses_made_for_probabilities_scaled_by_hand_are_quiet(loss_of: Loss, sharpness: float) -> None:
    """The twins of the factor: ``mse_loss`` against one-hot targets has the form of the gradient (one value below 0
    per row, rows summing to 0) at any factor, but the loss that gradient predicts as cross-entropy is 2 times its
    loss or more."""
    p, y = with_graph(sharpness)
    assert judge(p, loss_of(p, y), gradient=True)[0] is None


@pytest.mark.parametrize("loss_of", [
    lambda p, y: F.nll_loss(torch.log(p), y),
    lambda p, y: F.mse_loss(p, F.one_hot(y, 4).float()),
    lambda p, y: F.binary_cross_entropy(p, F.one_hot(y, 4).float()),
    lambda p, y: F.kl_div(torch.log(p), 0.9 * F.one_hot(y, 4).float() + 0.025, reduction="batchmean"),
], ids=["nll_of_log", "mse_one_hot", "bce_one_hot", "kl_div_smoothed"])
@pytest.mark.parametrize("sharpness", [0.5, 1.0, 1.5, 20.0])
def test_losses_made_for_probabilities_are_quiet_read_with_their_gradient(loss_of: Loss, sharpness: float) -> None:
    """The twins of the reading above: on the same rows, the losses that take probabilities (``mse_loss`` against
    one-hot targets has the gradient's form too: its rows sum to 0; its loss is no smoothing's)."""
    p, y = with_graph(sharpness)
    assert judge(p, loss_of(p, y), gradient=True)[0] is None


def test_label_smoothing_on_logits_is_quiet() -> None:
    z, y = with_graph(20.0)
    logits = (20.0 * F.one_hot(y, 4).float() - 5.0).requires_grad_()
    assert judge(logits, F.cross_entropy(logits, y, label_smoothing=0.1), gradient=True) == (None, False)


def test_cross_entropy_on_probabilities_at_its_floor_is_named_with_its_cause() -> None:
    p, y = confident()
    loss = F.cross_entropy(p, y)
    assert loss.item() == pytest.approx(floor_of(4), abs=1e-4)
    finding, below = judge(p, loss)
    assert finding is not None and not below
    assert finding.kind is Kind.LEARNING_STALLED and finding.details["cause"] == KEY == "probabilities_into_log_softmax"
    assert finding.details["classes"] == 4 and finding.details["modules"] == ["out"]
    assert "nll_loss(torch.log(p))" in finding.message and "drop the softmax" in finding.message


def test_on_the_way_down_to_the_floor_the_loss_is_cross_entropy_of_the_rows_as_logits() -> None:
    p, y = confident(sharpness=2.0)  # part way: the loss ~0.98, above the floor
    loss = F.cross_entropy(p, y)
    assert floor_of(4) + 0.2 < loss.item() < floor_of(4) + 0.5 * (math.log(4) - floor_of(4))
    assert judge(p, loss)[0] is not None


@pytest.mark.parametrize("classes", [2, 10, 1000])
def test_the_floor_follows_the_number_of_classes(classes: int) -> None:
    p, y = confident(classes, rows=2 * classes)
    assert F.cross_entropy(p, y).item() == pytest.approx(floor_of(classes), abs=1e-3)
    assert judge(p, F.cross_entropy(p, y))[0] is not None


def test_a_loss_below_the_floor_proves_it_is_not_the_case() -> None:
    p, y = confident()
    loss = F.nll_loss(torch.log(p), y)  # the fixed program: the loss goes to 0
    assert judge(p, loss) == (None, True)


@pytest.mark.parametrize("loss_of", [
    lambda p, y: F.nll_loss(torch.log(p), y),
    lambda p, y: F.mse_loss(p, F.one_hot(y, 4).float()),
], ids=["nll_of_log", "mse_one_hot"])
@pytest.mark.parametrize("sharpness", [0.5, 1.5, 20.0])
def test_a_softmax_output_with_a_loss_that_takes_probabilities_is_quiet(loss_of: Loss, sharpness: float) -> None:
    p, y = confident(sharpness=sharpness)
    assert judge(p, loss_of(p, y))[0] is None


@pytest.mark.parametrize("sharpness", [0.05, 1.0])
def test_near_uniform_and_half_confident_rows_are_not_judged(sharpness: float) -> None:
    """At the start every loss reads log(C); rows of maximum ~0.5 are where nll_loss(log(p)) on a hard task (half
    its samples right) crosses cross-entropy of the rows as logits."""
    p, y = confident(sharpness=sharpness)
    assert judge(p, F.cross_entropy(p, y))[0] is None


def test_a_loss_under_cross_entropy_of_the_rows_is_not_it() -> None:
    """On probabilities cross_entropy is never under its value for rows all predicted right (logit_loss)."""
    p, y = confident(sharpness=2.0)
    loss = F.cross_entropy(p, y)
    assert judge(p, loss - 0.05)[0] is None and judge(p, loss - 0.001)[0] is not None


@pytest.mark.parametrize("output", ["logits", "sigmoid", "one_column"])
def test_an_output_not_on_the_simplex_is_not_judged(output: str) -> None:
    p, y = confident()
    z = {"logits": 20.0 * F.one_hot(y, 4).float() - 5.0,
         "sigmoid": torch.sigmoid(20.0 * F.one_hot(y, 4).float() - 5.0),  # each in [0, 1], rows sum to ~1.03
         "one_column": p[:, :1]}[output]
    assert judge(z, torch.tensor(floor_of(4))) == (None, False)


def test_a_bfloat16_softmax_is_on_the_simplex() -> None:
    p, y = confident(sharpness=2.0)
    low = p.to(torch.bfloat16)
    assert judge(low, F.cross_entropy(low.float(), y))[0] is not None


class Loop(RunContext):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def module(self) -> nn.Module:
        return self.model


def monitored(losses: list[Loss], classes: int = 4) -> tuple[ActivationMonitor, dict[str, Any] | None, list[bool]]:
    """A softmax model that predicts its targets, measured on each step (frequency 1) with ``losses[step]``."""
    model = nn.Sequential(nn.Linear(classes, classes), nn.Softmax(dim=-1))
    with torch.no_grad():
        model[0].weight.copy_(20.0 * torch.eye(classes))
        model[0].bias.zero_()
    config = DebugConfig(gradient_checking_frequency=1, log_activations=True, save_debug_info=False,
                         print_summary=False, save_plots=False)
    monitor = ActivationMonitor(config, "test")
    run = Run(config, Loop(model), [monitor])
    run.start(0)
    flagged = []
    y = torch.arange(32) % classes
    for step, loss_of in enumerate(losses):
        run.batch_start(step, None)
        run.before_backward(step, loss_of(model(F.one_hot(y, classes).float()), y))
        run.batch_end()
        run.after_optimizer_step(step + 1)
        monitor.poll(final=True)
        flagged.append(monitor.tally.kinds.get("learning_stalled", {}).get("episodes", 0) > 0)
    return monitor, run.finish("finished", len(losses)), flagged


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_monitor_judges_once_per_spacing_holds_it_by_the_kinds_policy_and_records_it_when_confirmed() -> None:
    held = policy_of(Kind.LEARNING_STALLED).needed(KEY)
    assert held == 2
    monitor, report, flagged = monitored([F.cross_entropy] * (JUDGED_EVERY + 1))  # measured every step
    assert flagged == [False] * JUDGED_EVERY + [True] and monitor.probabilities_judged == JUDGED_EVERY
    assert report is not None and report["findings"]["learning_stalled"]["first_step"] == JUDGED_EVERY


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_once_the_loss_went_below_the_floor_the_run_is_never_judged_again() -> None:
    nll: Loss = lambda p, y: F.nll_loss(torch.log(p), y)  # noqa: E731
    monitor, report, flagged = monitored([nll] + [F.cross_entropy] * (2 * JUDGED_EVERY))
    assert not any(flagged) and KEY in monitor.cleared
    assert report is not None and "learning_stalled" not in report["findings"]
    assert KEY in monitor.state_dict()["cleared"]


def test_simplex_stats_of_an_empty_or_non_contiguous_output() -> None:
    assert simplex_stats(torch.empty(0, 4)).isnan().all()
    p = torch.softmax(torch.randn(3, 4, 5), -1)
    strided = torch.softmax(torch.randn(4, 3, 5), -1).transpose(0, 1)
    assert not strided.is_contiguous()
    for output in (p, strided):
        low, high, error, _ = simplex_stats(output).tolist()
        assert 0 <= low <= high <= 1 and error < 1e-5


def suspect_steps(loss_of: Loss, separation: float, steps: int = 400, gradient: bool = False) -> list[int]:
    """Steps at which a softmax MLP on 4 Gaussian blobs (``separation`` apart), trained with Adam 1e-3, is suspect,
    judged on every step and never cleared (the rule's spacing and clearing left out); ``gradient``: read with the
    output's gradient too."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (4096,), generator=g)
    x = separation * torch.randn(4, 16, generator=g)[labels] + torch.randn(4096, 16, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4),
                          nn.Softmax(-1))
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    found = []
    for step in range(steps):
        xb, yb = x[step * 32 % 4096:][:32], labels[step * 32 % 4096:][:32]
        p = model(xb)
        loss = loss_of(p, yb)
        if judge(p, loss, step, gradient)[0] is not None:
            found.append(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return found


def test_nll_of_log_on_a_hard_task_is_rarely_suspect_where_cross_entropy_on_an_easy_one_is() -> None:
    """With about half its samples right, nll_loss(log(p)) crosses cross-entropy of the rows as logits again and
    again: rows judged up to 0.75 of the way from the floor to log(C), with a band of 0.1 on both sides, suspected
    it on 73 of these 400 steps; now at most 1%, never two steps in a row (the rule judges once per 100)."""
    nll = suspect_steps(lambda p, y: F.nll_loss(torch.log(p), y), separation=0.3)
    assert len(nll) <= 4 and not any(later - earlier == 1 for earlier, later in zip(nll, nll[1:])), nll
    assert len(suspect_steps(F.cross_entropy, separation=2.0, steps=200)) > 100


def test_read_with_the_gradient_nll_of_log_on_a_hard_task_is_never_suspect() -> None:
    """The twin of reading the loss at any confidence once the gradient has cross_entropy's form: the hard task's
    nll_loss(log(p)) never has it; cross_entropy with smoothing on the same hard task is suspect on every step once
    its rows are not all near uniform (where no loss tells)."""
    assert suspect_steps(lambda p, y: F.nll_loss(torch.log(p), y), separation=0.3, gradient=True) == []
    smoothed = suspect_steps(lambda p, y: F.cross_entropy(p, y, label_smoothing=0.1), separation=0.3, gradient=True)
    assert set(range(100, 400)) <= set(smoothed), smoothed


def test_a_loss_over_two_classes_on_batches_of_two_is_not_judged_a_softmax_over_the_batch() -> None:
    """With N < 2C a loss over the classes can have the gradient's form by chance (cross_entropy over 2 classes on 2
    rows always does when the labels differ), so the rule needs N >= 2C; from 4 rows on, it never has it."""
    from lightning_debug.checks.output_gradient import batch_softmax_fit
    from lightning_debug.monitors.gradients.batch_softmax import FIT, batch_softmax_finding

    z, y = torch.tensor([[0.3, -0.2], [-0.5, 0.4]], requires_grad=True), torch.tensor([0, 1])
    fit = batch_softmax_fit(torch.autograd.grad(F.cross_entropy(z, y), z)[0], z).item()
    assert fit >= FIT
    assert batch_softmax_finding(100, 0, "`head` (Linear)", "head", [2, 2], 0.6, fit) == (None, False)
    generator = torch.Generator().manual_seed(0)
    fits = []
    for _ in range(50):
        z = torch.randn(4, 2, generator=generator, requires_grad=True)
        y = torch.randint(0, 2, (4,), generator=generator)
        fits.append(batch_softmax_fit(torch.autograd.grad(F.cross_entropy(z, y), z)[0], z).item())
    assert max(f for f in fits if f == f) < FIT


def test_a_reading_of_the_output_gradient_that_fails_leaves_the_others() -> None:
    """The hook on the output's gradient writes each reading on its own: one that raises stays NaN (here the factor,
    given no loss it can read) and the form of ``cross_entropy`` is still read."""
    from lightning_debug.checks.output_gradient import SCALED_CROSS_ENTROPY, SOFTMAX_TWICE
    from lightning_debug.monitors.activations import OUTPUT_GRADIENT, _writes_gradient

    p, y = with_graph(1.0)
    into = torch.full((len(OUTPUT_GRADIENT),), math.nan)
    gradient = torch.autograd.grad(F.cross_entropy(p, y), p)[0]
    _writes_gradient(into, p.detach(), "not a loss")(gradient)  # type: ignore[arg-type]
    read = dict(zip(OUTPUT_GRADIENT, into.tolist()))
    assert read[SOFTMAX_TWICE[0]] == 1.0 and all(math.isnan(read[name]) for name in SCALED_CROSS_ENTROPY)
    _writes_gradient(into, p.detach(), F.cross_entropy(p, y).detach())(gradient)
    assert dict(zip(OUTPUT_GRADIENT, into.tolist()))[SCALED_CROSS_ENTROPY[0]] == 1.0


def test_values_in_0_1_that_no_affine_map_made_are_judged_on_the_gradient_alone() -> None:
    """``cross_entropy(torch.sigmoid(z), y)``: rows in [0, 1] that do not sum to 1, with ``cross_entropy``'s gradient,
    are named where no affine map made them. Their twins: the same values as logits an affine map made (a head whose
    outputs lie in [0, 1] on one batch), and the same values without the gradient's reading, are not judged."""
    from lightning_debug.checks.output_gradient import SCALED_CROSS_ENTROPY, SOFTMAX_TWICE

    z = torch.sigmoid(6 * torch.randn(32, 4, generator=torch.Generator().manual_seed(0)))
    y = z.argmax(1)
    loss = F.cross_entropy(z, y)
    p = z.clone().requires_grad_(True)
    gradient = torch.autograd.grad(F.cross_entropy(p, y), p)[0]
    read = [*softmax_twice(gradient, p.detach()).tolist(), *scaled_cross_entropy(gradient, p.detach(), loss).tolist()]
    assert len(read) == len(SOFTMAX_TWICE) + len(SCALED_CROSS_ENTROPY)
    values = simplex_stats(z).tolist()
    assert values[2] > 1e-3  # the rows do not sum to 1
    finding, cleared = probability_finding(200, 100, "`out`", "out", [32, 4], values, loss.item(), 1e-3, read,
                                           logits=False)
    assert finding is not None and not cleared and finding.details["summing_to_1"] is False
    assert finding.details["floor"] == pytest.approx(floor_of(4))
    assert probability_finding(200, 100, "`out`", "out", [32, 4], values, loss.item(), 1e-3, read) == (None, False)
    unread = [math.nan] * len(read)
    assert probability_finding(200, 100, "`out`", "out", [32, 4], values, loss.item(), 1e-3, unread,
                               logits=False) == (None, False)
