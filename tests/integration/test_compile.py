"""A ``torch.compile``d module under every check, including the ADVANCED replay: the cause is named
with the user's names, and the plugin causes no graph break and no recompilation.

The ``aot_eager`` backend runs Dynamo and AOTAutograd as inductor does (the graph breaks, guards and
recompilations are Dynamo's) without inductor's minute-long cold C++ compilation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import console_lines, debug_dir, make_trainer, read_events, read_report, read_scalars, regression_data

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="needs torch >= 2.6")]
NAN_STEP = 5
TIMING_KINDS = {"slow_step", "dataloader_bottleneck"}  # timing on a shared machine; not what is tested here


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(torch.relu(self.inp(x)))
        h = torch.log(torch.relu(h) + 1 + self.shift)  # NaN once shift < -1
        return self.head(h)


class CompiledInside(pl.LightningModule):
    """``torch.compile(model)`` inside the LightningModule, as Lightning's docs show it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.compile(Net(), backend="aot_eager")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.model.shift.fill_(-10.0 if self.trainer.global_step == NAN_STEP else 0.0)
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16)


@pytest.fixture
def dynamo_record() -> Iterator[dict[str, Any]]:
    """Dynamo's counters and its warnings, from a clean cache."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield {"counters": counters, "records": records}
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()


def test_compiled_module_with_every_check_and_the_replay(tmp_path: Path, dynamo_record: dict[str, Any]) -> None:
    config = DebugConfig(anomaly_detection_mode="skip", level="advanced", anomaly_check_frequency=1,
                         gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1, log_gradients=True, log_weights=True)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=10)
    model = CompiledInside()
    with console_lines() as caught:
        trainer.fit(model)
    counters = dynamo_record["counters"]
    assert not counters["graph_break"] and not dynamo_record["records"], "no graph break, no Dynamo warning"
    assert counters["stats"]["unique_graphs"] == 1, "no recompilation: the plugin's hooks never reach Dynamo"
    assert not [line for line in caught if " failed" in line]

    events = read_events(debug_dir(trainer))
    kinds = {e["kind"] for e in events if e.get("episode") == "start"} - TIMING_KINDS
    assert kinds == {"nonfinite_activation", "nonfinite_loss", "nonfinite_grad"}
    activation = next(e for e in events if e["kind"] == "nonfinite_activation")
    assert activation["step"] == NAN_STEP
    cause = activation["details"]
    assert cause["operation"] == "torch.log" and cause["module"] == "model" and cause["module_type"] == "Net"
    assert cause["source"]["file"] == __file__ and "torch.log" in cause["source"]["code"]
    assert cause["replay_ms"] < 2000, "replayed eagerly, not recompiled"
    grads = next(e for e in events if e["kind"] == "nonfinite_grad")["details"]["parameters"]
    assert "model.inp.weight" in grads and not [name for name in grads if "_orig_mod" in name]

    report = read_report(debug_dir(trainer))
    assert report["failed_checks"] == {} and report["sections"]["anomaly"]["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    scalars = read_scalars(trainer.logger.log_dir)
    assert "debug/grad/norm/model.hidden.weight" in scalars and "debug/weight/update_ratio/model.head.bias" in scalars
    assert not [tag for tag in scalars if "_orig_mod" in tag]
