"""A run interrupted after a mid-run checkpoint and resumed from it reports what an uninterrupted run reports.

All four callbacks together, with bugs planted before, across and after the checkpoint: a layer run
under no_grad() (it runs and gets no gradient: missing_grad from step 0, confirmed at step 7), a
parameter in a param group with learning rate 0 (frozen_param from step 0), a non-finite loss from
step 8 on, and exploding gradients on steps 3-4 (an episode that ends before the checkpoint), 10-14
(one that spans it) and 18-19 (one that starts after it). The data are not shuffled and the
checkpoint falls on an epoch boundary, so the resumed run sees exactly the batches, weights and
momentum of the uninterrupted one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import (TinyRegressor, debug_dir, make_trainer, read_events, read_report, read_scalars,
                           regression_data)

STEPS = 24
CHECKPOINT_STEP = 12
CRASH_STEP = 15
EXPLODING_STEPS = {3, 4, 10, 11, 12, 13, 14, 18, 19}
NONFINITE_LOSS_FROM = 8
CONFIG = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=2,
                     performance_profiling_frequency=2, gradient_explosion_threshold=100.0, log_gradients=True,
                     log_weights=True, save_plots=False, print_summary=False)
# Findings computed from the model's numbers, identical in any two runs with the same seed and data.
# memory_growth / memory_high (process RSS, machine memory) and slow_step / dataloader_bottleneck
# (wall-clock times) are measurements of a process: a resumed run is a new process whose memory and
# timings differ from the uninterrupted one, so their verdicts are not compared (their counts are).
NUMERIC_KINDS = {"nonfinite_loss", "nonfinite_grad", "nonfinite_param", "exploding_grad", "vanishing_grad",
                 "missing_grad", "frozen_param"}
COUNT_SCALARS = ["debug/anomaly/count", "debug/grad/exploding_count", "debug/grad/vanishing_count",
                 "debug/grad/missing_count"]


class SimulatedCrash(RuntimeError):
    pass


class Planted(TinyRegressor):
    def __init__(self, crash_at_step: int | None = None) -> None:
        super().__init__(log_zero_from_step=NONFINITE_LOSS_FROM, unused_layer=True)
        self.crash_at_step = crash_at_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.unused is not None
        with torch.no_grad():
            cut_off = self.unused(torch.relu(self.inp(x)))
        return super().forward(x) + 0.0 * cut_off.mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at_step:
            raise SimulatedCrash(f"killed at step {self.crash_at_step}")
        loss = super().training_step(batch, batch_idx)
        return loss * 1e4 if self.trainer.global_step in EXPLODING_STEPS else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        moving = [p for name, p in self.named_parameters() if name != "head.bias"]
        return torch.optim.SGD([{"params": moving}, {"params": [self.head.bias], "lr": 0.0}], lr=self.lr,
                               momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # 12 batches per epoch, in order: the step-12 checkpoint is an epoch boundary
        return DataLoader(regression_data(samples=16 * CHECKPOINT_STEP), batch_size=16, shuffle=False)


def fit(root: Path, model: Planted, extra_callbacks: Sequence[pl.Callback] = (), **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(root, debug_callbacks(CONFIG) + list(extra_callbacks), max_steps=STEPS,
                           gradient_clip_val=1.0, enable_checkpointing=bool(extra_callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, **kwargs)
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pl.Trainer]:
    root = tmp_path_factory.mktemp("resume")
    pl.seed_everything(0, verbose=False)
    uninterrupted = fit(root / "uninterrupted", Planted())

    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=CHECKPOINT_STEP, save_top_k=-1)
    with pytest.raises(SimulatedCrash):
        fit(root / "interrupted", Planted(crash_at_step=CRASH_STEP), [saver])
    checkpoint = next((root / "checkpoints").glob(f"*step={CHECKPOINT_STEP}.ckpt"))

    resumed = fit(root / "resumed", Planted(), ckpt_path=str(checkpoint))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def numeric_findings(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    findings = read_report(debug_dir(trainer))["findings"]
    return {kind: {field: entry[field] for field in ("episodes", "steps", "first_step", "last_step", "severity")}
            for kind, entry in findings.items() if kind in NUMERIC_KINDS}


def test_the_runs_cover_the_same_steps(runs: dict[str, pl.Trainer]) -> None:
    assert runs["uninterrupted"].global_step == runs["resumed"].global_step == STEPS
    resumed_steps = [step for step, _ in read_scalars(runs["resumed"].logger.log_dir)["debug/loss_finite"]]
    assert resumed_steps == list(range(CHECKPOINT_STEP, STEPS)), "the resumed run starts at the checkpoint"


def test_findings_are_the_same_as_without_the_interruption(runs: dict[str, pl.Trainer]) -> None:
    resumed, uninterrupted = numeric_findings(runs["resumed"]), numeric_findings(runs["uninterrupted"])
    assert resumed == uninterrupted
    assert resumed["exploding_grad"] == {"episodes": 3, "steps": len(EXPLODING_STEPS), "first_step": 3,
                                         "last_step": 19, "severity": "warning"}
    assert resumed["nonfinite_loss"] == {"episodes": 1, "steps": STEPS - NONFINITE_LOSS_FROM,
                                         "first_step": NONFINITE_LOSS_FROM, "last_step": STEPS - 1,
                                         "severity": "error"}
    for kind in ("missing_grad", "frozen_param"):
        assert (resumed[kind]["episodes"], resumed[kind]["first_step"], resumed[kind]["last_step"]) == (1, 0, 23)


def test_count_scalars_at_the_last_step_continue_through_the_resume(runs: dict[str, pl.Trainer]) -> None:
    resumed = read_scalars(runs["resumed"].logger.log_dir)
    uninterrupted = read_scalars(runs["uninterrupted"].logger.log_dir)
    # a count is first written once it is not 0: one that never was has no points
    last = {tag: dict(resumed.get(tag, []) or [(STEPS - 1, 0)])[STEPS - 1] for tag in COUNT_SCALARS}
    assert last == {tag: dict(uninterrupted.get(tag, []) or [(STEPS - 1, 0)])[STEPS - 1] for tag in COUNT_SCALARS}
    assert "debug/grad/vanishing_count" not in resumed
    assert last == {"debug/anomaly/count": STEPS - NONFINITE_LOSS_FROM,
                    "debug/grad/exploding_count": len(EXPLODING_STEPS), "debug/grad/vanishing_count": 0,
                    "debug/grad/missing_count": STEPS}


def test_episodes_open_at_the_checkpoint_are_continued_not_restarted(runs: dict[str, pl.Trainer]) -> None:
    def episodes(trainer: pl.Trainer, kind: str) -> list[tuple[Any, ...]]:
        events = [e for e in read_events(debug_dir(trainer)) if e["kind"] in NUMERIC_KINDS and e.get("episode") == kind]
        return sorted((e["kind"], e["details"].get("key", ""), e["step"], e["details"].get("first_step"),
                       e["details"].get("last_step"), e["details"].get("steps")) for e in events)

    # what the resumed run writes is exactly the uninterrupted run's events from the checkpoint on
    assert episodes(runs["resumed"], "start") == [e for e in episodes(runs["uninterrupted"], "start")
                                                  if e[2] >= CHECKPOINT_STEP]
    assert episodes(runs["resumed"], "start") == [("exploding_grad", "", 18, None, None, None)]
    ends = episodes(runs["resumed"], "end")
    assert ends == [e for e in episodes(runs["uninterrupted"], "end") if e[4] >= CHECKPOINT_STEP]
    # written after episode_grace (3) check steps without the finding: steps 15, 16, 17
    assert ("exploding_grad", "", 17, 10, 14, 5) in ends, "the episode across the checkpoint ends as one"


def test_statistics_and_windows_survive_the_resume(runs: dict[str, pl.Trainer]) -> None:
    resumed, uninterrupted = (read_report(debug_dir(runs[name])) for name in ("resumed", "uninterrupted"))
    # gradient norms are numbers of the model: the statistics and the window of healthy norms behind
    # the clipping suggestion come out the same
    for area in ("gradient_norm", "update_ratio"):
        assert resumed["stats"][area] == pytest.approx(uninterrupted["stats"][area])
    gradients = resumed["sections"]["gradients"]
    assert gradients["checks"] == uninterrupted["sections"]["gradients"]["checks"] == STEPS
    assert gradients["clip_suggestion"] == uninterrupted["sections"]["gradients"]["clip_suggestion"]
    assert gradients["counts"] == uninterrupted["sections"]["gradients"]["counts"]
    assert gradients["most_flagged"] == uninterrupted["sections"]["gradients"]["most_flagged"]
    assert resumed["sections"]["anomaly"]["anomaly_count"] == STEPS - NONFINITE_LOSS_FROM
    # memory and step times are measurements of a process (values differ between any two runs), but
    # how many check steps were measured carries over the resume
    measured = [area for area, summary in uninterrupted["stats"].items()
                if isinstance(summary, dict) and "count" in summary and area not in ("gradient_norm", "update_ratio")]
    assert any(area.startswith("memory") for area in measured) and "step_time_ms" in measured
    assert {area: resumed["stats"][area]["count"] for area in measured} == \
        {area: uninterrupted["stats"][area]["count"] for area in measured}
