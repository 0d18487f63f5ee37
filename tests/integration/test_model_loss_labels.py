"""A label out of range inside a model's own loss (issue 25): ``model(input_ids, labels=y).loss``, the usual way
with a Hugging Face model, is explained like a user's own ``cross_entropy``: the label, its index, the logits'
class count and the model's declared ``num_labels``. Real Trainer run on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback
from tests.harness.toolkit import debug_dir, make_trainer, read_events

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


class TinyBertClassifier(pl.LightningModule):
    """A 1-layer BertForSequenceClassification with 3 labels; the batch of step ``bad_step`` carries a label 3
    at sample 5 (a dataset with 4 classes given to a 3-label head)."""

    def __init__(self, bad_step: int = 2) -> None:
        super().__init__()
        config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16, num_labels=3)
        self.model = transformers.BertForSequenceClassification(config)
        self.bad_step = bad_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        if self.trainer.global_step == self.bad_step:
            labels = labels.clone()
            labels[5] = 3
        return self.model(input_ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, 50, (64, 8), generator=generator),
                                        torch.randint(0, 3, (64,), generator=generator)), batch_size=8)


def test_a_label_out_of_range_in_a_transformers_models_own_loss_is_explained(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=5)
    with warnings.catch_warnings(), pytest.raises(IndexError, match="Target 3 is out of bounds"):
        warnings.simplefilter("ignore")
        trainer.fit(TinyBertClassifier())
    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "exception"]
    assert len(events) == 1 and events[0]["step"] == 2
    details, message = events[0]["details"], events[0]["message"]
    assert details["category"] == "index_out_of_range"
    assert details["label"] == 3 and details["num_classes"] == 3 and details["num_labels"] == 3
    assert details["label_index"] == 5 and details["logits_shape"] == [8, 3] and details["labels_shape"] == [8]
    assert "a class label is 3 but the model's output has 3 classes" in message
    assert "`config.num_labels` is 3" in message and "at index 5" in message
