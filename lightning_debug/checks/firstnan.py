"""Which operation of a replayed step first made a value non-finite: in the forward, kernel by kernel (a
``TorchFunctionMode`` names the call the user wrote, a ``TorchDispatchMode`` sees every kernel it runs); in the
backward, node by node. Runs only inside a replay.
"""

from __future__ import annotations

import math
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_debug.checks.dispatch import TorchDispatchMode, tree_leaves

SOFTMAX_KERNELS = ("aten::_softmax", "aten::_log_softmax", "aten::softmax", "aten::log_softmax")
# Kernels not judged: their output is no value yet (uninitialised memory, a collective's buffer before its wait),
# or they cannot make a non-finite value from finite ones (copies, random fills).
UNJUDGED_PREFIXES = ("aten::empty", "aten::new_empty", "c10d::", "_c10d_functional::", "c10d_functional::",
                     "aten::clone", "aten::_unsafe_view", "aten::detach", "aten::alias", "aten::lift_fresh",
                     "aten::bernoulli", "aten::uniform_", "aten::normal_", "aten::random_")


@dataclass
class OpEvent:
    """One kernel that made a non-finite value: the call the user wrote (``operation``), the kernel, where it ran,
    and what its inputs (``inputs_finite``: before it ran) and outputs held."""

    operation: str
    kernel: str
    in_place: bool
    inputs_finite: bool
    made_nan: bool
    source: dict[str, Any] | None = None
    module: str = ""
    module_type: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    masked_rows: tuple[int, int] | None = None
    order: int = 0

    @property
    def label(self) -> str:
        """The call, and the kernel inside it when its name does not say it: ```Tensor.div_`` (in place)``.

        >>> OpEvent("Tensor.div_", "aten::div_", True, True, True).label
        '`Tensor.div_` (in place)'
        >>> OpEvent("torch.relu_", "aten::clamp_min_", True, True, True).label
        '`torch.relu_` (in place: `clamp_min_`)'
        >>> OpEvent("torch.nn.functional.multi_head_attention_forward", "aten::_softmax", False, False, True).label
        '`torch.nn.functional.multi_head_attention_forward` (its `softmax`)'
        """
        short = self.kernel.split("::")[-1].lstrip("_")
        inside = short.rstrip("_") not in self.operation.lower()
        if self.in_place:
            return f"`{self.operation}` (in place" + (f": `{short}`)" if inside else ")")
        return f"`{self.operation}`" + (f" (its `{short}`)" if inside and short else "")


def numeric(value: Any) -> bool:
    """Whether ``value`` is a tensor whose values can be NaN/Inf and can be read."""
    return (isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
            and value.numel() > 0 and not value.is_sparse and value.device.type != "meta")


def nonfinite_flags(values: list[Any]) -> tuple[bool, bool]:
    """Whether ``values`` (tensors and Python numbers) hold NaN, and whether they hold +-Inf (one pass over each
    finite tensor, the usual case).

    >>> nonfinite_flags([torch.tensor([1.0, float("inf")]), 2.0]), nonfinite_flags([float("nan")])
    ((False, True), (True, False))
    """
    numbers = [value for value in values if isinstance(value, float)]
    nan, inf = any(math.isnan(v) for v in numbers), any(math.isinf(v) for v in numbers)
    for value in values:
        if numeric(value) and not bool(torch.isfinite(value.detach()).all()):
            nan = nan or bool(torch.isnan(value.detach()).any())
            inf = inf or bool(torch.isinf(value.detach()).any())
    return nan, inf


def fully_masked_rows(x: torch.Tensor, dim: int) -> tuple[int, int]:
    """How many rows of ``x`` along ``dim`` are entirely -inf (a softmax over them is NaN), of how many.

    >>> fully_masked_rows(torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]]), -1)
    (1, 2)
    """
    if x.dim() == 0 or x.numel() == 0:
        return 0, 0
    rows = torch.isneginf(x.detach()).all(dim)
    return int(rows.sum()), rows.numel()


class _Naming(TorchFunctionMode):
    """The stack of the torch-level calls now running (the outermost is what the user wrote)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append(func)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.calls.pop()


class OpWatch(TorchDispatchMode):
    """Records the first kernel that made a non-finite value from finite inputs (``first_nonfinite``) and the first
    that made NaN from inputs without NaN (``first_nan``). ``context`` gives the running module as ``(name, type
    name)``, ``naming`` a callable's public name, ``summary`` describes tensors, ``source`` picks the user's frame.

    >>> from lightning_debug.checks.localize import operation_name, user_source, value_summary
    >>> x = torch.zeros(3)
    >>> with torch.no_grad(), OpWatch(lambda: ("", None), operation_name, value_summary, user_source) as watch:
    ...     y = x.masked_fill(x == 0, float("-inf")).softmax(0)
    >>> event, _ = watch.verdict(loss_has_nan=True)
    >>> event.operation, event.masked_rows
    ('Tensor.softmax', (1, 1))
    """

    def __init__(self, context: Callable[[], tuple[str, str | None]], naming: Callable[[Any], str],
                 summary: Callable[[list[torch.Tensor]], dict[str, Any]],
                 source: Callable[[list[traceback.FrameSummary]], dict[str, Any] | None]) -> None:
        super().__init__()
        self.context, self.naming, self.summary, self.source = context, naming, summary, source
        self.first_nonfinite: OpEvent | None = None
        self.first_nan: OpEvent | None = None
        self._names = _Naming()
        self._kernels = 0

    def __enter__(self) -> OpWatch:
        self._names.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._names.__exit__(*exc)

    @property
    def done(self) -> bool:
        return self.first_nonfinite is not None and self.first_nan is not None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.done:
            return func(*args, **kwargs)
        schema = getattr(func, "_schema", None)
        if schema is None or schema.name.startswith(UNJUDGED_PREFIXES):
            return func(*args, **kwargs)
        in_place = schema.is_mutable
        if not in_place and schema.returns and all(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)  # a view: it cannot make a new value
        inputs = tree_leaves((args, kwargs))
        self._kernels += 1
        try:
            before = nonfinite_flags(inputs) if in_place else None
        except (RuntimeError, NotImplementedError):  # a tensor these checks cannot read (nested): not judged
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        try:
            self._judge(func, args, inputs, result, in_place, before)
        except (RuntimeError, NotImplementedError):
            pass
        return result

    def _judge(self, func: Any, args: tuple, inputs: list[Any], result: Any, in_place: bool,
               before: tuple[bool, bool] | None) -> None:
        outputs = [t for t in tree_leaves(result) if numeric(t)]
        if not outputs or all(bool(torch.isfinite(t.detach()).all()) for t in outputs):
            return
        nan_in, inf_in = before if before is not None else nonfinite_flags(inputs)
        made_nan = not nan_in and nonfinite_flags(outputs)[0]
        from_finite = not (nan_in or inf_in)
        if not (from_finite and self.first_nonfinite is None or made_nan and self.first_nan is None):
            return
        event = self._event(func, args, inputs, outputs, in_place, from_finite, made_nan)
        if from_finite and self.first_nonfinite is None:
            self.first_nonfinite = event
        if made_nan and self.first_nan is None:
            self.first_nan = event

    def _event(self, func: Any, args: tuple, inputs: list[Any], outputs: list[torch.Tensor], in_place: bool,
               from_finite: bool, made_nan: bool) -> OpEvent:
        kernel = func._schema.name
        calls = self._names.calls
        module, module_type = self.context()
        event = OpEvent(
            operation=self.naming(calls[0]) if calls else str(func), kernel=kernel, in_place=in_place,
            inputs_finite=from_finite, made_nan=made_nan, source=self.source(traceback.extract_stack()),
            module=module, module_type=module_type,
            inputs=self.summary([t for t in inputs if isinstance(t, torch.Tensor)  # an overwritten one is no input now
                                 and not any(t is out for out in outputs)]),
            outputs=self.summary(outputs), order=self._kernels)
        if kernel in SOFTMAX_KERNELS and args and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
            masked = fully_masked_rows(args[0], dim)
            event.masked_rows = masked if masked[0] else None
        return event

    def verdict(self, loss_has_nan: bool) -> tuple[OpEvent, OpEvent | None] | None:
        """The cause, and the event that tells the rest of the story (None: nothing to add), as docs/anomaly.md
        ("Naming the cause") describes: for a NaN loss, the first kernel that made NaN, unless it only turned an
        earlier kernel's infinity into NaN (then that earlier kernel); otherwise the first that made NaN/Inf."""
        first, nan = self.first_nonfinite, self.first_nan
        if nan is not None and (loss_has_nan or first is None):
            earlier = first if first is not None and first.order < nan.order else None
            if nan.inputs_finite or nan.masked_rows or earlier is None:
                return nan, earlier if nan.masked_rows else None
            return earlier, nan
        return (first, None) if first is not None else None


def nonfinite_tensors(values: Sequence[Any]) -> bool:
    """Whether any of ``values`` is a :func:`numeric` tensor holding NaN/Inf."""
    return any(numeric(t) and not bool(torch.isfinite(t.detach()).all()) for t in values)


def _watch(loss: torch.Tensor, first: list[tuple[Any, str]]) -> list[Any]:
    """Hook every node of ``loss``'s graph to keep, in ``first``, the first whose backward made a non-finite
    gradient from finite incoming ones."""
    handles: list[Any] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)

        def hook(grad_inputs: Sequence[Any], grad_outputs: Sequence[Any], node: Any = node) -> None:
            if not first and not nonfinite_tensors(grad_outputs) and nonfinite_tensors(grad_inputs):
                nan = any(isinstance(g, torch.Tensor) and bool(torch.isnan(g).any()) for g in grad_inputs)
                first.append((node, "NaN" if nan else "Inf"))

        handles.append(node.register_hook(hook))
        stack.extend(function for function, _ in node.next_functions)
    return handles


def first_nonfinite_backward(run: Callable[[], torch.Tensor | None],
                             parameters: Sequence[torch.Tensor]) -> tuple[str, str, str] | None:
    """Run ``run()`` (the step's loss) and its backward to ``parameters``; return the name of the first backward
    node that made NaN/Inf from finite gradients, ``"NaN"`` or ``"Inf"``, and its forward traceback, or None.
    ``detect_anomaly(check_nan=True)`` would stop at the first backward that returns NaN, often not the cause
    (``sqrt``'s derivative at 0 is Inf; the NaN appears in the ``pow`` backward that multiplies it by 0).

    >>> x = torch.ones(3, requires_grad=True)
    >>> def step():
    ...     d = (x - x).pow(2).sum()
    ...     return x.sum() + d.sqrt()
    >>> name, what, trace = first_nonfinite_backward(step, [x])
    >>> name, what, "d.sqrt()" in trace
    ('SqrtBackward0', 'Inf', True)
    """
    first: list[tuple[Any, str]] = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=False):  # keeps each node's forward traceback
            loss = run()
            if loss is None or not loss.requires_grad:
                return None
            handles = _watch(loss, first)
            try:
                torch.autograd.grad(loss, list(parameters), allow_unused=True)
            finally:
                for handle in handles:
                    handle.remove()
    if not first:
        return None
    node, what = first[0]
    trace = getattr(node, "metadata", {}).get("traceback_")
    return node.name(), what, "".join(trace) if isinstance(trace, list) else str(trace or "")
