"""Where a runtime error happened: the module, the tensors and the line, read from its traceback after the fact.

A traceback keeps every frame alive, so the innermost failing ``forward`` still holds ``self`` and its arguments:
that names the module and both shapes of a mismatch at no cost to healthy steps. An error raised by the backward
has no such frames; :func:`find_inplace` replays the forward once to find the in-place operation at fault.
"""

from __future__ import annotations

import linecache
import re
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_debug.checks.localize import module_stack, operation_name, preserved_state, user_source

TENSORS_SHOWN = 6
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                               "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                               "__setitem__"})
_MODULE_CALLS = frozenset({"_call_impl", "_wrapped_call_impl", "inner"})  # torch's frames around a forward
_SIZE_ATTRIBUTES = ("in_features", "in_channels", "num_features", "normalized_shape", "embedding_dim",
                    "num_embeddings", "input_size", "embed_dim")


def tensor_summary(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and device of a tensor, as plain values (no read of its data).

    >>> tensor_summary(torch.ones(2, 3))
    {'shape': [2, 3], 'dtype': 'float32', 'device': 'cpu'}
    """
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "device": str(tensor.device)}


def frames_of(error: BaseException) -> list[tuple[FrameType, int]]:
    """The traceback's frames, outermost first, with the line each was at."""
    return list(traceback.walk_tb(error.__traceback__))


def _tensor_locals(frame: FrameType, names: Iterator[str] | None = None) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    local = dict(frame.f_locals)  # a dict: Python 3.13's f_locals is a FrameLocalsProxy, a mapping but no dict
    for name in names if names is not None else list(local):
        value: Any = local
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
            if value is None:
                break
        if isinstance(value, torch.Tensor) and name not in found:
            found[name] = tensor_summary(value)
            if len(found) >= TENSORS_SHOWN:
                break
    return found


def failing_module(error: BaseException, model: nn.Module | None) -> dict[str, Any] | None:
    """The innermost module of ``model`` being called on the traceback (``module(x)``, not a method such as
    ``training_step``), with the tensors it was called with, its own parameters and the sizes it expects.

    >>> model = nn.Sequential(nn.Linear(4, 2), nn.Linear(3, 1))
    >>> try:
    ...     model(torch.ones(5, 4))
    ... except RuntimeError as error:
    ...     found = failing_module(error, model)
    >>> found["name"], found["inputs"]["input"]["shape"], found["parameters"]["weight"]["shape"], found["expects"]
    ('1', [5, 2], [1, 3], {'in_features': 3})
    """
    if model is None:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    frames = [frame for frame, _ in frames_of(error)]
    for index in range(len(frames) - 1, -1, -1):
        frame = frames[index]
        module = frame.f_locals.get("self")
        if frame.f_code.co_name not in _MODULE_CALLS or not isinstance(module, nn.Module) or id(module) not in names:
            continue
        own = [f for f in frames[index + 1:]
               if f.f_locals.get("self") is module and f.f_code.co_name not in _MODULE_CALLS]
        called = next((f for f in own if f.f_code.co_name == "forward"), own[0] if own else None)
        inputs = _tensor_locals(called) if called is not None else {
            f"args[{i}]": tensor_summary(a) for i, a in enumerate(frame.f_locals.get("args", ()))
            if isinstance(a, torch.Tensor)}
        parameters = {name: tensor_summary(p)
                      for name, p in list(module.named_parameters(recurse=False))[:TENSORS_SHOWN]}
        buffers = {name: tensor_summary(b) for name, b in list(module.named_buffers(recurse=False))[:TENSORS_SHOWN]}
        expects = {attribute: getattr(module, attribute) for attribute in _SIZE_ATTRIBUTES
                   if isinstance(getattr(module, attribute, None), (int, tuple, list))}
        found = {"name": names[id(module)], "type": type(module).__name__, "repr": _short_repr(module),
                 "inputs": inputs, "parameters": parameters, "buffers": buffers,
                 "expects": {k: list(v) if isinstance(v, tuple) else v for k, v in expects.items()}}
        labels = declared_labels(module)
        if labels is not None:
            found["num_labels"] = labels
        return found
    return None


def declared_labels(module: Any) -> dict[str, Any] | None:
    """The number of classes a module declares: an int ``num_labels`` (or ``num_classes``) on its ``config`` or
    on itself, read as structure, never from its class.

    >>> class Config: num_labels = 3
    >>> head = nn.Linear(4, 3); head.config = Config()
    >>> declared_labels(head), declared_labels(nn.Linear(4, 3))
    ({'value': 3, 'attribute': 'config.num_labels'}, None)
    """
    for owner, prefix in ((getattr(module, "config", None), "config."), (module, "")):
        for attribute in ("num_labels", "num_classes"):
            value = getattr(owner, attribute, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return {"value": value, "attribute": prefix + attribute}
    return None


def out_of_range_labels(error: BaseException) -> dict[str, Any] | None:
    """The first label outside ``[0, classes)`` (other than ``ignore_index``), its index and how many there are,
    from the innermost frame of the traceback that holds a loss's scores (floating, classes on dimension 1) and
    integer labels. Reads the labels' values: it runs only after the error.

    >>> try:
    ...     nn.functional.cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, 3, 1]))
    ... except IndexError as error:
    ...     found = out_of_range_labels(error)
    >>> found["label"], found["index"], found["num_classes"], found["logits_shape"], found["count"]
    (3, 2, 3, [4, 3], 1)
    """
    for frame, _ in reversed(frames_of(error)):
        local = frame.f_locals
        tensors = [value for value in list(local.values()) if isinstance(value, torch.Tensor)]
        scores = next((t for t in tensors if t.is_floating_point() and t.dim() >= 2), None)
        labels = next((t for t in tensors if not t.is_floating_point() and not t.is_complex()
                       and t.dtype is not torch.bool), None)
        if scores is None or labels is None:
            continue
        classes = int(scores.shape[1])
        ignore = local.get("ignore_index")
        flat = labels.detach().reshape(-1).to("cpu", torch.int64)
        bad = (flat >= classes) | ((flat < 0) & (flat != (ignore if isinstance(ignore, int) else -100)))
        positions = bad.nonzero().reshape(-1)
        if not len(positions):
            return None
        first = int(positions[0])
        return {"label": int(flat[first]), "index": first, "count": len(positions), "num_classes": classes,
                "logits_shape": list(scores.shape), "labels_shape": list(labels.shape),
                "labels_range": [int(flat.min()), int(flat.max())]}
    return None


def _short_repr(module: nn.Module) -> str:
    text = repr(module)
    return text if "\n" not in text and len(text) <= 120 else f"{type(module).__name__}({module.extra_repr()[:100]})"


def failing_source(error: BaseException) -> dict[str, Any] | None:
    """The innermost line of the user's own code on the traceback, and the shapes of the tensors that line names
    (``x``, ``self.bias``)."""
    frames = frames_of(error)
    summaries = [traceback.FrameSummary(frame.f_code.co_filename, line, frame.f_code.co_name,
                                        line=linecache.getline(frame.f_code.co_filename, line).strip())
                 for frame, line in frames]
    source = user_source(summaries)
    if source is None:
        return None
    frame = next(frame for (frame, line), summary in zip(reversed(frames), reversed(summaries))
                 if summary.filename == source["file"] and line == source["line"])
    source["tensors"] = _tensor_locals(frame, iter(_IDENTIFIER.findall(source["code"])))
    return source


def innermost_tensors(error: BaseException) -> dict[str, dict[str, Any]]:
    """The tensor arguments of the innermost frame that has any (``input`` and ``target`` of a loss function).

    >>> def squared_error(input, target):
    ...     return (input - target).square().mean()
    >>> try:
    ...     squared_error(torch.ones(4, 3), torch.ones(4, 2))
    ... except RuntimeError as error:
    ...     found = innermost_tensors(error)
    >>> found["input"]["shape"], found["target"]["shape"]
    ([4, 3], [4, 2])
    """
    for frame, _ in reversed(frames_of(error)):
        found = _tensor_locals(frame)
        if found:
            return found
    return {}


class _InPlaceFinder(TorchFunctionMode):
    """Records the first in-place operation applied to the output of ``node`` with ``shape``."""

    def __init__(self, stack: list[tuple[str, nn.Module, Any]], node: str, shape: list[int] | None) -> None:
        super().__init__()
        self.stack, self.node, self.shape = stack, node.lower(), shape
        self.found: dict[str, Any] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None and args and isinstance(args[0], torch.Tensor):
            name = getattr(func, "__name__", "")
            in_place = (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS \
                or kwargs.get("inplace") is True
            target = args[0]
            producer = target.grad_fn.name() if target.grad_fn is not None else ""
            if in_place and re.sub(r"Backward\d*$", "", producer).lower() == self.node \
                    and (self.shape is None or list(target.shape) == self.shape):
                module_name, module, _ = self.stack[-1] if self.stack else ("", None, ())
                self.found = {"operation": operation_name(func) + ("(inplace=True)" if kwargs.get("inplace") else ""),
                              "module": module_name,
                              "module_type": type(module).__name__ if module is not None else None,
                              "source": user_source(traceback.extract_stack()[:-1]), "modified": producer,
                              "shape": list(target.shape)}
        return func(*args, **kwargs)


def find_inplace(model: nn.Module, replay: Callable[[], Any], node: str,
                 shape: list[int] | None) -> dict[str, Any] | None:
    """Replay a forward (RNG and buffers restored afterwards) and return the first in-place operation that
    modified an output of shape ``shape`` of the autograd node ``node`` (``"Relu"`` or ``"ReluBackward0"``):
    the operation, the module it ran in, the source line (None: none found).

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__(); self.lin = nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         h = torch.relu(self.lin(x)); h += 1; return h.sum()
    >>> net = Net()
    >>> found = find_inplace(net, lambda: net(torch.ones(3, 2)), "Relu", [3, 2])
    >>> found["operation"], found["modified"], found["shape"]
    ('Tensor.add_', 'ReluBackward0', [3, 2])
    """
    node = re.sub(r"Backward\d*$", "", node)
    with preserved_state(model), torch.enable_grad(), module_stack(model) as stack, \
            _InPlaceFinder(stack, node, shape) as finder:
        replay()
    return finder.found
