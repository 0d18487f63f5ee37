"""Multi-task training, where each batch trains one task's head: a head waits for its task, and that wait
is not a missing gradient. Real Trainer runs with all four callbacks, at the defaults and every check
every step; then the two bugs such a model can hide (a head no task uses, a head cut off from its loss)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, read_events, regression_data

pytestmark = pytest.mark.timeout(180)

TASKS = 12
LOUD = ("warning", "error", "critical")


class RoundRobinTasks(pl.LightningModule):
    """A shared trunk and one classifier head per task, task ``t`` with ``t + 2`` classes (so no two heads have
    the same shape: they are no replicas of each other); batch ``i`` trains task ``i % TASKS`` (round robin
    over the tasks' datasets, as multi-task trainers do), so head 11 first gets a gradient at step 11.

    ``spare_head``: one more head that no task uses (the bug: a task left out of the schedule).
    ``detached_neck``: a layer between the trunk and the heads whose output is detached (the bug: it runs on
    every batch and nothing trains it).
    ``sampled``: tasks drawn at random per batch with these probabilities instead of round robin."""

    def __init__(self, spare_head: bool = False, detached_neck: bool = False,
                 sampled: tuple[float, ...] | None = None) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        tasks = TASKS if sampled is None else len(sampled)
        self.heads = nn.ModuleList(nn.Linear(32, task + 2) for task in range(tasks))
        self.spare = nn.Linear(32, 1) if spare_head else None
        self.neck = nn.Linear(32, 32) if detached_neck else None
        self.sampled = None if sampled is None else torch.tensor(sampled)
        self.draws = torch.Generator().manual_seed(3)

    def task(self, batch_idx: int) -> int:
        if self.sampled is None:
            return (self.trainer.global_step if self.trainer is not None else batch_idx) % TASKS
        return int(torch.multinomial(self.sampled, 1, generator=self.draws))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        task = self.task(batch_idx)
        features = self.trunk(x)
        if self.neck is not None:
            features = features + self.neck(features).detach()
        classes = task + 2
        labels = (torch.sigmoid(x[:, task % x.shape[1]]) * classes).long().clamp(max=classes - 1)
        return nn.functional.cross_entropy(self.heads[task](features), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=512), batch_size=16, shuffle=True)


def fit(root: Path, model: pl.LightningModule, steps: int, **config: Any) -> list[dict[str, Any]]:
    trainer = fit_seeded(root, model, all_four(DebugConfig(**config)), steps, limit_val_batches=0)
    return read_events(debug_dir(trainer))


EVERY_STEP = {"anomaly_check_frequency": 1, "gradient_checking_frequency": 1, "memory_profiling_frequency": 1,
              "performance_profiling_frequency": 1}


@pytest.mark.parametrize("config", [{}, EVERY_STEP], ids=["defaults", "every_step"])
def test_heads_that_wait_for_their_task_are_not_missing_gradients(config: dict[str, Any], tmp_path: Path) -> None:
    events = fit(tmp_path, RoundRobinTasks(), steps=3 * TASKS, **config)
    assert not [(e["kind"], e["step"]) for e in events if e["severity"] in LOUD], "a healthy run"


def test_a_task_sampled_on_a_tenth_of_the_batches_is_not_a_missing_gradient(tmp_path: Path) -> None:
    """With this seed the rare task's head is first drawn at step 20: 20 steps without a gradient, where the
    8-step window of a layer that ran would have named it."""
    model = RoundRobinTasks(sampled=(0.45, 0.45, 0.1))
    draws = torch.Generator().manual_seed(3)
    first = next(step for step in range(200) if int(torch.multinomial(model.sampled, 1, generator=draws)) == 2)
    assert first > 8, "the seed gives a long wait (the case this test is about)"
    events = fit(tmp_path, model, steps=80, **EVERY_STEP)
    assert not [(e["kind"], e["step"]) for e in events if e["severity"] in LOUD], "a healthy run"
    intermittent = [e for e in events if e["kind"] == "intermittent_grad"]
    assert intermittent and all(e["severity"] == "info" for e in intermittent)


def test_a_head_no_task_uses_is_named_as_not_called(tmp_path: Path) -> None:
    events = fit(tmp_path, RoundRobinTasks(spare_head=True), steps=80)
    missing = [e for e in events if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    assert [e["step"] for e in missing] == [0], "labelled with the check step that first saw it"
    details = missing[0]["details"]
    assert details["parameters"] == ["spare.weight", "spare.bias"] and details["not_called"] == details["parameters"]
    assert details["steps_without_gradient"] >= 64
    assert "were not called in the first forward pass" in missing[0]["message"]
    assert not [e for e in events if e["severity"] in LOUD and e["kind"] != "missing_grad"]


def test_a_layer_cut_off_from_the_loss_is_named_after_the_long_window(tmp_path: Path) -> None:
    """The neck runs on every batch and its output is detached, so its module ran in the first forward with its
    output in the graph and still got no gradient. A head whose loss counts on some batches only looks the same,
    so it waits the long window (first seen at step 0, confirmed at step 63 with every step checked), while the
    heads waiting for their tasks are not named."""
    events = fit(tmp_path, RoundRobinTasks(detached_neck=True), steps=70, **EVERY_STEP)
    missing = [e for e in events if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    assert missing and missing[0]["step"] == 0
    details = missing[0]["details"]
    assert details["parameters"] == ["neck.weight", "neck.bias"] and details["cut_off"] == details["parameters"]
    assert details["steps_without_gradient"] == 64 and details["no_graph"] == []
    assert "ran in the first forward pass, yet their output has not reached the loss" in missing[0]["message"]


class SemiSupervised(pl.LightningModule):
    """An autoencoder trained on every batch and a classifier head on its code, run on every batch, whose loss
    counts on the batches that carry labels (one in ten, drawn by ``seed``): the head runs in the first forward
    with its output in the graph and gets no gradient until the first labelled batch."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.classifier = nn.Linear(8, 3)
        self.draws = torch.Generator().manual_seed(seed)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        code = self.encoder(x)
        logits = self.classifier(code)
        loss = nn.functional.mse_loss(self.decoder(code), x)
        if float(torch.rand(1, generator=self.draws)) < 0.1:
            loss = loss + nn.functional.cross_entropy(logits, (y[:, 0] > 0).long() + (y[:, 0] > 1).long())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=512), batch_size=16, shuffle=True)


@pytest.mark.parametrize("config", [{}, EVERY_STEP], ids=["defaults", "every_step"])
def test_a_head_run_on_every_batch_whose_loss_counts_on_labelled_batches_only_is_not_missing(
        config: dict[str, Any], tmp_path: Path) -> None:
    draws = torch.Generator().manual_seed(6)
    first = next(step for step in range(200) if float(torch.rand(1, generator=draws)) < 0.1)
    assert first > 8, "the seed gives a long wait: 31 steps before the first labelled batch"
    events = fit(tmp_path, SemiSupervised(seed=6), steps=first + 10, **config)
    assert not [(e["kind"], e["step"]) for e in events if e["severity"] in LOUD], "a healthy run"
    assert any(e["kind"] == "intermittent_grad" for e in events) or config == {}, "the head waited, then learnt"


def test_a_layer_run_under_no_grad_is_named_after_eight_steps(tmp_path: Path) -> None:
    """A layer run under torch.no_grad() builds no graph: nothing can reach it, which the short window names."""

    class NoGradBranch(RoundRobinTasks):
        def __init__(self) -> None:
            super().__init__()
            self.side = nn.Linear(32, 32)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            with torch.no_grad():
                extra = self.side(self.trunk(x))
            return super().training_step(batch, batch_idx) + 0.0 * extra.mean()

    events = fit(tmp_path, NoGradBranch(), steps=20, **EVERY_STEP)
    missing = [e for e in events if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    assert [e["step"] for e in missing] == [0]
    details = missing[0]["details"]
    assert details["parameters"] == ["side.weight", "side.bias"] and details["no_graph"] == details["parameters"]
    assert details["steps_without_gradient"] == 8
    assert "without building a graph" in missing[0]["message"]
