"""The user's exception, explained: what kind of error, in which module, with which shapes or devices.

The error propagates unchanged. An in-place error (raised by the backward, no module on its traceback) is traced
by replaying the forward once, on one process only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_debug.checks.errors import (failing_module, failing_source, find_inplace, innermost_tensors,
                                           out_of_range_labels)
from lightning_debug.checks.memory.readings import OUT_OF_MEMORY
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.findings import Finding
from lightning_debug.core.guard import describe
from lightning_debug.core.error_categories import ERROR_ADVICE, ErrorCategory
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Event, Monitor
from lightning_debug.errors import AnomalyError

EXPLANATIONS_KEPT = 5
NAMES_SHOWN = 20

_SHAPE = re.compile(r"shapes cannot be multiplied|must match the size of tensor|size mismatch|is invalid for input of "
                    r"size|channels, but got|Expected input batch_size|expected input with shape|should contain \d+ "
                    r"elements|must match mat2|Sizes of tensors must match|Target size .* must be the same as input "
                    r"size|Expected target size|expected \d+D or \d+D input|but got input of size|dimension out of "
                    r"range|shape mismatch", re.IGNORECASE)
_DEVICE = re.compile(r"on the same device|is not on the expected device|Expected object of device type|"
                     r"device type .* does not match", re.IGNORECASE)
_DTYPE = re.compile(r"same dtype|expected scalar type|expected target dtype|Found dtype|should be the same|"
                    r"expected .*dtype", re.IGNORECASE)
_INDEX = re.compile(r"Target -?\d+ is out of bounds|index out of range in self|out of bounds for dimension|"
                    r"index -?\d+ is out of bounds|class label\(s\) outside", re.IGNORECASE)
_INPLACE = re.compile(r"modified by an inplace operation: \[(?P<type>[\w.]+) \[(?P<shape>[\d, ]*)\]\], which is output "
                      r"(?P<output>\d+) of (?P<node>\w+), is at version (?P<now>\d+); expected version (?P<saved>\d+)")
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+):\s*([\d ]+)")
_DDP_NAMES = re.compile(r"Parameters which did not receive grad for rank (\d+):\s*([^\n]+)")
_DEVICES = re.compile(r"found at least two devices, (\S+) and (\S+?)!|Tensor on device (\S+) is not on the expected "
                      r"device (\S+?)!")


def classify(error: BaseException) -> ErrorCategory:
    """The category of a training-step error, from its type and message::

        >>> classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 16x1)"))
        <ErrorCategory.SHAPE_MISMATCH: 'shape_mismatch'>
        >>> classify(RuntimeError("Trying to backward through the graph a second time (or directly access ...)"))
        <ErrorCategory.BACKWARD_TWICE: 'backward_twice'>
    """
    message = describe(error)
    if isinstance(error, OUT_OF_MEMORY) or "out of memory" in message.lower():
        return ErrorCategory.OOM
    checks = [
        (ErrorCategory.DEVICE_ASSERT, "device-side assert" in message),
        (ErrorCategory.DDP_UNUSED_PARAMETERS, "Expected to have finished reduction in the prior iteration" in message),
        (ErrorCategory.INPLACE_OPERATION, "inplace operation" in message or "in-place operation" in message),
        (ErrorCategory.BACKWARD_TWICE, "backward through the graph a second time" in message),
        (ErrorCategory.NO_GRAD, "does not require grad and does not have a grad_fn" in message),
        (ErrorCategory.INDEX_OUT_OF_RANGE, bool(_INDEX.search(message))),
        (ErrorCategory.DEVICE_MISMATCH, bool(_DEVICE.search(message)) or (
            "should be the same" in message and "cuda" in message.lower())),
        (ErrorCategory.DTYPE_MISMATCH, bool(_DTYPE.search(message))),
        (ErrorCategory.SHAPE_MISMATCH, bool(_SHAPE.search(message))),
    ]
    return next((category for category, matched in checks if matched), ErrorCategory.OTHER)


def _tensors(summaries: dict[str, dict[str, Any]], field: str = "shape") -> str:
    return ", ".join(f"`{name}` {summary[field]}" for name, summary in summaries.items())


InplaceReplay = Callable[[str, list[int]], "dict[str, Any] | None"]


def _no_replay(node: str, shape: list[int]) -> dict[str, Any] | None:
    return None


@dataclass
class Failure:
    """What the traceback shows about one error and the details being built; ``replay_inplace(node, shape)``
    finds an in-place operation by replaying the forward, ``trainable_names()`` lists them in DDP's order."""

    error: BaseException
    details: dict[str, Any]
    module: dict[str, Any] | None
    source: dict[str, Any] | None
    innermost: dict[str, dict[str, Any]]
    replay_inplace: InplaceReplay = _no_replay
    trainable_names: Callable[[], list[str]] = list
    labels: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return str(self.error)

    def located(self) -> str:
        module, source = self.module, self.source
        where = f" in module `{module['name'] or '(the model itself)'}` ({module['repr']})" if module else ""
        if source:
            where += (f"{',' if where else ''} at {source['file'].rsplit('/', 1)[-1]}:{source['line']} "
                      f"(`{source['code']}`)")
        return where

    def operands(self, field: str, wants: str = "") -> str:
        """The tensors involved and their ``field`` (shape, device, dtype); ``wants``: what the module expects."""
        module = self.module
        if module is not None and module["inputs"]:
            text = f"it was called with {_tensors(module['inputs'], field)}{wants}"
            owned = {**module["parameters"], **module["buffers"]}
            return text + (f"; its own tensors: {_tensors(owned, field)}" if owned else "") + "."
        chosen = self.innermost or (self.source or {}).get("tensors") or {}
        return f"the tensors involved: {_tensors(chosen, field)}." if chosen else ""


SENTENCES = {
    ErrorCategory.BACKWARD_TWICE: "this backward reached a part of the graph an earlier backward already freed: a "
                                  "tensor of the previous step (an RNN hidden state, a running loss) entering this "
                                  "step's graph, or two backward calls on one loss.",
    ErrorCategory.NO_GRAD: "the loss does not depend on any tensor that requires grad (detached, computed under "
                           "no_grad, or frozen).",
    ErrorCategory.DEVICE_ASSERT: "a CUDA kernel failed an assertion; in a loss this is almost always a class label "
                                 "outside [0, num_classes) (or a token id beyond the embedding size).",
    ErrorCategory.OOM: "see the `oom` finding and its post-mortem (MemoryProfilerCallback) for what held the memory.",
}


def explain_shapes(failure: Failure) -> str:
    """The operands' shapes and the sizes the failing module expects (``in_features``, ...)."""
    expects = failure.module["expects"] if failure.module is not None else {}
    wants = f" but expects {', '.join(f'{k}={v}' for k, v in expects.items())}" if expects else ""
    return failure.operands("shape", wants)


def explain_dtypes(failure: Failure) -> str:
    return failure.operands("dtype")


def explain_devices(failure: Failure) -> str:
    """The operands' devices (the two the message names go to ``details.devices``)."""
    match = _DEVICES.search(failure.text)
    if match:
        failure.details["devices"] = [device for device in match.groups() if device]
    return failure.operands("device")


def _labels_out_of_range(failure: Failure) -> str:
    found = failure.labels or {}
    declared = (failure.module or {}).get("num_labels")
    classes = found["num_classes"]
    failure.details.update(label=found["label"], num_classes=classes, label_index=found["index"],
                           labels_out_of_range=found["count"], logits_shape=found["logits_shape"],
                           labels_shape=found["labels_shape"])
    said = ""
    if declared is not None:
        failure.details["num_labels"] = declared["value"]
        said = f"; the model's `{declared['attribute']}` is {declared['value']}"
    others = f" ({found['count']} are out of range)" if found["count"] > 1 else ""
    low, high = found["labels_range"]
    return (f"a class label is {found['label']} but the model's output has {classes} classes (labels must be in "
            f"[0, {classes})): the logits have shape {found['logits_shape']}{said}; the labels the loss got have "
            f"shape {found['labels_shape']} and values {low}..{high}, the first out of range at index "
            f"{found['index']}{others}.")


def explain_index(failure: Failure) -> str:
    """A class label against the logits' class count, or an index against ``num_embeddings``."""
    if failure.labels:
        return _labels_out_of_range(failure)
    target = re.search(r"Target (-?\d+) is out of bounds", failure.text)
    logits = failure.innermost.get("input")
    if target and logits is not None and len(logits["shape"]) > 1:
        classes = logits["shape"][1]
        failure.details.update(label=int(target.group(1)), num_classes=classes)
        return (f"a class label is {target.group(1)} but the model's output has {classes} classes "
                f"(labels must be in [0, {classes})).")
    if failure.module is not None and "num_embeddings" in failure.module["expects"]:
        return f"an index is outside [0, {failure.module['expects']['num_embeddings']}) (num_embeddings)."
    return ""


def explain_inplace(failure: Failure) -> str:
    """The modified tensor (``details.modified``) and, when the replay finds it, the operation (``details.inplace``)."""
    details = failure.details
    match = _INPLACE.search(failure.text)
    if match is None:
        details["leaf"] = "leaf Variable" in failure.text
        return ("a parameter (a leaf tensor that requires grad) is modified in place: change it under "
                "`torch.no_grad()`, or use `x = x + y`." if details["leaf"] else "")
    shape = [int(v) for v in match["shape"].replace(" ", "").split(",") if v]
    details["modified"] = {"node": match["node"], "output": int(match["output"]), "shape": shape,
                           "saved_version": int(match["saved"]), "version": int(match["now"])}
    found = failure.replay_inplace(match["node"], shape)
    subject = f"the output of `{match['node']}` (a {shape} tensor) that the backward needs"
    if found is None:
        return (f"an in-place operation modified {subject} after the forward saved it (version "
                f"{match['saved']} -> {match['now']}); look for `x += y`, `x[i] = v`, `.add_()` or "
                "`inplace=True` applied to it and use `x = x + y`.")
    details["inplace"] = found
    if found["module"]:
        details["modules"] = [found["module"]]
    place = found["source"]
    line = f" at {place['file'].rsplit('/', 1)[-1]}:{place['line']} (`{place['code']}`)" if place else ""
    owner = f"module `{found['module']}` ({found['module_type']})" if found["module"] else "the model's forward"
    return (f"`{found['operation']}`{line} in {owner} modified {subject}, found by replaying the forward; use "
            "the out-of-place form (`x = x + y` instead of `x += y`) or `.clone()` first.")


def explain_unused_parameters(failure: Failure) -> str:
    """The parameters DDP names (or numbers, mapped through ``trainable_names()``) as unused."""
    named = _DDP_NAMES.search(failure.text)
    indexed = _DDP_INDICES.search(failure.text)
    names: list[str] = []
    if named:
        names = [name.strip() for name in named.group(2).split(",") if name.strip()]
    elif indexed:
        indices = [int(v) for v in indexed.group(2).split()]
        trainable = failure.trainable_names()
        names = [trainable[i] for i in indices if i < len(trainable)]
        failure.details["indices"] = indices
    failure.details["parameters"] = names[:NAMES_SHOWN]
    if not names:
        return "some parameters received no gradient in the previous step."
    shown = ", ".join(f"`{name}`" for name in names[:NAMES_SHOWN])
    return (f"{len(names)} parameter(s) received no gradient in the previous step, so DDP could not finish "
            f"its reduction: {shown}. Use them in forward, remove or freeze them, or let DDP find unused "
            "parameters (`find_unused_parameters=True`).")


EXPLAINERS: dict[ErrorCategory, Callable[[Failure], str]] = {
    ErrorCategory.SHAPE_MISMATCH: explain_shapes, ErrorCategory.DEVICE_MISMATCH: explain_devices,
    ErrorCategory.DTYPE_MISMATCH: explain_dtypes, ErrorCategory.INDEX_OUT_OF_RANGE: explain_index,
    ErrorCategory.INPLACE_OPERATION: explain_inplace,
    ErrorCategory.DDP_UNUSED_PARAMETERS: explain_unused_parameters,
}


def explain_error(step: int, error: BaseException, module: dict[str, Any] | None = None,
                  source: dict[str, Any] | None = None, innermost: dict[str, dict[str, Any]] | None = None,
                  replay_inplace: InplaceReplay = _no_replay,
                  trainable_names: Callable[[], list[str]] = list,
                  labels: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``exception`` event of a training-step error; never guessed: with nothing to read, only what PyTorch said
    and the category's advice::

        >>> explained = explain_error(3, RuntimeError(
        ...     "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"))
        >>> explained["category"], explained["details"]["devices"]
        ('device_mismatch', ['cuda:0', 'cpu'])
    """
    category = classify(error)
    innermost = innermost or {}
    text = describe(error).strip()
    first_line = text.splitlines()[0][:300] if text else type(error).__name__
    details: dict[str, Any] = {"category": category.value, "error_type": type(error).__name__,
                               "error": text[:2000], "module": module, "source": source}
    if module is not None:
        details["modules"] = [module["name"]]
    if innermost:
        details["tensors"] = innermost
    failure = Failure(error, details, module, source, innermost, replay_inplace, trainable_names, labels)
    explain = EXPLAINERS.get(category)
    what = explain(failure) if explain is not None else SENTENCES.get(category, "")
    message = (f"{type(error).__name__} at step {step} ({category.value}){failure.located()}: "
               + (f"{what} " if what else "") + f"PyTorch says: {first_line}")
    return {"step": step, "category": category.value, "message": message, "advice": ERROR_ADVICE[category],
            "details": details}


class ErrorMonitor(Monitor):
    """Explains the exception that ends a run (see the module docstring); one per run, whatever the callbacks."""

    area = Area.ERRORS
    events = frozenset({Event.START, Event.BATCH_START, Event.EXCEPTION})

    def __init__(self, config: DebugConfig, source: str = "lightning-debug") -> None:
        super().__init__(config, source)
        self.explanations: list[dict[str, Any]] = []
        self._captured: Any = None
        self._trainable_at_start: list[str] = []

    def start(self, step: int) -> None:
        """The trainable parameters at the start: the list DDP's reducer numbers, whatever is unfrozen later."""
        self._trainable_at_start = [name for name, p in self.context.named_parameters() if p.requires_grad]

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), _captured=None)

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        self._captured = captured

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        if not isinstance(error, Exception) or isinstance(error, AnomalyError):
            return  # an interrupt is no error to explain; AnomalyError is this package's own report
        module = failing_module(error, self.context.module())
        labels = self._labels(error)
        explanation = explain_error(
            step, error, module, failing_source(error), innermost_tensors(error) if module is None else {},
            self._replay_inplace,
            lambda: self._trainable_at_start or [name for name, p in self.context.named_parameters() if p.requires_grad],
            labels)
        self.explanations = (self.explanations + [explanation])[-EXPLANATIONS_KEPT:]
        self.emit(Finding(Kind.EXCEPTION, Severity.ERROR, explanation["message"], explanation["details"]), step)
        if not self.session.is_global_zero:
            self.session.write_document("exception", step, dict(explanation, document="exception"))

    @staticmethod
    def _labels(error: BaseException) -> dict[str, Any] | None:
        if classify(error) is not ErrorCategory.INDEX_OUT_OF_RANGE:
            return None
        try:
            return out_of_range_labels(error)
        except Exception:  # reading the labels is a best effort on a run that already failed
            return None

    def _replay_inplace(self, node: str, shape: list[int]) -> dict[str, Any] | None:
        context = self.context
        model, replay, captured = context.module(), context.replay(), self._captured
        if model is None or replay is None or captured is None or context.world_size > 1:
            return None
        try:
            return find_inplace(model, lambda: replay(captured), node, shape)
        except Exception:  # the replay is a best effort on a run that already failed
            return None

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), explanations=list(self.explanations))
