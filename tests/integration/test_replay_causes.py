"""The ADVANCED replay on NaNs made in place or from a fully masked row, and what a replay re-runs (issue 25)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_debug
from tests.harness.toolkit import TinyRegressor, as_on_an_accelerator, regression_data
from tests.integration.test_localize import cause_of, fit

SEQ, DIM, BATCH = 6, 8, 8


class InPlaceStandardize(TinyRegressor):
    """Standardizes each batch's features in place; one batch has a constant feature (std 0: 0/0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(0)
        x /= x.std(0)
        return super().forward(x)

    def train_dataloader(self) -> DataLoader:
        data = regression_data()
        data.tensors[0][16 * 4:16 * 5, 2] = 0.5  # batch 4 (no shuffling): feature 2 constant
        return DataLoader(data, batch_size=16, shuffle=False)


def test_in_place_division_by_a_zero_std_is_named(tmp_path: Path) -> None:
    events = fit(tmp_path, InPlaceStandardize())
    assert [e["step"] for e in events if e["kind"] == "nonfinite_loss"] == [4]
    cause = cause_of(events)
    assert cause["where"] == "forward" and cause["kernel"] == "aten::div_" and cause["operation"] == "Tensor.div_"
    assert cause["source"]["code"] == "x /= x.std(0)" and cause["inputs"]["nonfinite_count"] == 0
    assert "no single operation" not in cause["summary"]
    assert "(in place) at test_replay_causes.py" in cause["summary"] and "read before it overwrote them" in cause["summary"]
    activation = next(e for e in events if e["kind"] == "nonfinite_activation")
    assert activation["step"] == 4 and "epsilon" in activation["message"]


def sequences(padded_batch: int) -> TensorDataset:
    """Random sequences with a length each; sample 2 of ``padded_batch`` is all padding (length 0)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * 8, SEQ, DIM, generator=generator)
    lengths = torch.randint(2, SEQ + 1, (BATCH * 8,), generator=generator)
    lengths[BATCH * padded_batch + 2] = 0
    return TensorDataset(x, lengths, torch.randn(BATCH * 8, 1, generator=generator))


class Attention(TinyRegressor):
    """Self-attention over padded sequences; ``hand_written`` masks scores with -inf before a softmax,
    else ``nn.MultiheadAttention`` with a key padding mask."""

    def __init__(self, hand_written: bool) -> None:
        super().__init__(features=DIM)
        self.hand_written = hand_written
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.qk = nn.Linear(DIM, 2 * DIM)

    def attend(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        if not self.hand_written:
            return self.attn(x, x, x, key_padding_mask=pad)[0]
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = (q @ k.transpose(1, 2)) / DIM ** 0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, lengths, y = batch
        pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
        return nn.functional.mse_loss(super().forward(self.attend(x, pad).mean(1)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(sequences(padded_batch=3), batch_size=BATCH, shuffle=False)


def test_multihead_attention_with_a_fully_padded_sample_names_the_softmax(tmp_path: Path) -> None:
    events = fit(tmp_path, Attention(hand_written=False))
    assert [e["step"] for e in events if e["kind"] == "nonfinite_loss"] == [3]
    cause = cause_of(events)
    assert (cause["module"], cause["module_type"], cause["kernel"]) == ("attn", "MultiheadAttention", "aten::_softmax")
    assert "softmax over a row that is entirely -inf (a fully masked row" in cause["summary"]
    assert cause["inputs"]["fully_masked_rows"] == SEQ * 2, "every query row of the padded sample, in both heads"
    assert "self.attn(x, x, x, key_padding_mask=pad)" in cause["source"]["code"]
    loss_event = next(e for e in events if e["kind"] == "nonfinite_loss")
    assert "keep at least one unmasked key per row" in loss_event["message"]


def test_hand_written_attention_names_the_softmax_not_the_masked_fill(tmp_path: Path) -> None:
    events = fit(tmp_path, Attention(hand_written=True))
    assert [e["step"] for e in events if e["kind"] == "nonfinite_loss"] == [3]
    cause = cause_of(events)
    assert cause["operation"] == "torch.softmax" and cause["kernel"] == "aten::_softmax"
    assert cause["source"]["code"] == "return torch.softmax(scores, dim=-1) @ x"
    assert "masked_fill" not in cause["summary"]
    assert "softmax over a row that is entirely -inf (a fully masked row; 6 of 48 rows)" in cause["summary"]
    activation = next(e for e in events if e["kind"] == "nonfinite_activation")
    assert activation["step"] == 3 and "torch.finfo(dtype).min" in activation["message"]


class CountingLosses(TinyRegressor):
    """Keeps its own lists of losses, one guarded by ``is_replaying`` and one not, and draws a Python
    random number each step (a random augmentation); NaN from step 4."""

    def __init__(self) -> None:
        super().__init__(log_zero_from_step=4)
        self.guarded: list[float] = []
        self.unguarded: list[float] = []
        self.draws: list[float] = []
        self.seen_replaying = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        draw = random.random()
        self.unguarded.append(float(loss))
        self.seen_replaying = self.seen_replaying or lightning_debug.is_replaying()
        if not lightning_debug.is_replaying():
            self.guarded.append(float(loss))
            self.draws.append(draw)
        return loss


def test_a_list_guarded_by_is_replaying_gets_one_entry_per_step(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    runs, events = {}, {}
    for level in ("advanced", "basic"):
        if level == "basic":
            as_on_an_accelerator(monkeypatch)
        random.seed(0)
        runs[level] = CountingLosses()
        events[level] = fit(tmp_path / level, runs[level], level=level, steps=8)
    assert cause_of(events["advanced"])["operation"] == "torch.log"
    replayed, plain = runs["advanced"], runs["basic"]
    assert replayed.seen_replaying and not plain.seen_replaying and not lightning_debug.is_replaying()
    assert len(replayed.guarded) == 8
    assert len(replayed.unguarded) == 9, "the replay runs training_step once more (the forward names the cause, "\
        "so the backward is not replayed)"
    assert replayed.draws == plain.draws, "Python's random generator is restored after the replay"
