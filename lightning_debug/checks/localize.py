"""Find where a NaN/Inf came from by replaying one step under temporary instrumentation; never on a healthy step.

:func:`localize` looks at the batch, the forward (:mod:`.firstnan`) and the backward in turn (docs/anomaly.md,
"Naming the cause"), with the RNG streams and module buffers restored around the replays.
"""

from __future__ import annotations

import contextlib
import enum
import os
import random
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.batches import floating_tensors, nonfinite_samples
from lightning_debug.checks.firstnan import OpEvent, OpWatch, first_nonfinite_backward, nonfinite_tensors, numeric
from lightning_debug.checks.numerics import user_name

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, contextlib))
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIPPED_PATH_PARTS = (os.sep + "lightning" + os.sep, os.sep + "lightning_fabric" + os.sep,
                       os.sep + "pytorch_lightning" + os.sep, os.sep + "accelerate" + os.sep)
_DEMO = os.path.join(_OWN_DIR, "demo.py")  # the demo's model is user code, though it ships in the package


def user_source(frames: list[traceback.FrameSummary]) -> dict[str, Any] | None:
    """The innermost frame of the user's own code (not torch, Lightning, Accelerate or this package)."""
    for frame in reversed(frames):
        name = frame.filename
        own = name.startswith(_OWN_DIR) and name != _DEMO
        if not (own or name.startswith((*_LIBRARY_DIRS, "<")) or any(part in name for part in _SKIPPED_PATH_PARTS)):
            return {"file": frame.filename, "line": frame.lineno, "function": frame.name, "code": (frame.line or "").strip()}
    return None


def operation_name(func: Any) -> str:
    """``torch.sqrt``, ``Tensor.add``, ``torch.nn.functional.linear`` rather than internal class paths."""
    name = getattr(func, "__name__", None) or str(func)
    qualname = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", "") or ""
    if module.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if "Tensor" in qualname.split(".")[0]:
        return f"Tensor.{name}"
    if qualname.startswith("_VariableFunctions") or module in ("torch", "torch.functional"):
        return f"torch.{name}"
    return f"{module}.{qualname}" if module and qualname else name


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def output_scalar(output: Any) -> torch.Tensor | None:
    """What a replayed forward is judged by: the model's own ``loss`` when it returns one (Hugging
    Face models given labels do), else the sum of its floating-point outputs.

    >>> output_scalar({"loss": torch.tensor(2.0), "logits": torch.ones(3)}).item()
    2.0
    >>> output_scalar((torch.ones(2), torch.arange(3))).item()
    2.0
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    floating = [t for t in tensors_in(output if not hasattr(output, "to_tuple") else output.to_tuple())
                if t.is_floating_point()]
    return torch.stack([t.float().sum() for t in floating]).sum() if floating else None


_replays = 0


def is_replaying() -> bool:
    """True while lightning-debug replays a step to name the cause of a NaN (``level=ADVANCED``): the user's own
    counters and metric updates would see the batch twice (docs/anomaly.md).

    >>> is_replaying()
    False
    """
    return _replays > 0


@contextlib.contextmanager
def _replaying() -> Iterator[None]:
    global _replays
    _replays += 1
    try:
        yield
    finally:
        _replays -= 1


def value_summary(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Shape, non-finite count and largest finite magnitude of a few tensors (rare path)."""
    checked = [t.detach() for t in tensors if numeric(t)]
    if not checked:
        return {}
    finite_max = 0.0
    nonfinite = 0
    for t in checked:
        data = t.abs().double() if t.is_complex() else t.double()
        mask = torch.isfinite(data)
        nonfinite += int((~mask).sum())
        if mask.any():
            finite_max = max(finite_max, float(data[mask].abs().max()))
    return {"shapes": [list(t.shape) for t in checked][:4], "nonfinite_count": nonfinite, "max_abs": finite_max}


class CauseSite(str, enum.Enum):
    """Where a replay found the first non-finite value (its value is what events.jsonl holds).

    >>> CauseSite("forward") is CauseSite.FORWARD, CauseSite.ERROR.names_a_cause
    (True, False)
    """

    INPUTS = "inputs"
    PARAMETERS = "parameters"
    FORWARD = "forward"
    BACKWARD = "backward"
    NOT_REPRODUCED = "not_reproduced"
    ERROR = "error"

    @property
    def names_a_cause(self) -> bool:
        """Whether the replay reproduced the NaN/Inf (it is neither ``not_reproduced`` nor ``error``)."""
        return self not in (CauseSite.NOT_REPRODUCED, CauseSite.ERROR)


@dataclass
class Cause:
    """What a replay found: ``where`` (a :class:`CauseSite`), a sentence, and the operation, module and values.

    >>> cause = Cause(CauseSite.BACKWARD, "the backward of `sqrt` produced NaN", operation="SqrtBackward0")
    >>> cause.to_dict()
    {'where': 'backward', 'summary': 'the backward of `sqrt` produced NaN', 'operation': 'SqrtBackward0', 'replay_ms': 0.0}
    >>> Cause.from_dict(cause.to_dict()) == cause
    True
    """

    where: CauseSite
    summary: str
    module: str | None = None
    module_type: str | None = None
    operation: str | None = None
    kernel: str | None = None
    source: dict[str, Any] | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    replay_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``where`` as its string); fields that say nothing are left out."""
        return {k: v.value if isinstance(v, CauseSite) else v for k, v in asdict(self).items()
                if v not in (None, {}, "")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cause:
        """The cause :meth:`to_dict` wrote (as gathered from another rank)."""
        return cls(**dict(data, where=CauseSite(data["where"])))


@contextlib.contextmanager
def module_stack(model: nn.Module) -> Iterator[list[tuple[str, nn.Module, Any]]]:
    """While inside, the stack of ``(name, module, inputs)`` of the modules of ``model`` now running."""
    stack: list[tuple[str, nn.Module, Any]] = []
    handles = []
    for name, module in model.named_modules():
        name = user_name(name)

        def enter(module: nn.Module, args: Any, name: str = name) -> None:
            stack.append((name, module, args))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if stack:
                stack.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore torch's, Python's and NumPy's RNG streams and every buffer of ``model`` on exit: a ``training_step``
    that draws ``random.random()`` draws the same numbers after a replay as without it."""
    numpy = sys.modules.get("numpy")
    host_rng = random.getstate(), numpy.random.get_state() if numpy is not None else None
    torch_rng = capture_rng()
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        random.setstate(host_rng[0])
        if numpy is not None:
            numpy.random.set_state(host_rng[1])
        _set_rng(torch_rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _set_rng(rng: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state_all(rng[1])


def capture_rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The RNG state to replay a step with (call where the step starts; host-side, no device sync)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def _backward_cause(run: Callable[[], torch.Tensor | None], parameters: list[nn.Parameter]) -> Cause | None:
    found = first_nonfinite_backward(run, parameters)
    if found is None:
        return None
    backward, what, trace = found
    frames = [traceback.FrameSummary(f, int(n), fn, line=code) for f, n, fn, code in _FRAME.findall(trace)]
    source = user_source(frames) if frames else None
    where = f" at {os.path.basename(source['file'])}:{source['line']} (`{source['code']}`)" if source else ""
    forward = backward.removesuffix("Backward0").removesuffix("Backward1").lower()
    return Cause(CauseSite.BACKWARD, f"the backward of `{forward}` ({backward}) produced {what} from finite "
                 f"gradients; its forward call is{where}", operation=backward, source=source)


def localize(model: nn.Module, batch: Any, replay: Callable[[], torch.Tensor | None],
             rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None, check_backward: bool,
             same_work: bool = False) -> Cause:
    """Replay one step and say where the first non-finite value came from.

    ``replay`` recomputes the step's loss (forward only); ``rng``: the RNG state at the step's start, for dropout;
    ``check_backward``: also localize a backward-only NaN; ``same_work``: call ``replay`` the same number of times
    whatever is found, so that collectives inside the step still match when every process replays its own step.
    """
    started = time.perf_counter()
    parameters = [p for p in model.parameters() if p.requires_grad]
    with _eager(), _replaying():
        cause = _localize(model, batch, replay, rng, check_backward, parameters, same_work)
    cause.replay_ms = (time.perf_counter() - started) * 1e3
    return cause


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Run ``torch.compile``d modules eagerly during the replay: tracing the instrumentation would break
    the graph at every check (and recompile), and the eager run is what names the user's source line."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    # torch < 2.6: compiled modules are replayed compiled
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _before_the_forward(model: nn.Module, batch: Any) -> Cause | None:
    batch_tensors = tensors_in(batch)
    if nonfinite_tensors(batch_tensors):
        bad = [(name, *nonfinite_samples(t)) for name, t in floating_tensors(batch) if nonfinite_tensors([t])]
        samples = bad[0][1] if bad else []
        return Cause(CauseSite.INPUTS, "the batch itself contains NaN/Inf (inputs)"
                     + (f" in samples {samples}" if samples else "") + ": check the data pipeline "
                     "(missing values, division by a zero std in normalization, corrupt samples)",
                     inputs=dict(value_summary(batch_tensors), samples=samples,
                                 tensors=[{"tensor": name, "samples": rows, "count": count} for name, rows, count in bad]))
    bad_parameters = [user_name(name) for name, p in model.named_parameters() if nonfinite_tensors([p])]
    if bad_parameters:
        return Cause(CauseSite.PARAMETERS, f"parameters are already non-finite before the forward: {', '.join(bad_parameters[:5])}",
                     module=bad_parameters[0])
    return None


def _place(event: OpEvent) -> tuple[str, str]:
    """`` at model.py:22 (`code`)`` and the module text (the top-level model, or the loss outside it)."""
    where = event.source
    line = f" at {os.path.basename(where['file'])}:{where['line']} (`{where['code']}`)" if where else ""
    function = f"`{where['function']}`" if where else "the training step"
    module = (f"module `{event.module}` ({event.module_type})" if event.module
              else f"{function}, outside the model's modules (the loss computation)" if not event.module_type
              else f"the forward of the top-level {event.module_type}, outside its submodules")
    return line, module


def forward_summary(event: OpEvent, other: OpEvent | None) -> str:
    """The sentence for a forward cause (see :meth:`OpWatch.verdict` for ``other``)."""
    line, module = _place(event)
    if event.masked_rows:
        count, rows = event.masked_rows
        came = f"; the -inf came from {other.label}{_place(other)[0]}" if other is not None else ""
        return (f"{event.label}{line} in {module} produced NaN: softmax over a row that is entirely -inf "
                f"(a fully masked row; {count} of {rows} rows){came}")
    if not event.inputs_finite:
        return (f"{event.label}{line} in {module} produced NaN from inputs that held Inf but no NaN (an infinity "
                "put there on purpose, such as a -inf mask, that this operation cannot absorb)")
    max_in = event.inputs.get("max_abs")
    before = " (read before it overwrote them)" if event.in_place else ""
    inputs = f"; its inputs had max |x| = {max_in:.3g}" if max_in is not None and not event.in_place else ""
    then = f"; {other.label}{_place(other)[0]} then turned the Inf into NaN" if other is not None else ""
    return f"{event.label}{line} in {module} produced NaN/Inf from finite inputs{before}{inputs}{then}"


def _forward_cause(model: nn.Module, replay: Callable[[], torch.Tensor | None]) -> Cause | None:
    with torch.no_grad(), module_stack(model) as stack:
        def running() -> tuple[str, str | None]:
            return (stack[-1][0], type(stack[-1][1]).__name__) if stack else ("", None)

        with OpWatch(running, operation_name, value_summary, user_source) as watch:
            loss = replay()
    loss_nan = not isinstance(loss, torch.Tensor) or bool(torch.isnan(loss.detach()).any())
    verdict = watch.verdict(loss_has_nan=loss_nan)
    if verdict is not None and watch.first_nan is None and isinstance(loss, torch.Tensor) and not nonfinite_tensors([loss]):
        verdict = None  # only infinities the forward absorbed (a -inf mask, T5's log(0) bucket): the NaN is not here
    if verdict is not None:
        event, other = verdict
        inputs = dict(event.inputs, **({"fully_masked_rows": event.masked_rows[0], "rows": event.masked_rows[1]}
                                       if event.masked_rows else {}))
        return Cause(CauseSite.FORWARD, forward_summary(event, other), module=event.module or None,
                     module_type=event.module_type, operation=event.operation, kernel=event.kernel,
                     source=event.source, inputs=inputs, outputs=event.outputs)
    if loss is not None and nonfinite_tensors([loss]):
        return Cause(CauseSite.FORWARD, "the loss is non-finite but no single operation produced it from finite inputs")
    return None


def _localize(model: nn.Module, batch: Any, replay: Callable[[], torch.Tensor | None],
              rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None, check_backward: bool,
              parameters: list[nn.Parameter], same_work: bool) -> Cause:
    early = _before_the_forward(model, batch)
    if early is not None and not same_work:
        return early
    backward: Cause | None = None
    with preserved_state(model):
        if rng is not None:
            _set_rng(rng)
        forward = _forward_cause(model, replay)
        if check_backward and (same_work or forward is None):
            if rng is not None:
                _set_rng(rng)
            backward = _backward_cause(replay, parameters)
    return early or forward or backward or Cause(
        CauseSite.NOT_REPRODUCED, "replaying the step gave finite values: the NaN depends on state the replay cannot "
        "reproduce (non-deterministic kernels, data changed in place, Python/NumPy random numbers)")
