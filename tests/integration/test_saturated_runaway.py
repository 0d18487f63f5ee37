"""A runaway growth is judged against the run's range, not only its last three norms (issue 45's sweep at 300
steps: MobileNetV2 got ``exploding_grad`` at step 250 for a norm of 68 after two near-zero ones, among norms of
20-70). The healthy twin: a classifier already saturated on its data whose label noise (a batch of flipped labels,
three in five steps) keeps taking its norm from ~1e-12 back to its ordinary ~2-3. The failure it must still name:
the same run whose loader stops normalizing at step 30 (inputs 1e4x from there on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, read_events

pytestmark = pytest.mark.timeout(120)

EVERY_STEP = DebugConfig(gradient_checking_frequency=1)
SERIOUS = ("warning", "error", "critical")
DIRECTION = torch.nn.functional.normalize(torch.ones(8), dim=0)


class NoisyLabels(Dataset):
    """Batch ``i`` (of 4): class 0 along +:data:`DIRECTION`, class 1 along -, with noise; in the first three of every
    five batches the labels are flipped (the saturated model gets them all wrong), in the other two they are right
    (loss ~1e-13). ``unscaled_from``: from that batch on the inputs are 1e4x (normalization dropped)."""

    def __init__(self, unscaled_from: int | None = None, batches: int = 200) -> None:
        generator = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 2, (batches, 4), generator=generator)
        signs = 1.0 - 2.0 * labels.float()
        self.x = signs[..., None] * DIRECTION + 0.05 * torch.randn(batches, 4, 8, generator=generator)
        if unscaled_from is not None:
            self.x[unscaled_from:] *= 1e4
        flipped = (torch.arange(batches) % 5 < 3)[:, None]
        self.y = torch.where(flipped, 1 - labels, labels)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class SaturatedClassifier(pl.LightningModule):
    """A linear classifier whose margin on the clean data is ~30 nats from the start; SGD at 1e-6 keeps it there."""

    def __init__(self, data: NoisyLabels) -> None:
        super().__init__()
        self.data = data
        self.head = nn.Linear(8, 2)
        with torch.no_grad():
            self.head.weight.copy_(torch.stack([DIRECTION, -DIRECTION]) * 15.0)
            self.head.bias.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=None)


def fit(tmp_path: Path, data: NoisyLabels, callbacks: list[pl.Callback]) -> list[dict[str, Any]]:
    trainer = fit_seeded(tmp_path, SaturatedClassifier(data), callbacks, max_steps=60)
    return read_events(debug_dir(trainer))


def serious(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(e["step"], e["kind"]) for e in events if e.get("severity") in SERIOUS and e.get("episode") != "end"]


@pytest.mark.parametrize("callbacks", [lambda: [GradientHealthCallback(EVERY_STEP)], lambda: all_four(EVERY_STEP)],
                         ids=["gradients", "all-four"])
def test_a_saturated_classifier_with_label_noise_is_no_explosion(tmp_path: Path, callbacks: Any) -> None:
    """Its norm goes from ~1e-12 (two clean batches) back to its ordinary 2-3 in every fifth step: 1e12x the median of
    the last three, never above what the run showed; every check every step, 60 steps: no finding."""
    events = fit(tmp_path, NoisyLabels(), callbacks())
    assert serious(events) == []


def test_the_same_classifier_whose_inputs_lose_their_scale_is_named(tmp_path: Path) -> None:
    """From step 30 (a flipped batch after two clean ones) the inputs are 1e4x: exploding_grad at step 30."""
    events = fit(tmp_path, NoisyLabels(unscaled_from=30), [GradientHealthCallback(EVERY_STEP)])
    exploding = [e for e in events if e["kind"] == "exploding_grad" and e.get("episode") != "end"]
    assert [e["step"] for e in exploding][:1] == [30], serious(events)
    assert exploding[0]["details"]["parameters"][0] == "head.weight"
