"""The host-side values of one step's gradient pass, turned into names and floats only when asked.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from lightning_debug.core.numerics.index import ParameterIndex
    >>> from lightning_debug.core.numerics.rows import rank_flags
    >>> index = ParameterIndex(list(nn.Linear(1, 1, bias=False).named_parameters()))
    >>> host = HostNumerics(0, [rank_flags([0, 0, 0, 0.0, 0, 0, 9.0, 9.0, 0, 0])], index,
    ...                     torch.tensor([9.0], dtype=torch.float64), [])
    >>> host.global_grad_norm, host.grad_norms, host.missing
    (3.0, [3.0], [])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property

import torch

from lightning_debug.core.numerics.index import ParameterIndex


class HostNumerics:
    """The host-side values of a :class:`StepNumerics`: per-rank flags as Python numbers, the
    per-parameter squared norms as CPU tensors, turned into names and Python floats only when asked
    (that is, when something was found or per-parameter scalars are logged).

    ``squares`` holds, from position ``start``, every slot's squared gradient norm, then, when measured,
    every slot's squared parameter norm (the read-back vector as it came: on a CPU even slicing it is an
    operation, which a step that names nothing never needs)."""

    def __init__(self, step: int, ranks: list[dict[str, float]], index: ParameterIndex, squares: torch.Tensor,
                 missing_slots: list[int],
                 scan_parameters: Callable[[], list[tuple[str, float]]] | None = None,
                 read_before_update: bool = True, error: Exception | None = None,
                 without_gradients: bool = False, steps_done: Callable[[], int] | None = None, start: int = 0) -> None:
        self.step = step
        self.without_gradients = without_gradients
        self.error = error
        self.ranks = ranks
        self.param_names = index.names
        self.tags = index.tags
        self._squares = squares
        self._start = start
        self._count = len(index)
        self._missing_slots = missing_slots
        self.scan_parameters = scan_parameters
        self.read_before_update = read_before_update
        self._steps_done = steps_done
        # The last optimizer step whose update the parameters seen by nonfinite_params() had received.
        self.params_seen_after: int | None = None

    @cached_property
    def _grad_squares(self) -> torch.Tensor:
        if self._start == 0 and self._squares.numel() == self._count:
            return self._squares
        return self._squares[self._start:self._start + self._count]

    @cached_property
    def _param_squares(self) -> torch.Tensor:
        return self._squares[self._start + self._count:]

    @property
    def loss_checked(self) -> bool:
        return all(rank["loss_finite"] >= 0 for rank in self.ranks)

    @property
    def loss_value(self) -> float:
        """The step's loss (mean over micro-batches, then over the ranks that measured one); NaN when no
        loss was observed or it is not finite. Read with the flags, so it costs no sync of its own."""
        values = [rank.get("loss_value", math.nan) for rank in self.ranks]
        if not values or not all(math.isfinite(v) for v in values):
            return math.nan
        return sum(values) / len(values)

    @property
    def ranks_with_nonfinite_loss(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["loss_finite"] == 0]

    @property
    def ranks_with_nonfinite_inputs(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["input_nonfinite"] > 0]

    @property
    def ranks_with_nonfinite_grads(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["grad_nonfinite"] > 0]

    @property
    def ranks_with_nonfinite_buffers(self) -> list[int]:
        """Ranks whose model buffers (BatchNorm running statistics and the like) hold NaN/Inf after the step's forward."""
        return [i for i, rank in enumerate(self.ranks) if rank.get("buffer_nonfinite", 0) > 0]

    @property
    def ranks_with_nonfinite_params(self) -> list[int]:
        return [i for i, rank in enumerate(self.ranks) if rank["param_nonfinite"] > 0]

    @property
    def ranks_with_failed_check(self) -> list[int]:
        """Ranks whose own measurement raised: every rank learns it from the reduced rows, in the same step."""
        return [i for i, rank in enumerate(self.ranks) if rank["check_failed"] > 0]

    @property
    def failure(self) -> Exception | None:
        """Why this step's measurement is missing: this rank's own error, or which rank failed (None when it ran)."""
        ranks = self.ranks_with_failed_check
        if not ranks:
            return None
        where = f" on rank {', '.join(map(str, ranks))}" if len(self.ranks) > 1 else ""
        own = f" ({type(self.error).__name__}: {self.error})" if self.error is not None else ""
        return RuntimeError(f"the shared gradient pass failed{where}{own}")

    @property
    def global_grad_norm(self) -> float:
        """The 2-norm of all gradients together: each rank sent the squares of the blocks it owns."""
        if self.ranks_with_failed_check:
            return math.nan
        return math.sqrt(sum(rank["grad_square_sum"] for rank in self.ranks))

    @property
    def missing(self) -> list[str]:
        """Trainable parameters that received no gradient."""
        return [self.param_names[i] for i in self._missing_slots]

    @cached_property
    def grad_names(self) -> list[str]:
        """Names of the parameters with a gradient (``grad_norms`` in the same order)."""
        if not self._missing_slots:
            return self.param_names
        missing = set(self._missing_slots)
        return [name for i, name in enumerate(self.param_names) if i not in missing]

    @cached_property
    def _present(self) -> list[float]:
        """The squared norms of the gradients present, as Python floats: one read of the vector, then
        Python, which on a CPU costs less than the tensor operations it replaces (a mask, a sqrt, a max,
        a min)."""
        values = self._grad_squares.tolist()
        if self._missing_slots:
            missing = set(self._missing_slots)
            values = [value for i, value in enumerate(values) if i not in missing]
        return values

    @cached_property
    def grad_norms(self) -> list[float]:
        return [math.sqrt(value) for value in self._present]

    def grad_norm_extremes(self) -> tuple[float, float]:
        """The largest and the smallest gradient norm (NaN when a gradient is NaN; 0 when none)."""
        values = self._present
        if not values:
            return 0.0, 0.0
        if math.isnan(sum(values)):  # squares are >= 0: only a NaN makes their sum NaN
            return math.nan, math.nan
        return math.sqrt(max(values)), math.sqrt(min(values))

    def grad_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's gradient norm as a CPU tensor in ``param_names`` order (0 without a gradient)."""
        return self._grad_squares.sqrt()

    def param_norms_by_slot(self) -> torch.Tensor:
        """Every parameter's norm as a CPU tensor in ``param_names`` order (empty when not measured)."""
        return self._param_squares.sqrt()

    @property
    def params_measured(self) -> bool:
        """Whether this step measured every parameter's norm (see ``with_param_norms``)."""
        return self._squares.numel() > self._start + self._count

    @cached_property
    def param_norms(self) -> list[float]:
        """Every trainable parameter's norm, when this step measured them (else empty)."""
        return self._param_squares.sqrt().tolist()

    @property
    def grads_finite(self) -> bool:
        return not any(rank["grad_nonfinite"] for rank in self.ranks)

    def nonfinite_grads(self) -> list[tuple[str, float]]:
        if self.grads_finite:
            return []
        return [(n, v) for n, v in zip(self.grad_names, self.grad_norms) if not math.isfinite(v)]

    def nonfinite_params(self) -> list[tuple[str, float]]:
        """Non-finite parameters: from the step's norms when they were computed, else scanned now.

        :attr:`params_seen_after` says which weights these are: a scan now, read a step late, sees the
        weights after this step's update (and any update since); the step's own norms, or a scan
        read synchronously, the weights its forward used.
        """
        if not self.params_measured:
            if self.scan_parameters is None:
                return []
            self.params_seen_after = (self._steps_done() - 1 if self._steps_done is not None and
                                      not self.read_before_update else self.step - 1)
            return self.scan_parameters()
        self.params_seen_after = self.step - 1
        if not any(rank["param_nonfinite"] for rank in self.ranks):
            return []
        return [(n, v) for n, v in zip(self.param_names, self.param_norms) if not math.isfinite(v)]
