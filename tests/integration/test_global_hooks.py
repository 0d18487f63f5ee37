"""The process-wide module registration hooks the gradient pass installs are removed when a run ends: at fit end,
after an exception, after an Accelerate loop's ``finish``; a second fit installs them again and still works."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.modules.module as torch_module

from lightning_debug import DebugConfig
from lightning_debug.core.numerics import index as registrations
from tests.harness.toolkit import TinyRegressor, all_four, debug_dir, fit_seeded, read_events, read_scalars

LOUD = ("warning", "error", "critical")


def ours() -> list[Any]:
    """Our hooks among torch's global registration hooks (torch's dicts: private names, pinned by this test)."""
    hooks = [*torch_module._global_parameter_registration_hooks.values(),
             *torch_module._global_module_registration_hooks.values()]
    return [hook for hook in hooks if getattr(hook, "__module__", "") == registrations.__name__]


class SeesHooks(pl.Callback):
    """Records whether our hooks are installed while the fit trains."""

    def __init__(self) -> None:
        self.during: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.during.append(len(ours()))


class GrowsALayer(TinyRegressor):
    """Adds a layer to the model and the optimizer at one step: a registration the hooks must see during the fit."""

    def __init__(self, grow_at: int) -> None:
        super().__init__()
        self.grow_at = grow_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        extra = getattr(self, "extra", None)
        return output if extra is None else output + extra(x).mean(dim=1, keepdim=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.grow_at and getattr(self, "extra", None) is None:
            self.extra = torch.nn.Linear(8, 4)
            self.trainer.optimizers[0].add_param_group({"params": list(self.extra.parameters())})


class FailsAt(TinyRegressor):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.fail_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.fail_step:
            raise RuntimeError("the user's bug")
        return super().training_step(batch, batch_idx)


def config(**overrides: Any) -> DebugConfig:
    return DebugConfig(gradient_checking_frequency=2, memory_profiling_frequency=5, **overrides)


@pytest.fixture(autouse=True)
def no_run_before() -> None:
    gc.collect()  # a run an earlier test left unfinished lets its hold go when collected
    assert ours() == [], "an earlier run still holds the hooks"


def test_no_hook_remains_after_a_fit_and_a_second_fit_works(tmp_path: Path) -> None:
    first = SeesHooks()
    fit_seeded(tmp_path / "first", TinyRegressor(), [*all_four(config()), first], max_steps=8)
    assert first.during and all(count == 2 for count in first.during)  # installed while it trains
    assert ours() == [] and not registrations.installed()

    second = SeesHooks()
    trainer = fit_seeded(tmp_path / "second", GrowsALayer(grow_at=4), [*all_four(config(log_gradients=True)), second],
                         max_steps=10)
    assert second.during and all(count == 2 for count in second.during)
    assert ours() == []
    events = read_events(debug_dir(trainer))
    assert not [e for e in events if e["severity"] in LOUD], events
    grown = read_scalars(trainer.logger.log_dir)["debug/grad/norm/extra.weight"]
    assert [step for step, _ in grown] == [4, 6, 8]  # the layer added at step 4 is checked from then on


def test_no_hook_remains_after_the_users_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the user's bug"):
        fit_seeded(tmp_path, FailsAt(step=3), all_four(config()), max_steps=8)
    assert ours() == [] and not registrations.installed()


def test_no_hook_remains_after_an_accelerate_loop(tmp_path: Path) -> None:
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    debugger = AccelerateDebugger(accelerator, model, optimizer, config())
    for _ in range(3):
        debugger.backward(model(torch.randn(8, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    assert len(ours()) == 2
    debugger.finish()
    assert ours() == []
