"""``batch_mixing``: a model whose output for one sample depends, in their order, on the other samples of the batch.

Two mistakes that raise nothing and still learn a little: an ``nn.LSTM`` without ``batch_first=True`` fed (batch,
time, features) runs its recurrence across the samples, and a ``view`` where a ``transpose`` was meant regroups
values of different samples. The twins: the same models written right, mixing on purpose with no order (BatchNorm
without running statistics, attention across the batch), a Hugging Face BERT on token ids, and the bug behind a
loader that does not shuffle (not judged, and report.json says why). Real Trainer and Accelerate runs; the events
and report are read back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import DebugConfig, GradientHealthCallback
from tests.harness.toolkit import all_four, debug_dir, fit_seeded, fresh_accelerate, read_events, read_report, run_dir

pytestmark = pytest.mark.timeout(180)
WARNINGS = ("warning", "error", "critical")


def sequences(samples: int = 512, seed: int = 0) -> TensorDataset:
    """Records of 6 steps of 4 features; the class shows at one random step."""
    g = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(4, 4, generator=g)
    labels = torch.randint(0, 4, (samples,), generator=g)
    x = 0.5 * torch.randn(samples, 6, 4, generator=g)
    x[torch.arange(samples), torch.randint(0, 6, (samples,), generator=g)] += centres[labels]
    return TensorDataset(x, labels)


class Classifier(pl.LightningModule):
    """A recurrent classifier over (batch, time, features); ``shuffle``: the training loader's."""

    def __init__(self, shuffle: bool = True) -> None:
        super().__init__()
        self.shuffle = shuffle
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(sequences(), batch_size=32, shuffle=self.shuffle)


class Lstm(Classifier):
    def __init__(self, batch_first: bool, shuffle: bool = True) -> None:
        super().__init__(shuffle)
        self.rnn = nn.LSTM(4, 16, batch_first=batch_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class TimeFirstGru(Classifier):
    """A sequence-first GRU; ``transpose`` False is the bug: ``x.view(T, B, F)``."""

    def __init__(self, transpose: bool) -> None:
        super().__init__()
        self.transpose = transpose
        self.rnn = nn.GRU(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, features = x.shape
        out, _ = self.rnn(x.transpose(0, 1) if self.transpose else x.view(time, batch, features))
        return self.head(out[-1])


class OverTheBatch(Classifier):
    """Mixing on purpose, in no order: BatchNorm without running statistics and attention across the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(24, 16)
        self.norm = nn.BatchNorm1d(16, track_running_stats=False)
        self.attend = nn.MultiheadAttention(16, 2)  # (L, N, E): the batch as one set of 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.embed(x.flatten(1))))
        mixed, _ = self.attend(h[:, None], h[:, None], h[:, None])
        return self.head(h + mixed[:, 0])


def fit(tmp_path: Path, model: pl.LightningModule, steps: int = 30) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    trainer = fit_seeded(tmp_path, model, all_four(DebugConfig(save_plots=False, print_summary=False)), steps)
    directory = debug_dir(trainer)
    return read_events(directory), read_report(directory)


def mixing_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event.get("kind") == "batch_mixing"]


def probed(report: dict[str, Any]) -> str:
    return report["sections"]["activations"]["batch_mixing"]


def test_an_lstm_without_batch_first_fed_batch_first_data_is_named_at_step_0(tmp_path: Path) -> None:
    events, report = fit(tmp_path / "bug", Lstm(batch_first=False))
    [found] = mixing_events(events)
    assert found["step"] == 0 and found["severity"] == "warning"
    assert found["details"]["between"] == ["the inputs", "`rnn` (LSTM)'s output"]
    assert found["details"]["from_rows"][0] == found["details"]["row"] - 1  # the recurrence: the row before
    assert "batch_first" in found["message"]
    assert probed(report) == "mixed"

    events, report = fit(tmp_path / "twin", Lstm(batch_first=True))
    assert [e for e in events if e.get("severity") in WARNINGS] == []
    assert probed(report) == "each sample's output depends on its input alone"


def test_a_view_where_a_transpose_was_meant_is_named_and_the_transpose_is_quiet(tmp_path: Path) -> None:
    events, _ = fit(tmp_path / "bug", TimeFirstGru(transpose=False))
    [found] = mixing_events(events)
    assert found["step"] == 0 and found["details"]["between"][1] == "`head` (Linear)'s output"
    events, report = fit(tmp_path / "twin", TimeFirstGru(transpose=True))
    assert [e for e in events if e.get("severity") in WARNINGS] == []
    assert probed(report) == "each sample's output depends on its input alone"


def test_mixing_in_no_order_batchnorm_without_statistics_and_attention_over_the_batch_is_not_named(
        tmp_path: Path) -> None:
    """The narrowing's twin is the LSTM above: a recurrence over the rows depends on their order and is named."""
    events, report = fit(tmp_path, OverTheBatch())
    assert mixing_events(events) == []
    assert probed(report) == "mixed in no order (a statistic or an attention over the batch)"


def test_a_loader_that_does_not_shuffle_is_not_judged_and_the_report_says_why(tmp_path: Path) -> None:
    events, report = fit(tmp_path, Lstm(batch_first=False, shuffle=False))
    assert mixing_events(events) == []
    assert probed(report) == "not judged: the training loader does not shuffle (its rows may be one series in order)"


class Bert(pl.LightningModule):
    """A tiny Hugging Face BERT classifier on token ids (no gradient on the inputs: the embedding's output is read)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        self.model = BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, num_labels=2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 64, (256, 12), generator=g)
        return DataLoader(TensorDataset(ids, (ids[:, 0] < 32).long()), batch_size=16, shuffle=True)


def test_a_hugging_face_bert_on_token_ids_is_judged_from_its_embedding_and_is_quiet(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    events, report = fit(tmp_path, Bert(), steps=10)
    assert mixing_events(events) == []
    assert probed(report) == "each sample's output depends on its input alone"


def test_the_probe_leaves_training_as_it_was(tmp_path: Path) -> None:
    """The same weights after 20 steps with and without the probe: dropout's random state, BatchNorm's statistics
    and the gradients are untouched (it runs once, in eval mode, with the random state forked)."""

    class Noisy(Lstm):
        def __init__(self) -> None:
            super().__init__(batch_first=True)
            self.drop, self.norm = nn.Dropout(0.3), nn.BatchNorm1d(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(x)
            return self.head(self.norm(self.drop(out[:, -1])))

    weights = []
    for callbacks in ([GradientHealthCallback(DebugConfig(save_plots=False, print_summary=False))], []):
        torch.manual_seed(0)
        model = Noisy()
        fit_seeded(tmp_path / str(len(weights)), model, callbacks, 20)
        weights.append({name: value.clone() for name, value in model.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    assert [name for name in weights[0] if not torch.equal(weights[0][name], weights[1][name])] == []


def test_an_accelerate_loop_is_probed_through_the_call_it_captured(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    results = []
    for batch_first in (False, True):
        root = tmp_path / str(batch_first)
        with fresh_accelerate():
            torch.manual_seed(0)
            model = Lstm(batch_first=batch_first)
            accelerator = Accelerator(cpu=True, project_dir=str(root))
            prepared, optimizer, loader = accelerator.prepare(
                model, torch.optim.Adam(model.parameters(), lr=3e-3),
                DataLoader(sequences(), batch_size=32, shuffle=True))
            with AccelerateDebugger(accelerator, prepared, optimizer, DebugConfig(save_plots=False,
                                    print_summary=False), train_dataloader=loader) as debugger:
                for x, y in loader:
                    debugger.backward(F.cross_entropy(prepared(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        results.append(mixing_events(read_events(run_dir(root / "debug_outputs"))))
    assert [len(found) for found in results] == [1, 0]
    assert results[0][0]["details"]["between"] == ["the inputs", "`rnn` (LSTM)'s output"]


def test_what_the_forward_logs_while_it_is_probed_is_dropped(tmp_path: Path) -> None:
    from tests.harness.toolkit import read_scalars

    class Logs(Lstm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.log("forward_rows", float(x.shape[0]))
            return super().forward(x)

    trainer = fit_seeded(tmp_path, Logs(batch_first=True),
                         [GradientHealthCallback(DebugConfig(save_plots=False, print_summary=False))], 4)
    assert probed(read_report(debug_dir(trainer))) == "each sample's output depends on its input alone"
    assert {value for _, value in read_scalars(trainer.log_dir)["forward_rows"]} == {32.0}


def test_a_first_batch_with_no_module_call_is_not_judged_and_not_watched_again(tmp_path: Path) -> None:
    """Hooks on every module for the first batch only: a training step that calls no module with gradients on
    (here its first batch runs the model under no_grad and returns a loss of a bare parameter) is not judged, and
    the later steps run without the probe's hooks."""
    hooked: list[int] = []

    class Bare(Lstm):
        def __init__(self) -> None:
            super().__init__(batch_first=True)
            self.scale = nn.Parameter(torch.ones(()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            hooked.append(sum(len(m._forward_pre_hooks) for m in self.modules()))
            with torch.no_grad():
                self(batch[0])
            return (self.scale - 2.0) ** 2

    trainer = fit_seeded(tmp_path, Bare(), [GradientHealthCallback(DebugConfig(save_plots=False,
                                                                               print_summary=False))], 5)
    assert probed(read_report(debug_dir(trainer))) == "not judged: no module call of the training step was seen"
    assert hooked[0] > 0 and hooked[1:] == [0] * 4
