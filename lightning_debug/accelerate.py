"""AccelerateDebugger: the lightning-debug checks in a plain Hugging Face Accelerate loop.

The Lightning callbacks get their moments (batch start, before backward, before the optimizer
step, batch end) from Lightning hooks. A hand-written Accelerate loop has no hooks, so this adapter
takes them from what every such loop already does: it calls the model, replaces
``accelerator.backward(loss)`` by :meth:`AccelerateDebugger.backward`, and steps the optimizer.
The model's forward pre-hook marks a batch's start, ``backward`` the loss and the gradients, and
the torch optimizer's step post-hook the step's end. Everything else (the checks, events.jsonl,
the report, the logged scalars) is the framework-free code the callbacks drive, so a finding reads
the same in both worlds.

Example::

    from accelerate import Accelerator
    from lightning_debug import DebugConfig
    from lightning_debug.accelerate import AccelerateDebugger

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("exp")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    debugger = AccelerateDebugger(accelerator, model, optimizer, DebugConfig(anomaly_detection_mode="skip"))
    for x, y in loader:
        loss = loss_fn(model(x), y)
        debugger.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if debugger.should_stop:
            break
    debugger.finish()
    accelerator.end_training()
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from lightning_debug.checks.localize import tensors_in
from lightning_debug.checks.memory import is_out_of_memory
from lightning_debug.config import DebugConfig, resolve_config
from lightning_debug.core.guard import CheckFailures, guarded
from lightning_debug.core.session import DebugSession
from lightning_debug.core.step_numerics import AllGather, StepNumerics
from lightning_debug.monitors.anomaly import AnomalyMonitor
from lightning_debug.monitors.gradients import GradientMonitor, HistogramWriter
from lightning_debug.monitors.memory import MemoryMonitor
from lightning_debug.monitors.performance import PerformanceMonitor
from lightning_debug.presets import CALLBACKS_BY_MODE

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["AccelerateDebugger"]

SOURCE = "AccelerateDebugger"
SizeFn = Callable[[Any], int]


def resolve_output_dir(accelerator: "Accelerator", config: DebugConfig) -> Path | None:
    """``debug_output_dir``; a relative path goes under the accelerator's logging (or project) directory,
    or the working directory when it has neither."""
    if not config.save_debug_info:
        return None
    path = Path(config.debug_output_dir).expanduser()
    if not path.is_absolute():
        base = accelerator.logging_dir or accelerator.project_dir
        path = (Path(base) if base else Path.cwd()) / path
    return path


def accelerate_sink(accelerator: "Accelerator") -> Callable[[dict[str, float], int], None]:
    """Scalars to every tracker the user configured (looked up per write, so trackers started after
    the debugger count too); nothing while there is none."""

    def sink(metrics: dict[str, float], step: int) -> None:
        if accelerator.trackers:
            accelerator.log(metrics, step=step)

    return sink


def all_gather_for(accelerator: "Accelerator") -> AllGather | None:
    if accelerator.num_processes <= 1:
        return None
    return lambda tensor: accelerator.gather(tensor)


def grads_are_sharded(accelerator: "Accelerator") -> bool:
    return getattr(accelerator.distributed_type, "name", "") == "FSDP"


def histogram_writer_for(accelerator: "Accelerator") -> tuple[HistogramWriter | None, str]:
    """A writer for the first tracker that can write raw histograms (TensorBoard's SummaryWriter)."""
    names = ", ".join(type(tracker).__name__ for tracker in accelerator.trackers) or "no tracker"
    for tracker in accelerator.trackers:
        writer = getattr(tracker, "writer", None) or getattr(tracker, "tracker", None)
        add_histogram_raw = getattr(writer, "add_histogram_raw", None)
        if callable(add_histogram_raw):
            def write(tag: str, histogram: dict[str, Any], step: int, _add: Any = add_histogram_raw) -> None:
                _add(tag, global_step=step, **histogram)
            return write, names
    return None, names


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` wrapper(s)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # type: ignore[attr-defined]
    return optimizer


def enabled_areas(config: DebugConfig) -> set[str]:
    """Names of the Lightning callbacks ``config.mode`` enables: the same areas are enabled here."""
    return {callback.__name__ for callback in CALLBACKS_BY_MODE[config.mode]}


def replay_scalar(output: Any) -> torch.Tensor | None:
    """What a replayed forward is judged by: the model's own ``loss`` when it returns one (Hugging
    Face models given labels do), else the sum of its floating-point outputs."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    floating = [t for t in tensors_in(output if not hasattr(output, "to_tuple") else output.to_tuple())
                if t.is_floating_point()]
    return torch.stack([t.float().sum() for t in floating]).sum() if floating else None


def batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the model was called with, as the batch (its first tensor's dimension 0 counts samples)."""
    if args:
        return args[0] if len(args) == 1 else args
    return kwargs or None


class AccelerateDebugger:
    """NaN/Inf detection, gradient health, memory and performance checks for an Accelerate loop.

    Three lines turn them on: build the debugger after ``accelerator.prepare``, call
    :meth:`backward` instead of ``accelerator.backward``, and call :meth:`finish` after the loop
    (before ``accelerator.end_training()``). The areas that run follow ``config.mode`` exactly as
    :func:`~lightning_debug.debug_callbacks` does, with the same frequencies, levels, events and
    ``debug/...`` scalar names; scalars go through ``accelerator.log`` to every configured tracker
    (TensorBoard also gets the histograms), and events.jsonl and report.json/report.md are written
    by the main process only, under ``<logging_dir or project_dir>/<debug_output_dir>``.

    **Steps.** :attr:`step` counts real optimizer steps: the :meth:`backward` calls made while
    ``accelerator.sync_gradients`` was True. Under ``accelerator.accumulate(model)`` the
    micro-batches in between only contribute their loss to the check, and gradients are checked
    once, on the micro-batch whose gradients the optimizer will use. Checks, events and scalars are
    labelled with the 0-based index of that optimizer step, as ``trainer.global_step`` labels them
    in Lightning, and the frequencies count these steps.

    **Modes.** ``anomaly_detection_mode`` acts inside :meth:`backward`: ``"raise"`` raises
    :class:`~lightning_debug.AnomalyError` (on every process, at the same step); ``"skip"`` drops the
    gradients so that the following ``optimizer.step()`` changes nothing (no update, no momentum, no
    weight decay); ``"stop"`` does the same and sets :attr:`should_stop`, which the loop reads.
    Decisions use the flags of every process (gathered once per check step), so all processes
    decide the same at the same step. From ``level=ADVANCED`` the first step of an anomaly episode
    is replayed through the unwrapped model with the inputs it was called with, to name the
    operation and module that produced the NaN (a NaN made by the loss computation outside the
    model is reported as not reproduced: the loop's loss function is not known here).

    **Mixed precision.** With fp16 and a GradScaler the gradients are still scaled right after
    backward (Accelerate unscales in ``clip_grad_norm_`` or ``optimizer.step()``). They are left
    as they are (unscaling here would make your ``clip_grad_norm_`` fail); their norms are divided
    by the current scale on the device, so thresholds and ``debug/grad/*`` scalars are about the true
    gradients. Gradient histograms (``log_gradients``) are of the scaled gradients. Non-finite
    gradients with a finite loss are the scaler's own overflow handling: ``amp_overflow_skipped``,
    never raised. In skip/stop mode a dropped step is handed to the scaler as an overflow (it skips
    the step and lowers its scale, as for any NaN gradient).

    **Timing.** A batch starts at the model's first training forward call (a forward pre-hook on
    ``model``), backward starts in :meth:`backward`, the optimizer phase runs from the end of
    backward to the end of the torch optimizer's ``step`` (a step post-hook), and the data wait is
    the rest: from the previous step's end (``zero_grad`` included) to the next forward. A forward
    in eval mode or under ``torch.no_grad()`` restarts the data clock when it returns, so an
    evaluation between training steps is not counted as data wait (only what follows its last
    forward is).

    Args:
        accelerator: The run's ``Accelerator``.
        model: The model returned by ``accelerator.prepare`` (parameter names are taken from the
            unwrapped model, so they match ``named_parameters()`` of your own module).
        optimizer: The optimizer returned by ``accelerator.prepare``.
        config: The checks' settings; None means the defaults.
        train_dataloader: The training DataLoader, quoted in ``dataloader_bottleneck`` advice
            (default: the first DataLoader given to ``accelerator.prepare``).
        batch_size_fn: ``batch -> samples`` when dimension 0 of the model input's first tensor is not it.
        tokens_fn: ``batch -> tokens``, to log ``debug/perf/tokens_per_sec``; the batch is what the
            model is called with (the single positional argument, the tuple of them, or the keywords).
        **overrides: :class:`~lightning_debug.DebugConfig` fields to change, e.g.
            ``anomaly_detection_mode="skip"``.

    Example::

        >>> import torch
        >>> from accelerate import Accelerator
        >>> from lightning_debug.accelerate import AccelerateDebugger
        >>> accelerator = Accelerator(cpu=True)
        >>> model = torch.nn.Linear(2, 1)
        >>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> debugger = AccelerateDebugger(accelerator, model, optimizer, save_debug_info=False)
        >>> debugger.backward(model(torch.ones(4, 2)).pow(2).mean()); optimizer.step(); debugger.step
        1
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):  # finish() also prints a one-screen summary
        ...     report = debugger.finish()
        >>> report["status"], report["last_step"]
        ('finished', 1)
    """

    def __init__(self, accelerator: "Accelerator", model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: DebugConfig | None = None, *, train_dataloader: Any = None,
                 batch_size_fn: SizeFn | None = None, tokens_fn: SizeFn | None = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.module: torch.nn.Module = accelerator.unwrap_model(model)
        self.step = 0
        self.epoch = 0
        self.batch = 0
        self.should_stop = False
        self._finished = False
        self._flushed_before = 0
        self._batch_open = False
        self._awaiting_step_end = False
        self._batch_step = 0
        self._batch_where: dict[str, int] = self.where
        self._batch: Any = None
        self._post_mortem_done: int | None = None
        self._replaying = False
        self._hook_handles: list[Any] = []
        self._all_gather = all_gather_for(accelerator)
        self._grads_sharded = grads_are_sharded(accelerator)
        self.output_dir = resolve_output_dir(accelerator, self.config)
        self.session = DebugSession(self.output_dir, accelerator.is_main_process, accelerate_sink(accelerator),
                                    self.config.to_dict())
        areas = enabled_areas(self.config)
        self.anomalies = AnomalyMonitor(self.config, SOURCE) if "AnomalyDetectionCallback" in areas else None
        self.gradients = GradientMonitor(self.config, SOURCE) if "GradientHealthCallback" in areas else None
        self.memory = MemoryMonitor(self.config, SOURCE) if "MemoryProfilerCallback" in areas else None
        self.performance = (PerformanceMonitor(self.config, SOURCE, batch_size_fn=batch_size_fn, tokens_fn=tokens_fn)
                            if "PerformanceProfilerCallback" in areas else None)
        for monitor in self._monitors().values():
            monitor.attach(self.session)
        self._start(train_dataloader)

    # --- what the loop calls ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward(loss, **kwargs)`` with the checks around it.

        Before backward the loss is checked (without a host sync); after the backward of a real
        optimizer step (``accelerator.sync_gradients``) the gradients and parameters are checked,
        and the anomaly mode acts before the ``optimizer.step()`` that follows. An out-of-memory
        error in backward leaves a post-mortem before it propagates unchanged.
        """
        if self._finished:
            self.accelerator.backward(loss, **kwargs)
            return
        real_step = bool(self.accelerator.sync_gradients)
        self._before_backward(loss)
        try:
            self.accelerator.backward(loss, **kwargs)
        except BaseException as error:
            self._post_mortem(error)
            raise
        self._after_backward(real_step)
        self._advance(real_step)

    def finish(self, error: BaseException | None = None) -> dict[str, Any] | None:
        """Deliver pending measurements, log the last scalars, write report.json and report.md.

        Call it once after the loop, before ``accelerator.end_training()`` (the trackers must still
        be open), on every process (only the main one writes). Pass the exception when the loop
        failed (the report then says ``failed``; an out-of-memory error gets its post-mortem), or
        use the debugger as a context manager, which does both. Returns the report; later calls
        return None, and :meth:`backward` is then plain ``accelerator.backward``.
        """
        if self._finished:
            return None
        self._finished = True
        status = "finished" if error is None else "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        try:
            if error is not None:
                self._post_mortem(error)
            self._finalize()
        finally:
            report = self._write_report(status, None if error is None else f"{type(error).__name__}: {error}")
            self._restore()
        return report

    def __enter__(self) -> "AccelerateDebugger":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.finish(exc)

    # --- what the checks see ---------------------------------------------------------------------
    @property
    def uses_grad_scaler(self) -> bool:
        return getattr(self.accelerator, "scaler", None) is not None

    @property
    def where(self) -> dict[str, int]:
        """The position recorded with events: the epoch (counted each time a prepared DataLoader ends)
        and the batch (micro-batch index within it)."""
        return {"epoch": self.epoch, "batch": self.batch}

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def step_numerics(self) -> StepNumerics:
        """This optimizer step's shared gradient/parameter pass (computed once for all checks).

        Every process calls it at the same steps (it gathers the per-process flags). Under an fp16
        GradScaler the norms are divided by the scale the gradients still carry.
        """
        return self.session.step_numerics(self.step, self.named_parameters, self._all_gather, self._grads_sharded,
                                          self._grad_scale())

    # --- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters and open episodes; ``accelerator.register_for_checkpointing(debugger)`` saves them."""
        state: dict[str, Any] = {"step": self.step, "epoch": self.epoch}
        for name, monitor in self._monitors().items():
            state[name] = monitor.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict.get("step", self.step))
        self.epoch = int(state_dict.get("epoch", self.epoch))
        self._flushed_before = self.step
        for name, monitor in self._monitors().items():
            if name in state_dict:
                monitor.load_state_dict(state_dict[name])

    # --- internals: start and end ----------------------------------------------------------------
    def _monitors(self) -> dict[str, Any]:
        found = {"anomaly": self.anomalies, "gradients": self.gradients, "memory": self.memory,
                 "performance": self.performance}
        return {name: monitor for name, monitor in found.items() if monitor is not None}

    def _safely(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One monitor call, isolated: a failing check warns once and the other areas and training go
        on (the Lightning callbacks get the same isolation from being separate callbacks).
        :class:`~lightning_debug.AnomalyError` passes through."""
        owner = getattr(call, "__self__", None)
        name = (f"{type(owner).__name__}.{getattr(call, '__name__', '?')}" if owner is not None
                else getattr(call, "__qualname__", repr(call)))
        failures = self.__dict__.setdefault("_check_failures", CheckFailures())
        return failures.call(name, call, *args, **kwargs)

    @guarded
    def _start(self, train_dataloader: Any) -> None:
        accelerator = self.accelerator
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > accelerator.num_processes:
            warnings.warn(
                f"lightning-debug: the launcher started {launched} processes (WORLD_SIZE) but the Accelerator runs "
                f"{accelerator.num_processes} ({accelerator.distributed_type}): every process trains alone and "
                "writes the same debug files. Without GPUs, create it with Accelerator(cpu=True).",
                RuntimeWarning, stacklevel=3)
        if self.anomalies is not None:
            self._safely(self.anomalies.start, uses_grad_scaler=self.uses_grad_scaler)
        if accelerator.is_main_process:
            self._safely(self._attach_tensorboard)
        if self.gradients is not None:
            self._safely(self._start_gradients)
        if self.memory is not None:
            self.memory.postmortem_dir = self.output_dir
            self.memory.rank = accelerator.process_index
            self._safely(self.memory.start, accelerator.device)
        if self.performance is not None:
            if train_dataloader is None:
                train_dataloader = next(iter(getattr(accelerator, "_dataloaders", None) or []), None)
            self._safely(self.performance.start, device=accelerator.device, world_size=accelerator.num_processes,
                         rank=accelerator.process_index, all_gather=self._all_gather, loader=train_dataloader)
        localizes = self.anomalies is not None and self.anomalies.localizes
        if self.memory is not None or self.performance is not None or localizes:
            self._hook_handles.append(self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        if self.performance is not None:
            self._hook_handles.append(self.model.register_forward_hook(self._on_forward_end))
        if self.performance is not None or (self.gradients is not None and self.gradients.measures_updates):
            optimizer = inner_optimizer(self.optimizer)
            if hasattr(optimizer, "register_step_post_hook"):
                self._hook_handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    def _start_gradients(self) -> None:
        assert self.gradients is not None
        writer, trackers = histogram_writer_for(self.accelerator) if self.accelerator.is_main_process else (None, "")
        self.gradients.start(self.named_parameters(), self.optimizer.param_groups, self.step, self.where,
                             histogram_writer=writer, histogram_logger=trackers)
        self.gradients.watch_forward(self.module)

    def _attach_tensorboard(self) -> None:
        """The ``debug/`` charts grouped in TensorBoard's Custom Scalars tab, and events as text entries."""
        from lightning_debug.tensorboard import attach_to_writer

        for tracker in self.accelerator.trackers:
            writer = getattr(tracker, "writer", None)
            if writer is not None:
                attach_to_writer(writer, self.session, getattr(tracker, "logging_dir", None))

    @guarded
    def _finalize(self) -> None:
        self._end_pending_batch()
        self._after_optimizer_step()
        self._safely(self.session.poll, final=True)
        last_step, where = max(self.step - 1, 0), self.where
        if self.anomalies is not None:
            self._safely(self.anomalies.finalize, self.named_parameters(), last_step, where)
        for monitor in (self.gradients, self.memory, self.performance):
            if monitor is not None:
                self._safely(monitor.finalize, last_step, where)

    @guarded
    def _write_report(self, status: str, error: str | None) -> dict[str, Any]:
        return self.session.finish(status, self.step, error)

    @guarded
    def _restore(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        if self.gradients is not None:
            self._safely(self.gradients.order.stop)
        for monitor in (self.anomalies, self.memory, self.performance):
            if monitor is not None:
                self._safely(monitor.restore)

    # --- internals: one batch --------------------------------------------------------------------
    @guarded
    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: a training forward opens a batch (the data wait ends)."""
        if self._replaying:
            return
        if not (module.training and torch.is_grad_enabled()):
            if self.memory is not None and self.memory.current_phase != "validation":
                self._safely(self.memory.phase, "validation", self.step)
            return
        self._end_pending_batch()
        if not self._batch_open:
            self._open_batch(batch_of(args, kwargs))
        if self.anomalies is not None:
            self._safely(self.anomalies.capture_inputs, self.step, (args, kwargs))

    @guarded
    def _on_forward_end(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook: an evaluation forward is no data wait of the next training step."""
        if not (self._replaying or module.training and torch.is_grad_enabled()) and self.performance is not None:
            self._safely(self.performance.reset_data_clock, self.step)

    def _open_batch(self, batch: Any) -> None:
        self._new_step_housekeeping()
        self._batch_open = True
        self._batch_step, self._batch_where, self._batch = self.step, self.where, batch
        if self.memory is not None:
            self._safely(self.memory.phase, "forward", self.step)
        if self.performance is not None:
            self._safely(self.performance.batch_start, self.step, batch)

    def _close_batch(self) -> None:
        self._batch_open = self._awaiting_step_end = False
        batch, self._batch = self._batch, None
        if self.memory is not None:
            self._safely(self.memory.phase, "end", self._batch_step)
        if self.performance is not None:
            self._safely(self.performance.batch_end, self._batch_step, self._batch_where, batch)

    def _end_pending_batch(self) -> None:
        """The optimizer step hook did not fire (a GradScaler skipped the step): end the batch now."""
        if self._awaiting_step_end:
            self._after_optimizer_step()
            self._close_batch()

    def _new_step_housekeeping(self) -> None:
        """Once per optimizer step: deliver what has arrived and write the finished steps' scalars."""
        if self._flushed_before < self.step:
            self._flushed_before = self.step
            self._after_optimizer_step()
            if self.gradients is not None:
                self._safely(self.gradients.poll)
            self._safely(self.session.end_step, self.step - 1)

    @guarded
    def _before_backward(self, loss: torch.Tensor) -> None:
        self._end_pending_batch()
        if not self._batch_open:
            self._open_batch(None)
        self._new_step_housekeeping()
        if self.gradients is not None and self.gradients.order.watching:
            self._safely(self.gradients.stop_watching_forward, [name for name, _ in self.named_parameters()])
        if self.anomalies is not None:
            self._safely(self.anomalies.observe_loss, self.step, loss)
        if self.memory is not None:
            self._safely(self.memory.phase, "backward", self.step)
        if self.performance is not None:
            self._safely(self.performance.backward_start)

    @guarded
    def _after_backward(self, real_step: bool) -> None:
        if not real_step:
            self._close_batch()
            return
        step = self.step
        decision = "continue"
        if self.anomalies is not None and self.anomalies.due(step):
            replay = self._replay_forward if self.anomalies.localizes else None
            decision = self._safely(self._check_anomalies, replay) or "continue"
        if self.gradients is not None and self.gradients.due(step):
            self._safely(self._check_gradients)
        if decision != "continue":
            self._hand_skip_to_grad_scaler()
        if decision == "stop":
            self.should_stop = True
        if self.memory is not None:
            self._safely(self.memory.phase, "optimizer", step)
            if self.memory.due(step):
                self._safely(self.memory.measure, step, self.where, self.accelerator.device)
        if self.performance is not None:
            self._safely(self.performance.optimizer_start)
        self._awaiting_step_end = self._batch_open

    def _check_anomalies(self, replay: Callable[[Any], torch.Tensor | None] | None) -> str:
        assert self.anomalies is not None
        return self.anomalies.check(self.step_numerics(), self.where, self.optimizer, self.module, replay)

    def _check_gradients(self) -> None:
        assert self.gradients is not None
        self.gradients.check(self.step_numerics(), self.where, self.named_parameters)

    def _advance(self, real_step: bool) -> None:
        end_of_epoch = bool(getattr(self.accelerator.gradient_state, "end_of_dataloader", False))
        self.batch += 1
        if real_step:
            self.step += 1
        if end_of_epoch:
            self.epoch += 1
            self.batch = 0

    @guarded
    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._awaiting_step_end:
            self._after_optimizer_step()
            self._close_batch()

    def _after_optimizer_step(self) -> None:
        if self.gradients is not None:
            self._safely(self.gradients.after_optimizer_step, self.step)

    def _replay_forward(self, captured: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor | None:
        """Recompute a captured micro-batch's forward through the unwrapped model (no DDP hooks).

        The loop's own loss function is not known here, so a NaN made by the loss computation
        outside the model is reported as not reproduced; inputs and the model's forward and
        backward are localized.
        """
        args, kwargs = captured
        self._replaying = True
        try:
            with self.accelerator.autocast():
                return replay_scalar(self.module(*args, **kwargs))
        finally:
            self._replaying = False

    @guarded
    def _post_mortem(self, error: BaseException) -> None:
        if self.memory is None or id(error) == self._post_mortem_done or not is_out_of_memory(error):
            return
        self._post_mortem_done = id(error)
        self.memory.post_mortem(error, self.step, self.where, self._batch)

    # --- internals: mixed precision --------------------------------------------------------------
    def _grad_scale(self) -> torch.Tensor | None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return None
        return getattr(scaler, "_scale", None)

    def _hand_skip_to_grad_scaler(self) -> None:
        """Under a GradScaler ``optimizer.step()`` needs a gradient to unscale: one NaN gradient makes
        the scaler skip the step, as it does for an overflow, instead of failing on no gradients."""
        if not self.uses_grad_scaler:
            return
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.requires_grad:
                    parameter.grad = torch.full_like(parameter, float("nan"))
                    return
