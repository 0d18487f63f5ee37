"""An Adam ``eps`` far above the gradients it is added to: ``Adam(lr=1e-3, eps=1)`` (another library's convention,
or a typo for 1e-8) divides every update by ``eps`` instead of the gradient's scale, so Adam becomes plain SGD at
``lr / eps``: the loss fell from 1.40 to 1.31 in 400 steps where the twin's reached 4e-4, and the run ended in "No
problems found". The optimizer's own state says why: the root of ``exp_avg_sq`` is under a tenth of ``eps`` for
every sampled weight. Its twins: the same ``eps=1`` with a learning rate that makes up for it (TensorFlow's Inception
recipe) learns, and the default ``eps``; both stay quiet. Real Trainer runs; the events are read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import Blobs, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(180)


class AdamBlobs(Blobs):
    """Four Gaussian blobs classified by an MLP of two hidden layers under ``Adam(lr, eps)``."""

    def __init__(self, lr: float, eps: float) -> None:
        super().__init__(hidden=2)
        self.lr, self.eps = lr, eps

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr, eps=self.eps)


def warnings_of(tmp_path: Path, lr: float, eps: float) -> list[dict[str, Any]]:
    trainer = fit_seeded(tmp_path, AdamBlobs(lr, eps), [GradientHealthCallback(DebugConfig(
        save_plots=False, print_summary=False))], 400, log_every_n_steps=50)
    return [e for e in read_events(debug_dir(trainer)) if e.get("severity") in ("warning", "error", "critical")]


def test_an_adam_eps_of_1_is_named_and_its_twins_are_quiet(tmp_path: Path) -> None:
    [stalled] = warnings_of(tmp_path / "bug", 1e-3, 1.0)
    assert (stalled["kind"], stalled["details"]["cause"], stalled["details"]["eps"]) == (
        "learning_stalled", "negligible_updates", 1.0)
    assert stalled["details"]["eps_bound"] > 0.9
    assert "Adam's eps (1)" in stalled["message"] and "lower it" in stalled["message"]
    assert warnings_of(tmp_path / "made_up_for", 0.5, 1.0) == []
    assert warnings_of(tmp_path / "default", 1e-3, 1e-8) == []
