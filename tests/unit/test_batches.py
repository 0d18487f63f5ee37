"""What is in a batch (checks/batches.py): the tensors a NaN can hide in, and which samples hold it."""

from __future__ import annotations

import torch

from lightning_debug.checks.batches import floating_tensors, named_tensors, nonfinite_samples


def test_only_dense_non_empty_floating_tensors_can_hold_a_nan() -> None:
    batch = {"pixels": torch.ones(2, 3), "ids": torch.ones(2, dtype=torch.long), "empty": torch.empty(0),
             "sparse": torch.eye(2).to_sparse(), "nested": (torch.zeros(2, dtype=torch.float16), "text")}
    assert [name for name, _ in floating_tensors(batch)] == ["batch['pixels']", "batch['nested'][0]"]


def test_a_batch_without_tensors_has_none() -> None:
    assert named_tensors("a sentence") == [] and named_tensors(None) == []


def test_nonfinite_samples_are_bounded_and_all_values_are_counted() -> None:
    x = torch.zeros(10, 2)
    x[:, 0] = float("nan")
    assert nonfinite_samples(x, limit=3) == ([0, 1, 2], 10)


def test_a_scalar_has_no_samples() -> None:
    assert nonfinite_samples(torch.tensor(float("inf"))) == ([], 1)
