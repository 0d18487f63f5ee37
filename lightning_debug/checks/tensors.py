"""One-tensor analysis for interactive debugging."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch



def real_values(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values, detached and flat, a complex one as its real and imaginary parts (a view; ``.float()``
    alone would drop the imaginary part, with a warning in the user's log)::

        >>> real_values(torch.tensor([1 + 2j, 3 - 1j])).tolist(), real_values(torch.ones(2, 2)).shape
        ([1.0, 2.0, 3.0, -1.0], torch.Size([4]))
    """
    values = tensor.detach()
    return (torch.view_as_real(values.resolve_conj()) if values.is_complex() else values).reshape(-1)

@dataclass(frozen=True)
class TensorStats:
    """What :func:`inspect_tensor` found. Min/max/mean/std are over the finite values only."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    numel: int
    has_nan: bool
    has_inf: bool
    nonfinite_count: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    requires_grad: bool
    grad_fn: str | None

    @property
    def is_finite(self) -> bool:
        return not (self.has_nan or self.has_inf)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        finite = "finite" if self.is_finite else f"{self.nonfinite_count} non-finite (nan={self.has_nan}, inf={self.has_inf})"
        stats = "" if self.mean is None else f" min={self.min:.4g} max={self.max:.4g} mean={self.mean:.4g} std={self.std:.4g}"
        return f"Tensor{list(self.shape)} {self.dtype} on {self.device}, {self.bytes} bytes, {finite}{stats}"


def inspect_tensor(tensor: torch.Tensor) -> TensorStats:
    """Shape, dtype, device, size and numeric health of one tensor, with one host sync (for a debugger prompt).

    >>> stats = inspect_tensor(torch.tensor([1.0, float("nan"), 3.0]))
    >>> stats.has_nan, stats.nonfinite_count, stats.mean
    (True, 1, 2.0)
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"inspect_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    data = tensor.detach()
    if data.is_sparse:
        data = data.coalesce().values()
    numel = data.numel()
    base = dict(
        shape=tuple(tensor.shape),
        dtype=str(tensor.dtype).replace("torch.", ""),
        device=str(tensor.device),
        bytes=tensor.element_size() * tensor.numel() if not tensor.is_sparse else data.element_size() * numel,
        numel=tensor.numel(),
        requires_grad=tensor.requires_grad,
        grad_fn=type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else None,
    )
    if numel == 0 or data.dtype == torch.bool:
        return TensorStats(has_nan=False, has_inf=False, nonfinite_count=0, min=None, max=None, mean=None,
                           std=None, **base)
    if data.is_complex():
        data = data.abs()
    values = data.double()  # integers too: their masks are all False
    nan = torch.isnan(values)
    inf = torch.isinf(values)
    finite = values[~(nan | inf)]
    if finite.numel():
        moments = [finite.min(), finite.max(), finite.mean(), finite.std(unbiased=False)]
    else:
        moments = [values.new_full((), float("nan"))] * 4
    summary = torch.stack(moments + [nan.sum().double(), inf.sum().double()]).tolist()
    low, high, mean, std, nan_count, inf_count = summary
    has_values = nan_count + inf_count < numel
    return TensorStats(
        has_nan=nan_count > 0,
        has_inf=inf_count > 0,
        nonfinite_count=int(nan_count + inf_count),
        min=low if has_values else None,
        max=high if has_values else None,
        mean=mean if has_values else None,
        std=std if has_values else None,
        **base,
    )


MAX_LABELS_NAMED = 10


def check_labels(target: torch.Tensor, num_classes: int, ignore_index: int | None = -100) -> None:
    """Raise ``ValueError`` naming the samples and values when a class label is outside ``[0, num_classes)`` (other
    than ``ignore_index``): on a GPU such a label otherwise ends in ``device-side assert triggered``. One host sync.

    >>> check_labels(torch.tensor([0, 2, 1]), num_classes=3)
    >>> check_labels(torch.tensor([0, 3, 1, -1]), num_classes=3)
    Traceback (most recent call last):
    ...
    ValueError: 2 class label(s) outside [0, 3): samples [1, 3] have labels [3, -1]
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"check_labels expects a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex():
        raise ValueError(f"class labels must be integers (torch.long), got {target.dtype}; one-hot targets: "
                         "target.argmax(dim=1), class probabilities: a [N, C] tensor")
    labels = target.detach().reshape(-1)
    bad = (labels < 0) | (labels >= num_classes)
    if ignore_index is not None:
        bad &= labels != ignore_index
    samples = bad.nonzero().flatten()
    if samples.numel():
        shown = samples[:MAX_LABELS_NAMED]
        raise ValueError(f"{samples.numel()} class label(s) outside [0, {num_classes}): samples {shown.tolist()} "
                         f"have labels {labels[shown].tolist()}")
