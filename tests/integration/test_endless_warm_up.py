"""A warm-up the run cannot finish: ``LambdaLR(lambda s: min(1, s / warm_up))`` with a length of a million steps
where a thousand were meant (samples or epochs for steps, a total computed wrongly). The learning rate stays near 0
for the whole run, under the 10% of its base that exempts a warm-up's start from ``negligible_updates``; the loss
stays where it started and the run ended in "No problems found". Its twin warms up over 2,000 steps of a 400-step run
(20% of its base at the end) and learns. Real Trainer runs; the events are read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import Blobs, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(180)


class WarmedUp(Blobs):
    """Four Gaussian blobs under SGD 0.05 in batches of 256 (a loss that wanders little), warmed up over ``warm_up``
    steps."""

    def __init__(self, warm_up: float) -> None:
        super().__init__(hidden=1, batch=256)
        self.warm_up = warm_up

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warm_up))
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def warnings_of(tmp_path: Path, warm_up: float) -> list[dict[str, Any]]:
    trainer = fit_seeded(tmp_path, WarmedUp(warm_up), [GradientHealthCallback(DebugConfig(
        save_plots=False, print_summary=False))], 400, log_every_n_steps=50)
    return [e for e in read_events(debug_dir(trainer)) if e.get("severity") in ("warning", "error", "critical")]


def test_a_warm_up_of_a_million_steps_in_a_run_of_400_is_named_and_one_of_2000_is_not(tmp_path: Path) -> None:
    [stalled] = warnings_of(tmp_path / "bug", 1e6)
    assert (stalled["kind"], stalled["details"]["since_step"], stalled["details"]["cause"]) == (
        "learning_stalled", 100, "negligible_updates")
    assert stalled["details"]["warm_up_reaches"] == pytest.approx(4e-4, rel=0.05)
    assert "warm-up is far longer than the run" in stalled["message"]
    assert warnings_of(tmp_path / "twin", 2000) == []
