"""TensorBoard opens on the user's loss: no card of zeros per counter in a healthy run (issue 44).

Read back with TensorBoard's EventAccumulator from a real TensorBoardLogger. A counter (``debug/anomaly/count``,
``debug/grad/*_count``, an activation's ``nonfinite_count`` or ``zero_fraction``) is first written once it is not 0, so a healthy
run has none, and a run with a planted fault has its counter from the first step it counted something.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_debug import DebugConfig, debug_callbacks
from lightning_debug.callbacks.base import RUN_ATTRIBUTE
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_scalars

pytestmark = pytest.mark.timeout(240)


class LossLogger(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def fit(root: Path, model: TinyRegressor, **config: Any) -> Any:
    torch.manual_seed(0)
    callbacks = debug_callbacks(DebugConfig(print_summary=False, save_plots=False, **config))
    trainer = make_trainer(root, callbacks, max_steps=30, log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return trainer


def test_a_healthy_run_writes_no_counter_of_zeros(tmp_path: Path) -> None:
    trainer = fit(tmp_path, LossLogger(), log_activations=True, level="advanced")
    scalars = read_scalars(trainer.logger.log_dir)
    assert "train_loss" in scalars
    zeros = sorted(tag for tag, points in scalars.items() if tag.startswith("debug/") and not any(v for _, v in points))
    assert zeros == [], "a card that stays at 0 all run"
    assert any(tag.endswith("/max_abs") for tag in scalars), "the activation scalars are written"
    assert not any(tag.endswith(("count", "_fraction")) for tag in scalars)
    run = getattr(trainer, RUN_ATTRIBUTE)
    assert not [kind for kind, entry in run.session.timeline.findings().items()
                if entry.get("severity") in ("warning", "error", "critical")], "a healthy run is quiet"


def test_a_counter_appears_from_the_first_step_it_counts(tmp_path: Path) -> None:
    trainer = fit(tmp_path, LossLogger(log_zero_from_step=12))
    counts = read_scalars(trainer.logger.log_dir)["debug/anomaly/count"]
    assert min(e["step"] for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss") == 12
    assert counts[0] == (14, pytest.approx(3.0)), "on the first row after the first NaN step (12, 13, 14)"
    assert [step for step, _ in counts] == [14, 19, 24, 29], "on every row from then on"
