"""Weights kept in bfloat16 (Lightning's ``precision="bf16-true"``) under a learning rate whose updates are smaller
than half the spacing of bfloat16 values next to each weight: every such update is rounded away. SGD at 1e-3 on four
blobs left 98% of the sampled weights bit for bit the same over each 100 steps and the loss at chance (1.39 to 1.38
in 400 steps), which only ``loss_at_chance`` named, with the advice to check the labels. ``negligible_updates`` now
names the rounding first: the weights' dtype and the share unchanged. Its twins stay quiet: the same bfloat16 weights
at a learning rate of 0.05, which learn, and float32 weights at 1e-3, which keep every update. Real Trainer runs; the
events are read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import Blobs, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(180)


class SgdBlobs(Blobs):
    """Four Gaussian blobs classified by an MLP of two hidden layers under plain SGD at ``lr``."""

    def __init__(self, lr: float) -> None:
        super().__init__(hidden=2)
        self.lr = lr

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def warnings_of(tmp_path: Path, lr: float, precision: str) -> list[dict[str, Any]]:
    trainer = fit_seeded(tmp_path, SgdBlobs(lr), [GradientHealthCallback(DebugConfig(
        save_plots=False, print_summary=False))], 400, log_every_n_steps=50, precision=precision)
    return [e for e in read_events(debug_dir(trainer))
            if e.get("severity") in ("warning", "error", "critical") and e.get("episode") != "end"]


def test_updates_rounded_away_by_bfloat16_weights_are_named_and_the_twins_are_quiet(tmp_path: Path) -> None:
    found = warnings_of(tmp_path / "bug", 1e-3, "bf16-true")
    rounded = [e for e in found if e["details"].get("cause") == "negligible_updates"]
    assert [(e["kind"], e["step"], e["details"]["dtype"]) for e in rounded] == [("learning_stalled", 300, "bfloat16")]
    assert rounded[0]["details"]["unchanged"] >= 0.9
    assert "rounded away" in rounded[0]["message"] and "bf16-mixed" in rounded[0]["message"]
    assert found[0] is rounded[0], "the rounding is named before what follows from it"
    assert warnings_of(tmp_path / "learns", 0.05, "bf16-true") == []
    assert warnings_of(tmp_path / "float32", 1e-3, "32-true") == []
