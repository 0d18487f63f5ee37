"""The shared gradient pass is built once per model: what makes it rebuild, and what it measures."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig, GradientHealthCallback
from lightning_debug.core.numerics import REQUIRES_GRAD_RECHECK, NumericsQueue, ParameterIndex
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_scalars

pytestmark = pytest.mark.timeout(120)


def test_the_index_is_reused_until_a_parameter_or_module_is_registered() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    queue = NumericsQueue()
    first = queue.index(model.named_parameters)
    assert queue.index(model.named_parameters) is first
    model.append(nn.Linear(1, 1))
    rebuilt = queue.index(model.named_parameters)
    assert rebuilt is not first and rebuilt.names[-2:] == ["2.weight", "2.bias"]
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    assert queue.index(model.named_parameters) is not rebuilt


def test_an_optimizers_parameters_have_their_own_index_in_its_order() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    queue = NumericsQueue()
    optimizer = torch.optim.SGD([model[1].bias, model[0].weight], lr=0.1)
    index = queue.index(model.named_parameters, optimizer)
    assert index.names == ["1.bias", "0.weight"] and queue.index(model.named_parameters, optimizer) is index
    assert queue.index(model.named_parameters) is not index
    optimizer.add_param_group({"params": [model[1].weight]})
    grown = queue.index(model.named_parameters, optimizer)
    assert grown is not index and grown.names == ["1.bias", "0.weight", "1.weight"]


def test_plain_shards_count_on_every_rank_and_keep_empty_slots() -> None:
    named = [("a", nn.Parameter(torch.ones(3))), ("b", nn.Parameter(torch.zeros(0)))]
    replicated, sharded = ParameterIndex(named, rank=1), ParameterIndex(named, rank=1, plain_sharded=True)
    assert replicated.names == ["a"] and replicated.param_owner.mask.tolist() == [False]
    assert sharded.names == ["a", "b"] and sharded.param_owner.mask.tolist() == [True, True]


class FreezesThenUnfreezes(TinyRegressor):
    """Freezes the input layer at step 4 (its gradients stop) and trains it again from step 8."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if step in (4, 8):
            self.inp.requires_grad_(step == 8)
        return super().training_step(batch, batch_idx)


def test_freezing_and_unfreezing_mid_run_is_followed_without_a_false_alarm(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [GradientHealthCallback(DebugConfig(gradient_checking_frequency=1,
                                                                         log_gradients=True))],
                           max_steps=8 + REQUIRES_GRAD_RECHECK + 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(FreezesThenUnfreezes())
    assert not [e for e in read_events(debug_dir(trainer)) if e["kind"] == "missing_grad"]
    steps = [step for step, _ in read_scalars(trainer.logger.log_dir)["debug/grad/norm/inp.weight"]]
    assert steps[:4] == [0, 1, 2, 3] and not [s for s in steps if 4 <= s < 8]
    assert steps[-1] == trainer.global_step - 1, "measured again once the change is seen"
    assert steps[4] <= 8 + REQUIRES_GRAD_RECHECK


@pytest.mark.parametrize("with_param_norms", [False, True])
def test_the_host_values_match_torch_with_a_missing_and_a_nan_gradient(with_param_norms: bool) -> None:
    from lightning_debug.core.numerics import StepNumerics

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    model[1](model[0](torch.ones(5, 3))).sum().backward()  # the last layer gets no gradient
    host = StepNumerics(0, ParameterIndex(list(model.named_parameters())), with_param_norms=with_param_norms).read()
    present = [p.grad.norm().item() for p in model.parameters() if p.grad is not None]
    assert host.missing == ["2.weight", "2.bias"] and host.grad_names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert host.grad_norms == pytest.approx(present) and host.grads_finite
    assert host.grad_norm_extremes() == pytest.approx((max(present), min(present)))
    assert host.params_measured is with_param_norms
    if with_param_norms:
        assert host.param_norms == pytest.approx([p.norm().item() for p in model.parameters()])
    model[0].bias.grad[1] = float("nan")
    broken = StepNumerics(1, ParameterIndex(list(model.named_parameters())), with_param_norms=with_param_norms).read()
    largest, smallest = broken.grad_norm_extremes()
    assert largest != largest and smallest != smallest and not broken.grads_finite
    assert [name for name, _ in broken.nonfinite_grads()] == ["0.bias"]


def test_a_missing_gradient_costs_no_memory_and_measures_zero_in_every_block_of_the_plan() -> None:
    """MoE experts without tokens miss their gradient on most steps: the zeros that stand for it are kept per
    slot, take no memory of the slot's size (0-d, expanded where a joined block needs the shape), and measure 0
    whether the slot is a row, a segment or fused."""
    model = nn.ModuleList([nn.LayerNorm(8) for _ in range(12)]                   # same shapes: rows of a matrix
                          + [nn.Linear(3 + i, 2, bias=False) for i in range(24)]  # small, shapes differ: segments
                          + [nn.Linear(128, 64)])                                # large: the fused norm
    used = [m for i, m in enumerate(model) if i % 3]
    x = torch.randn(2, 8)
    loss = sum(m(x).sum() for m in used[:8]) + sum(m(torch.randn(2, m.in_features)).sum() for m in used[8:24])
    loss.backward()
    index = ParameterIndex(list(model.named_parameters()))
    assert index.plan._rows and index.plan._segments and index.plan._foreach, "every kind of block is measured"
    grads, missing = index.local_grads()
    again, _ = index.local_grads()
    assert missing and all(grads[i] is again[i] for i in missing), "kept, not allocated each step"
    assert all(grads[i].untyped_storage().nbytes() <= grads[i].element_size() for i in missing)
    joined = [i for i in missing if i in index.plan.joined]
    assert joined and [grads[i].shape for i in joined] == [index.params[i].shape for i in joined]
    assert all(grads[i].dim() == 0 for i in missing if i not in joined), "the fused norm takes any shape"
    expected = [0.0 if p.grad is None else p.grad.double().square().sum().item() for p in index.params]
    assert index.plan.squares(grads).tolist() == pytest.approx(expected) and index.plan.fused


def test_a_steps_measurements_are_freed_without_the_garbage_collector(tmp_path: Path) -> None:
    """Loops that disable the cyclic garbage collector (``gc.disable()``, ``gc.freeze()`` against its pauses) free only
    what reference counting frees: a step's measurement must hold no reference cycle, or every step's would stay."""
    import gc

    import lightning.pytorch as pl

    from lightning_debug import AnomalyDetectionCallback, MemoryProfilerCallback, PerformanceProfilerCallback
    from lightning_debug.core.numerics import StepNumerics
    from lightning_debug.core.numerics import HostNumerics

    live: dict[int, int] = {}

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step in (20, 60):
                live[trainer.global_step] = sum(isinstance(o, (StepNumerics, HostNumerics)) for o in gc.get_objects())

    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1)
    callbacks = [AnomalyDetectionCallback(config), GradientHealthCallback(config), MemoryProfilerCallback(config),
                 PerformanceProfilerCallback(config), Count()]
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_trainer(tmp_path, callbacks, max_steps=61).fit(TinyRegressor())
    finally:
        gc.enable()
    assert live[60] <= live[20] + 2, live
