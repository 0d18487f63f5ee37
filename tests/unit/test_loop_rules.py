"""The training loop's silent killers (eval mode left on, gradients never zeroed), fed tiny modules and
recorded gradient norms, then a hand-written loop through a minimal context: no Trainer, milliseconds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig
from lightning_debug.core.context import RunContext
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.loop import (
    NAMES_IN_DETAILS,
    NAMES_SHOWN,
    LoopMonitor,
    Window,
    eval_mode_finding,
    grad_not_zeroed_finding,
    held_gradients,
    modules_left_in_eval,
    stale_gradients,
)
from lightning_debug.run import Run

# --- eval mode ------------------------------------------------------------------------------------


def test_a_trained_block_in_eval_mode_is_named_with_the_layers_it_changes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout()))
    model[1].eval()
    assert modules_left_in_eval(model) == [("1", ["1.1", "1.2"])]


def test_a_healthy_model_in_train_mode_has_nothing_left_in_eval() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout())
    assert modules_left_in_eval(model.train()) == []
    assert modules_left_in_eval(model.eval()) == []  # the whole model evaluates: no training to harm


def test_modules_whose_mode_changes_nothing_are_not_named() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.InstanceNorm1d(2))
    model[1].eval()
    model[2].eval()  # no running statistics: eval and train compute the same
    assert modules_left_in_eval(model) == []
    tracked = nn.Sequential(nn.Linear(2, 2), nn.InstanceNorm1d(2, track_running_stats=True))
    tracked[1].eval()
    assert modules_left_in_eval(tracked) == [("1", ["1"])]


def test_a_frozen_backbone_in_eval_mode_is_left_alone() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), nn.Linear(2, 1))
    model[0].eval().requires_grad_(False)
    assert modules_left_in_eval(model) == []


def test_a_parameterless_dropout_in_eval_mode_counts_when_its_parent_trains() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    model[1].eval()
    assert modules_left_in_eval(model) == [("1", ["1"])]
    model[0].requires_grad_(False)  # nothing trains
    assert modules_left_in_eval(model) == []


def test_eval_mode_finding_bounds_the_layers_it_names() -> None:
    affected = [f"block.drop{i}" for i in range(NAMES_IN_DETAILS + 3)]
    finding = eval_mode_finding(2, "block", affected)
    assert finding.kind is Kind.EVAL_MODE_IN_TRAINING and finding.severity is Severity.WARNING
    assert f"and {len(affected) - NAMES_SHOWN} more" in finding.message and "`block`" in finding.message
    assert finding.details == {"modules": ["block"], "affected": affected[:NAMES_IN_DETAILS], "count": len(affected)}
    assert eval_mode_finding(0, "", ["drop"]).message.startswith("The whole model is in eval mode")


# --- gradients never zeroed -----------------------------------------------------------------------


def _parameter(grad: float | None) -> nn.Parameter:
    parameter = nn.Parameter(torch.zeros(2))
    if grad is not None:
        parameter.grad = torch.full((2,), grad)
    return parameter


def test_held_gradients_skip_this_steps_own_and_unstepped_parameters() -> None:
    old, cleared, again, unstepped = _parameter(1.0), _parameter(None), _parameter(1.0), _parameter(1.0)
    named = [("old", old), ("cleared", cleared), ("again", again), ("unstepped", unstepped)]
    held, empty = held_gradients(named, stepped={id(old), id(cleared), id(again)}, fresh={id(again)})
    assert [name for name, _ in held] == ["old"] and empty == {id(cleared)}


def test_held_gradients_without_optimizer_groups_look_at_every_parameter() -> None:
    held, empty = held_gradients([("a", _parameter(1.0)), ("b", _parameter(1.0))], stepped=set(), fresh=set())
    assert [name for name, _ in held] == ["a", "b"] and empty == set()


def test_zeroed_but_not_cleared_gradients_are_not_stale() -> None:
    assert stale_gradients(["zeros", "old", "nan"], [0.0, 0.3, float("nan")]) == ["old"]


def test_window_judges_only_the_optimizer_that_steps_next() -> None:
    window = Window(3, {}, ["g", "d"], [1, 2], torch.tensor([1.0, 1.0]), touched={0, 1})
    assert window.judged() == [0, 1]
    window.owned = {2}
    assert window.judged() == [1]


def test_grad_not_zeroed_finding_names_a_bounded_list() -> None:
    stale = [f"p{i}" for i in range(NAMES_IN_DETAILS + 2)]
    finding = grad_not_zeroed_finding(5, stale, len(stale) + 1)
    assert finding.kind is Kind.GRAD_NOT_ZEROED and finding.severity is Severity.ERROR
    assert f"{len(stale)} of {len(stale) + 1} parameters" in finding.message
    assert finding.details == {"parameters": stale[:NAMES_IN_DETAILS], "count": len(stale)}


# --- the monitor in a hand-written loop -----------------------------------------------------------


class Loop(RunContext):
    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.model, self._optimizers = model, optimizers

    def module(self) -> nn.Module:
        return self.model

    def optimizers(self) -> list[Any]:
        return list(self._optimizers)

    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self._optimizers for group in optimizer.param_groups]


def train(model: nn.Module, *, steps: int = 4, zero_grad: bool = True, accumulation: int = 1,
          backwards: int = 1, frequency: int = 1) -> tuple[dict[str, Any], LoopMonitor]:
    """A plain loop of ``steps`` optimizer steps with the loop monitor; returns the report's findings."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = DebugConfig(gradient_checking_frequency=frequency, save_debug_info=False, print_summary=False,
                         save_plots=False)
    monitor = LoopMonitor(config, "test")
    run = Run(config, Loop(model, [optimizer]), [monitor])
    run.start(0)
    done = 0
    for step in range(steps):
        for _ in range(accumulation):
            run.batch_start(step, None)
            for _ in range(backwards):
                loss = model(torch.randn(4, 3)).pow(2).mean()
                run.before_backward(step, loss)
                loss.backward()
            run.batch_end()
            run.after_optimizer_step(done)
        run.before_optimizer_step(step, optimizer)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        done += 1
        run.after_optimizer_step(done)
    report = run.finish("finished", steps)
    assert report is not None
    return report["findings"], monitor


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_loop_without_zero_grad_is_named_once_per_episode() -> None:
    findings, monitor = train(mlp(), zero_grad=False)
    assert findings["grad_not_zeroed"]["episodes"] == 1 and findings["grad_not_zeroed"]["first_step"] == 1
    assert set(monitor.accumulating) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize("loop", [dict(), dict(accumulation=3), dict(backwards=2)],
                         ids=["healthy", "accumulation", "two-backwards"])
def test_healthy_loops_are_not_flagged(loop: dict[str, int]) -> None:
    findings, _ = train(mlp(), **loop)
    assert findings == {}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_module_left_in_eval_mode_is_named_at_the_start() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(), nn.Linear(4, 1))
    model[1].eval()
    findings, monitor = train(model, steps=2)
    assert findings["eval_mode_in_training"]["first_step"] == 0 and monitor.eval_modules == {"1": ["1"]}
    assert monitor.report_section()["mode_checks"] >= 1


# --- repeated batches (issue 45: data-loader workers sharing one random seed) ------------------------------------
def _window(batches: list[torch.Tensor], epochs: list[int] | None = None, opened_at: int = 0) -> Any:
    from lightning_debug.monitors.repeats import BatchWindow

    window = BatchWindow()
    for index, batch in enumerate(batches):
        window.add(opened_at + index, index == 0, (epochs or [0] * len(batches))[index], (batch, torch.arange(4)))
    return window.take()


def test_workers_sharing_a_seed_repeat_batches_and_two_windows_in_a_row_name_it() -> None:
    from lightning_debug.core.verdicts import VerdictEngine
    from lightning_debug.monitors.repeats import WINDOW, judge_repeats

    g = torch.Generator().manual_seed(0)
    draws = [torch.randn(32, 16, generator=g) for _ in range(WINDOW // 2)]
    pairs = [draw for draw in draws for _ in range(2)]  # two workers, one generator: every batch twice in a row
    step, repeats, judged, _ = _window(pairs)
    assert (step, repeats, judged) == (0, WINDOW // 2, WINDOW)
    engine = VerdictEngine()
    assert judge_repeats(0, repeats, judged, engine) is None  # one window is held
    finding = judge_repeats(100, repeats, judged, engine)
    assert finding is not None and finding.kind is Kind.REPEATED_BATCH and finding.severity is Severity.WARNING
    assert finding.details["repeats"] == WINDOW // 2 and finding.details["since_step"] == 0


def test_binary_images_with_a_blank_border_are_told_apart() -> None:
    """Binarized images with a constant border (8x8, a 4x4 centre of +-1 on -1): the spread values all fall on the
    border, and the sum takes few values; 400 different batches of 64 give 400 fingerprints (the sum and the spread
    values alone gave 72)."""
    from lightning_debug.monitors.repeats import batch_fingerprint

    g = torch.Generator().manual_seed(0)
    prints = set()
    for _ in range(400):
        images = -torch.ones(64, 8, 8)
        images[:, 2:6, 2:6] = (torch.rand(64, 4, 4, generator=g) > 0.5).float() * 2 - 1
        fingerprint = batch_fingerprint((images,))
        assert fingerprint is not None
        prints.add(tuple(fingerprint.tolist()))
    assert len(prints) == 400


def test_what_a_repeated_batch_is_not() -> None:
    """The twins: the same batch in another epoch (an unshuffled loader, a full-batch run), one chance repeat,
    and batches too small to judge."""
    from lightning_debug.core.verdicts import VerdictEngine
    from lightning_debug.monitors.repeats import WINDOW, BatchWindow, judge_repeats

    same = torch.ones(32, 16)
    assert _window([same] * WINDOW, epochs=list(range(WINDOW)))[1] == 0  # full batch: one batch per epoch
    g = torch.Generator().manual_seed(1)
    fresh = [torch.randn(32, 16, generator=g) for _ in range(WINDOW)]
    assert _window(fresh)[1] == 0
    once = fresh[:-1] + fresh[:1]  # one chance repeat
    engine = VerdictEngine()
    assert all(judge_repeats(step, _window(once)[1], WINDOW, engine) is None for step in (0, 100, 200))
    tiny = BatchWindow()  # labels only: two different batches can agree by chance
    for index in range(WINDOW):
        tiny.add(index, index == 0, 0, torch.tensor([1, 0]))
    assert tiny.take(final=True) is None and not tiny.collecting
