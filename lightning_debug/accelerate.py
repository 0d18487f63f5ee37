"""AccelerateDebugger: the lightning-debug checks in a plain Hugging Face Accelerate loop.

A hand-written loop has no hooks: the run's events come from what every such loop does (a forward,
:meth:`AccelerateDebugger.backward`, the optimizer's step), driving the same :class:`~lightning_debug.run.Run`
as the Lightning callbacks (docs/accelerate.md).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from lightning_debug.checks.localize import is_replaying, output_scalar
from lightning_debug.config import DebugConfig, resolve_config
from lightning_debug.core.metrics import MetricsSink
from lightning_debug.core.context import (HistogramWriter, Replay, RunContext, RunStatus, epoch_end, exit_code,
                                          torch_optimizer)
from lightning_debug.core.guard import describe
from lightning_debug.core.monitor import Decision
from lightning_debug.core.session import Where, new_run_id, run_directory
from lightning_debug.core.numerics import AllGather
from lightning_debug.monitors import monitors_for
from lightning_debug.report.attach import tracker_stores
from lightning_debug.report.tensorboard import histogram_writer
from lightning_debug.core.monitor_states import load_monitor_states, monitor_states
from lightning_debug.run import Run

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["AccelerateDebugger"]

SOURCE = "AccelerateDebugger"
SizeFn = Callable[[Any], int]


class AccelerateContext(RunContext):
    """What the ``Accelerator``, the prepared model and optimizer tell the run."""

    def __init__(self, debugger: "AccelerateDebugger", config: DebugConfig, train_dataloader: Any) -> None:
        from accelerate.utils import broadcast_object_list

        accelerator = self.accelerator = debugger.accelerator
        self.debugger = debugger
        self.run_id = broadcast_object_list([new_run_id()])[0]  # the same id on every process
        base = Path(accelerator.logging_dir or accelerator.project_dir or Path.cwd())
        if config.save_debug_info:  # <base>/debug_outputs/<run id>: Accelerate has no per-run directory
            self.output_dir = run_directory(config.debug_output_dir, base, self.run_id, base_is_per_run=False)
        self.is_global_zero = accelerator.is_main_process
        self.world_size, self.rank = accelerator.num_processes, accelerator.process_index
        kind = getattr(accelerator.distributed_type, "name", "")
        self.grads_sharded = kind == "DEEPSPEED" or (kind == "FSDP" and not getattr(accelerator, "is_fsdp2", False))
        self.loader = train_dataloader

    @property  # type: ignore[override]
    def uses_grad_scaler(self) -> bool:
        return getattr(self.accelerator, "scaler", None) is not None

    def gradient_clipping(self) -> tuple[float, str] | None:
        """The loop's last ``accelerator.clip_grad_*`` call (after ``debugger.backward``, where the checks ran)."""
        return self.debugger.clipping

    def epoch_end_step(self, step: int, where: Where) -> int | None:
        """From the length of ``train_dataloader`` and the gradient accumulation (None without one length)."""
        loader = self.loader
        if loader is None or isinstance(loader, (Mapping, list, tuple)):
            return None
        try:
            batches = len(loader)
        except TypeError:
            return None
        return epoch_end(step, where.get("batch", -1), batches,
                         int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1))

    def schedule(self) -> tuple[int | None, list[str]]:
        """``total_steps`` and ``lr_scheduler`` as given to :class:`AccelerateDebugger` (a loop says neither)."""
        return self.debugger.total_steps, list(self.debugger.scheduler_names)

    def loss_divisor(self) -> int:
        """``debugger.backward(loss)`` sees the loss the loop computed; ``accelerator.backward`` divides it by the
        gradient accumulation after."""
        return 1

    def backward_divisor(self) -> int:
        """``accelerator.backward`` divides the loss by the gradient accumulation before it differentiates it."""
        return max(1, int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1))

    def device(self) -> torch.device:
        return self.accelerator.device

    def module(self) -> torch.nn.Module:
        return self.debugger.module

    def optimizers(self) -> list[Any]:
        return list(self.debugger.optimizers)

    def where(self) -> Where:
        where = self.debugger.where
        if self.optimizer_index is not None:
            where["optimizer"] = self.optimizer_index
        return where

    def metrics_sink(self) -> MetricsSink:
        """Scalars to every tracker, never below the loop's highest ``accelerator.log`` step (W&B drops lower ones)."""
        accelerator, debugger = self.accelerator, self.debugger

        def sink(metrics: dict[str, float], step: int) -> None:
            if accelerator.trackers:
                log = accelerator.__dict__.get("_lightning_debug_log", accelerator.log)
                log(metrics, step=max(step, debugger.logged_step))

        return sink

    def console_printer(self) -> Callable[[str], None]:
        return self.accelerator.print

    def all_gather(self) -> AllGather | None:
        return self.accelerator.gather if self.world_size > 1 else None

    def artifact_stores(self) -> list[tuple[str, Any, str | None]]:
        return tracker_stores(self.accelerator.trackers)

    def histogram_writer(self) -> tuple[HistogramWriter | None, str]:
        trackers = self.accelerator.trackers
        names = ", ".join(type(tracker).__name__ for tracker in trackers) or "no tracker"
        return histogram_writer(getattr(t, "writer", None) or getattr(t, "tracker", None) for t in trackers), names

    def tensorboard_writers(self) -> list[tuple[Any, str | None]]:
        return [(tracker.writer, getattr(tracker, "logging_dir", None)) for tracker in self.accelerator.trackers
                if getattr(tracker, "writer", None) is not None]

    def grad_scale(self) -> torch.Tensor | None:
        """Right after backward fp16 gradients still carry the loss scale; norms are divided by it."""
        scaler = getattr(self.accelerator, "scaler", None)
        return getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None

    def train_loader(self) -> Any:
        return self.loader

    def forward_call(self, captured: Any) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]] | None:
        args, kwargs = captured
        return self.debugger.module, args, kwargs

    def replay(self) -> Replay:
        return self.debugger._replay_forward

    def replay_scope(self) -> str | None:
        """The replay recomputes the model's forward, and the loss only when the model returns it (HF labels)."""
        return None if self.debugger._replayed_loss else "the loss computed outside the model, in the training loop"


class AllOptimizers:
    """Several optimizers as one, for a ``backward`` that does not say which steps next: judged together."""

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]


class AccelerateDebugger:
    """NaN/Inf detection, gradient health, memory and performance checks for an Accelerate loop.

    Build it after ``accelerator.prepare``, call :meth:`backward` instead of ``accelerator.backward``
    and :meth:`finish` after the loop (before ``accelerator.end_training()``), on every process; the
    areas, frequencies, events and scalars are those of :func:`~lightning_debug.debug_callbacks`.
    :attr:`step` counts real optimizer steps (``backward`` calls with ``accelerator.sync_gradients``).

    Args:
        accelerator, model, optimizer: The run's ``Accelerator`` and what ``prepare`` returned;
            ``optimizer`` may be a list of optimizers (name the one that steps next in :meth:`backward`).
        config: The checks' settings; None means the defaults.
        train_dataloader: The DataLoader the loop trains on, a list of them or a dict of its settings: quoted
            in ``dataloader_bottleneck`` advice, and its length tells where an epoch ends.
        total_steps: How many optimizer steps the loop will take; without it ``learning_stalled`` is not judged.
        lr_scheduler: The loop's learning-rate scheduler(s), named in ``learning_stalled``.
        batch_size_fn, tokens_fn: ``batch -> samples / tokens``; the batch is what the model is called with.
        **overrides: :class:`~lightning_debug.DebugConfig` fields to change (docs/accelerate.md has the details).

    Example::

        >>> import contextlib, io, torch
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> model = torch.nn.Linear(2, 1)
        >>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> debugger = AccelerateDebugger(accelerator, model, optimizer, save_debug_info=False)
        >>> debugger.backward(model(torch.ones(4, 2)).pow(2).mean()); optimizer.step(); debugger.step
        1
        >>> with contextlib.redirect_stdout(io.StringIO()):  # finish() also prints a one-screen summary
        ...     report = debugger.finish()
        >>> report["status"], report["last_step"]
        ('finished', 1)
    """

    def __init__(self, accelerator: "Accelerator", model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 config: DebugConfig | None = None, *, train_dataloader: Any = None,
                 total_steps: int | None = None, lr_scheduler: Any = None,
                 batch_size_fn: SizeFn | None = None, tokens_fn: SizeFn | None = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool)
                                        or total_steps < 1):
            raise ValueError(f"AccelerateDebugger total_steps must be a positive int or None, got {total_steps!r}")
        self.total_steps = total_steps
        schedulers = lr_scheduler if isinstance(lr_scheduler, (list, tuple)) else [lr_scheduler] if lr_scheduler else []
        self.scheduler_names = [type(getattr(each, "scheduler", each)).__name__ for each in schedulers]
        self.optimizers: list[torch.optim.Optimizer] = (list(optimizer) if isinstance(optimizer, (list, tuple))
                                                          else [optimizer])  # type: ignore[list-item]
        if not self.optimizers:
            raise ValueError("AccelerateDebugger needs at least one optimizer, got an empty list")
        self.accelerator, self.model, self.optimizer = accelerator, model, self.optimizers[0]
        self._all_optimizers = AllOptimizers(self.optimizers)
        self._stepping: Any = self.optimizer
        self._said_unnamed = False
        self.module: torch.nn.Module = accelerator.unwrap_model(model)
        self.step = self.epoch = self.batch = 0
        self.should_stop = False
        self.clipping: tuple[float, str] | None = None
        self.logged_step = 0
        """The highest ``step`` the loop passed to ``accelerator.log``: debug values are never logged below it."""
        self._watch_clipping()
        self._watch_logging()
        self._batch_open = self._awaiting_step_end = self._replaying = False
        self._in_step = self._evaluated = False  # inside optimizer.step(), and its closure's backward already ran
        self._replayed_loss = False
        self._batch_where: Where = self.where
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > accelerator.num_processes:
            warnings.warn(
                f"lightning-debug: the launcher started {launched} processes (WORLD_SIZE) but the Accelerator runs "
                f"{accelerator.num_processes} ({accelerator.distributed_type}): every process trains alone and "
                "writes the same debug files. Without GPUs, create it with Accelerator(cpu=True).",
                RuntimeWarning, stacklevel=2)
        self.run = Run(self.config, AccelerateContext(self, self.config, train_dataloader),
                       monitors_for(self.config, SOURCE, batch_size_fn, tokens_fn))
        self.run.start(self.step)
        self._hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True),
                       model.register_forward_hook(self._on_forward_end)]
        for each in self.optimizers:
            inner = torch_optimizer(each)
            if hasattr(inner, "register_step_post_hook"):
                self._hooks.append(inner.register_step_pre_hook(lambda *_: self._optimizer_step_begins()))
                self._hooks.append(inner.register_step_post_hook(lambda *_: self._optimizer_step_ends()))

    @property
    def where(self) -> Where:
        """Epoch and micro-batch index, as when the batch began."""
        return dict(self._batch_where) if self._batch_open else {"epoch": self.epoch, "batch": self.batch}

    def _watch_clipping(self) -> None:
        """Wrap this accelerator's clipping methods to learn the clip value ``exploding_grad`` quotes."""
        accelerator = self.accelerator
        for name, algorithm in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value")):
            original = getattr(accelerator, name, None)
            if original is None or name in accelerator.__dict__:
                continue

            def clipping(parameters: Any, *args: Any, _original: Any = original, _algorithm: str = algorithm,
                         **kwargs: Any) -> Any:
                limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
                if isinstance(limit, (int, float)) and not isinstance(limit, bool):
                    self.clipping = (float(limit), _algorithm)
                return _original(parameters, *args, **kwargs)

            setattr(accelerator, name, clipping)

    def _watch_logging(self) -> None:
        """Wrap ``accelerator.log`` (this instance, until :meth:`finish`) to learn the steps the loop logs at, so
        debug values never land below them; the write is the plugin's own time (it falls in the timed data wait)."""
        accelerator = self.accelerator
        if "log" in accelerator.__dict__:
            return
        original = accelerator.log

        def log(values: dict, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
            if isinstance(step, int) and not isinstance(step, bool):
                self.logged_step = max(self.logged_step, step)
            run = getattr(self, "run", None)
            if run is None:
                return original(values, step, *args, **kwargs)
            return run.session.own_time.call(original, values, step, *args, **kwargs)

        accelerator.__dict__["_lightning_debug_log"] = original
        accelerator.log = log  # type: ignore[method-assign]

    def backward(self, loss: torch.Tensor, *, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        """``accelerator.backward(loss, **kwargs)`` with the checks around it. ``optimizer``: with several, the one
        whose ``step()`` follows; without it, all are judged together."""
        if self.run.finished or self._in_step and self._evaluated:  # after the run, or a closure evaluated again
            self.accelerator.backward(loss, **kwargs)
            return
        self._evaluated = self._in_step
        real_step = bool(self.accelerator.sync_gradients)
        self._end_pending_batch()
        if not self._batch_open:
            self._open_batch(None, None)
        self.run.before_backward(self.step, loss)
        try:
            self.accelerator.backward(loss, **kwargs)
        except BaseException as error:
            self.run.exception(self.step, error)
            raise
        if real_step:
            self._stepping = self._next_optimizer(optimizer)
            decision = self.run.before_optimizer_step(self.step, self._stepping) or Decision.CONTINUE
            if decision is not Decision.CONTINUE:
                self.run.failures.call("handing the skipped step to the GradScaler", self._hand_skip_to_grad_scaler)
            self.should_stop = self.should_stop or decision is Decision.STOP
            self._awaiting_step_end = self._batch_open
        else:
            self._close_batch()
        end_of_epoch = bool(getattr(self.accelerator.gradient_state, "end_of_dataloader", False))
        self.batch, self.step = self.batch + 1, self.step + int(real_step)
        if end_of_epoch:
            self.epoch, self.batch = self.epoch + 1, 0

    def finish(self, error: BaseException | None = None) -> dict[str, Any] | None:
        """Deliver pending measurements, log the last scalars, write the report; on every process, with the
        exception when the loop failed (or use the debugger as a context manager). Returns the report (later: None,
        and :meth:`backward` is plain ``accelerator.backward``)."""
        if self.run.finished:
            return None
        status = RunStatus.of(error)
        if error is not None:
            self.run.exception(self.step, error)
        self._end_pending_batch()
        for handle in self._hooks:
            handle.remove()
        for name in ("clip_grad_norm_", "clip_grad_value_", "log", "_lightning_debug_log"):
            self.accelerator.__dict__.pop(name, None)
        return self.run.finish(status, self.step, None if error is None else f"{type(error).__name__}: {describe(error)}",
                               exit_code(error))

    def _next_optimizer(self, named: Any) -> Any:
        """The coming step's optimizer: ``named`` (matched through Accelerate's wrapper), the only one, or all."""
        if named is not None:
            inner = torch_optimizer(named)
            return next((o for o in self.optimizers if o is named or torch_optimizer(o) is inner), named)
        if len(self.optimizers) == 1:
            return self.optimizer
        if not self._said_unnamed and self.run.context.is_global_zero:
            self._said_unnamed = True
            warnings.warn(
                f"lightning-debug: AccelerateDebugger has {len(self.optimizers)} optimizers but backward() was not "
                "told which one steps next: each step is judged on all their parameters (a GAN's discriminator step "
                "then reports the generator's parameters as without gradient). Call debugger.backward(loss, "
                "optimizer=opt) to judge each step on the parameters of the optimizer that takes it.",
                RuntimeWarning, stacklevel=3)
        return self._all_optimizers

    def __enter__(self) -> "AccelerateDebugger":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.finish(exc)

    def state_dict(self) -> dict[str, Any]:
        """Counters and open episodes; ``accelerator.register_for_checkpointing(debugger)`` saves them."""
        return {"step": self.step, "epoch": self.epoch, **monitor_states(self.run.monitors)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict.get("step", self.step))
        self.epoch = int(state_dict.get("epoch", self.epoch))
        load_monitor_states(self.run.monitors, state_dict)

    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward opens a batch (the data wait ends)."""
        if self._replaying or is_replaying() or self.run.finished or self._in_step and self._evaluated:
            return
        if not (module.training and torch.is_grad_enabled()):
            self.run.evaluation(self.step, True)
            return
        self._end_pending_batch()
        if not self._batch_open:
            self._open_batch(args[0] if len(args) == 1 else args or kwargs or None, (args, kwargs))

    def _on_forward_end(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The end of an evaluation forward is no data wait of the next training step."""
        if not (self._replaying or is_replaying() or self.run.finished or module.training and torch.is_grad_enabled()):
            self.run.evaluation(self.step, False)

    def _open_batch(self, batch: Any, captured: Any) -> None:
        self._batch_where, self._batch_open = self.where, True
        self.run.batch_start(self.step, batch, captured)

    def _close_batch(self) -> None:
        self.run.batch_end()
        self._batch_open = self._awaiting_step_end = False

    def _optimizer_step_begins(self) -> None:
        """An L-BFGS closure runs inside ``step()``: its first backward is the step's, the others are not checked."""
        self._in_step, self._evaluated = True, False

    def _optimizer_step_ends(self) -> None:
        self._in_step = self._evaluated = False
        self._end_pending_batch()

    def _end_pending_batch(self) -> None:
        """The step's end: the optimizer's step post-hook, or the next forward if a GradScaler skipped it."""
        if self._awaiting_step_end:
            self.run.after_optimizer_step(self.step)
            self._close_batch()

    def _replay_forward(self, captured: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor | None:
        """Recompute a captured forward through the unwrapped model (no DDP hooks)."""
        args, kwargs = captured
        self._replaying = True
        try:
            with self.accelerator.autocast():
                output = self.module(*args, **kwargs)
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            self._replayed_loss = isinstance(loss, torch.Tensor)
            return output_scalar(output)
        finally:
            self._replaying = False

    def _hand_skip_to_grad_scaler(self) -> None:
        """Under a GradScaler ``optimizer.step()`` needs a gradient to unscale: one NaN gradient makes the scaler
        skip the step, as for an overflow, instead of failing on no gradients."""
        if self.run.context.uses_grad_scaler:
            for group in self._stepping.param_groups:
                for parameter in group["params"]:
                    if parameter.requires_grad:
                        parameter.grad = torch.full_like(parameter, float("nan"))
                        return
