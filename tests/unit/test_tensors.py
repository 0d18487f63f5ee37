"""One-tensor analysis and label checks (checks/tensors.py) beyond the doctests and tests/integration/test_foundation.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_debug.checks.tensors import MAX_LABELS_NAMED, check_labels, inspect_tensor


def test_a_tensor_without_finite_values_has_no_statistics() -> None:
    stats = inspect_tensor(torch.tensor([math.nan, math.inf]))
    assert stats.nonfinite_count == 2 and stats.has_nan and stats.has_inf and not stats.is_finite
    assert (stats.min, stats.max, stats.mean, stats.std) == (None, None, None, None)
    assert "2 non-finite (nan=True, inf=True)" in str(stats)


def test_the_summary_line_of_a_healthy_tensor() -> None:
    text = str(inspect_tensor(torch.tensor([1.0, 3.0])))
    assert text == "Tensor[2] float32 on cpu, 8 bytes, finite min=1 max=3 mean=2 std=1"


def test_inspect_tensor_refuses_what_is_no_tensor() -> None:
    with pytest.raises(TypeError, match="got list"):
        inspect_tensor([1.0])  # type: ignore[arg-type]


def test_labels_named_are_bounded_and_counted_in_full() -> None:
    labels = torch.full((MAX_LABELS_NAMED + 5,), 7)
    with pytest.raises(ValueError, match=rf"^{MAX_LABELS_NAMED + 5} class label\(s\) outside \[0, 3\)") as raised:
        check_labels(labels, num_classes=3)
    assert str(raised.value).count("7") >= MAX_LABELS_NAMED


def test_without_an_ignore_index_minus_100_is_out_of_range() -> None:
    check_labels(torch.tensor([0, -100]), num_classes=2)
    with pytest.raises(ValueError, match="samples \\[1\\] have labels \\[-100\\]"):
        check_labels(torch.tensor([0, -100]), num_classes=2, ignore_index=None)


def test_check_labels_refuses_what_is_no_tensor() -> None:
    with pytest.raises(TypeError, match="got list"):
        check_labels([0, 1], num_classes=2)  # type: ignore[arg-type]
