"""What a Lightning ``Trainer`` tells a run: the :class:`RunContext` of the Lightning adapter."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from torch import nn

from lightning_debug.callbacks.frameworks import classes
from lightning_debug.config import DebugConfig
from lightning_debug.core.metrics import MetricsSink
from lightning_debug.core.context import HistogramWriter, Replay, RunContext, epoch_end
from lightning_debug.core.guard import describe
from lightning_debug.core.session import Where, new_run_id, run_directory
from lightning_debug.core.numerics import AllGather
from lightning_debug.core.own_time import OwnTime
from lightning_debug.report.tensorboard import histogram_writer

# Strategies whose parameters are plain tensors holding one rank's shard (DTensor shards need no flag).
PLAIN_SHARDING_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")
TQDM_MODULE = "lightning.pytorch.callbacks.progress.tqdm_progress"


def resolve_output_dir(trainer: "pl.Trainer", config: DebugConfig) -> tuple[Path | None, str, str | None]:
    """This run's directory and id, decided on global zero and broadcast (call on every rank); a directory that
    cannot be used is None with the reason as the third value (the run then writes no files)."""
    run_id = new_run_id()
    directory: str | None = None
    problem: str | None = None
    if config.save_debug_info and trainer.is_global_zero:
        try:
            logger = trainer.loggers[0] if trainer.loggers else None
            with_version = classes("lightning.fabric.loggers", "TensorBoardLogger") + classes(
                "lightning.fabric.loggers", "CSVLogger")  # of lightning and pytorch_lightning
            versioned = isinstance(logger, with_version) and logger.log_dir is not None
            base = Path(logger.log_dir) if versioned else Path(trainer.default_root_dir)  # type: ignore[union-attr]
            directory = str(run_directory(config.debug_output_dir, base, run_id, versioned))
        except Exception as error:
            problem = describe(error)
    if trainer.world_size > 1:
        run_id, directory, problem = trainer.strategy.broadcast((run_id, directory, problem))
    return (Path(directory) if directory is not None else None), run_id, problem


@contextlib.contextmanager
def _logging_muted(pl_module: "pl.LightningModule") -> Iterator[None]:
    """A replayed ``training_step`` must not log a second time."""
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


def count_logger_writes(loggers: Iterable[Any], own_time: OwnTime, rows: "RowLogger | None" = None) -> list[Any]:
    """Make each logger's ``log_metrics`` the plugin's own time for this fit, adding the scalars ``rows`` holds to
    Lightning's row; returns the loggers wrapped. Lightning writes rows inside the timed data wait, and a row's
    write (2 ms on a tiny model with ``log_gradients``) made a healthy tiny model a ``dataloader_bottleneck``."""
    wrapped = []
    for logger in loggers:
        if "log_metrics" in vars(logger):  # ours already, or the user's own instance override
            continue
        original = logger.log_metrics

        def log_metrics(metrics: Mapping[str, Any], step: int | None = None, *args: Any,
                        _original: Callable[..., Any] = original, _logger: Any = logger, **kwargs: Any) -> Any:
            if rows is not None and rows.holds:
                metrics = rows.merged(_logger, metrics, step)
            return own_time.call(_original, metrics, step, *args, **kwargs)

        logger.log_metrics = log_metrics
        wrapped.append(logger)
    return wrapped


def restore_logger_writes(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        vars(logger).pop("log_metrics", None)


class RowLogger:
    """Debug scalars on the rows Lightning writes, through the loggers' public ``log_metrics``: the user's rows and
    step axis, nothing written into Lightning's result collection. ``LightningModule.log`` would validate and move
    the stored metric on every call (0.2 ms per name per row on a CPU) and write a value logged once again on every
    later row of the epoch.

    :meth:`batch_end` follows Lightning's row cadence; :meth:`hold` keeps the scalars since the last row, and the
    wrapped ``log_metrics`` adds them to the call that carries ``epoch`` (:meth:`merged`): one CSV line, not two.
    A row Lightning does not write is written alone when the next batch starts or the epoch ends (:meth:`flush`).

    Example (a logger that records its rows; Lightning's own row carries ``epoch``)::

        >>> class Rows:
        ...     def __init__(self): self.rows = []
        ...     def log_metrics(self, metrics, step=None): self.rows.append((step, dict(metrics)))
        >>> logger, rows = Rows(), RowLogger()
        >>> _ = count_logger_writes([logger], OwnTime(), rows)
        >>> rows.loggers = [logger]
        >>> rows.hold({"debug/loss_finite": 1.0}, step=4)
        >>> logger.log_metrics({"train_loss": 0.5, "epoch": 0}, step=4)
        >>> rows.hold({"debug/loss_finite": 0.0}, step=9); rows.flush()
        >>> logger.rows
        [(4, {'train_loss': 0.5, 'epoch': 0, 'debug/loss_finite': 1.0}), (9, {'debug/loss_finite': 0.0})]
    """

    def __init__(self) -> None:
        self.stepped = 0
        """Batches that stepped so far: the step of Lightning's next row."""
        self.loggers: list[Any] = []
        self._row: dict[str, float] | None = None  # the scalars of Lightning's next row, until a logger takes them
        self._step = 0
        self._served: set[int] = set()

    @property
    def holds(self) -> bool:
        return self._row is not None

    def start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The fit starts (after a checkpoint's restore): count the batches that stepped so far."""
        self.loggers = list(trainer.loggers)
        self._row = None
        if pl_module.automatic_optimization:  # one optimizer, one optimizer step per batch that stepped
            self.stepped = trainer.global_step
        else:  # every batch counts, however many optimizers it stepped
            progress = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "batch_progress", None)
            self.stepped = int(getattr(getattr(progress, "total", None), "completed", trainer.global_step))

    def batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch_idx: int) -> bool:
        """Count this training batch; whether Lightning writes a row after it: every ``log_every_n_steps`` batches
        that stepped, when training stops, and on every batch of a ``fast_dev_run``."""
        if pl_module.automatic_optimization and _accumulates(trainer, batch_idx):
            return False
        step = self.stepped
        self.stepped += 1
        every = trainer.log_every_n_steps
        if not (trainer.fast_dev_run or (every > 0 and ((step + 1) % every == 0 or trainer.should_stop))):
            return False
        self._step = step
        return True

    def log(self, trainer: "pl.Trainer", values: dict[str, float]) -> None:
        """Hold ``values`` for this batch's row; ``trainer.callback_metrics`` and ``logged_metrics`` get them too."""
        self.hold(values)
        if values:
            scalars = dict(zip(values, torch.tensor(list(values.values()), dtype=torch.float64).unbind()))
            trainer.callback_metrics.update(scalars)
            trainer.logged_metrics.update(scalars)

    def hold(self, values: dict[str, float], step: int | None = None) -> None:
        """The scalars of the row Lightning writes next (its step from :meth:`batch_end`, or ``step``)."""
        self.flush()
        if step is not None:
            self._step = step
        if values:
            self._row, self._served = dict(values), set()

    def merged(self, logger: Any, metrics: Mapping[str, Any], step: int | None) -> Mapping[str, Any]:
        """``metrics`` with the held scalars when this is Lightning's row (it has ``epoch``) new to ``logger``."""
        if self._row is None or "epoch" not in metrics or id(logger) in self._served:
            return metrics
        self._served.add(id(logger))
        if step is not None and step != self._step:
            self._step, self.stepped = step, step + 1
        return {**metrics, **self._row}

    def flush(self) -> None:
        """Write the held scalars to each logger whose row did not take them (Lightning wrote none)."""
        row, self._row = self._row, None
        if row is None:
            return
        for logger in self.loggers:
            if id(logger) not in self._served:
                logger.log_metrics(row, step=self._step)


def _accumulates(trainer: "pl.Trainer", batch_idx: int) -> bool:
    """Whether this batch only accumulates gradients (no step, no row), as Lightning decides it."""
    every = trainer.accumulate_grad_batches
    if every <= 1 or (batch_idx + 1) % every == 0:
        return False
    last = batch_idx + 1 >= trainer.num_training_batches
    return trainer.strategy.handles_gradient_accumulation or not last


class LightningContext(RunContext):
    """The trainer's loggers, strategy, model and position.

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False, default_root_dir="runs")
        >>> context = LightningContext(trainer, pl.LightningModule(), DebugConfig())
        >>> context.output_dir == Path("runs/debug_outputs") / context.run_id, context.where()
        (True, {'epoch': 0, 'batch': 0})
    """

    def __init__(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: DebugConfig) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.output_dir, self.run_id, self.output_problem = resolve_output_dir(trainer, config)
        self.log_every_n_steps = trainer.log_every_n_steps
        self.logs_rows = bool(trainer.loggers) and bool(trainer.log_every_n_steps)
        self.is_global_zero = trainer.is_global_zero
        self.world_size = trainer.world_size
        self.rank = trainer.global_rank
        self.grads_sharded = type(trainer.strategy).__name__ in PLAIN_SHARDING_STRATEGIES
        self.batch_idx = 0
        self._trainable_at_setup = [p for p in pl_module.parameters() if p.requires_grad]
        self.epoch: int | None = None
        """The epoch of the last training batch: Lightning advances ``current_epoch`` when an epoch ends, before
        ``on_fit_end``, so the end of a run that stopped inside an epoch would name the next one."""

    @property  # type: ignore[override]
    def uses_grad_scaler(self) -> bool:
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def trainable_before_start(self) -> list[torch.nn.Parameter]:
        """Read at the callbacks' ``setup``, before ``configure_model`` and ``configure_optimizers``."""
        return self._trainable_at_setup

    def device(self) -> torch.device | None:
        return self.pl_module.device

    def gradient_clipping(self) -> tuple[float, str] | None:
        """``Trainer(gradient_clip_val=...)``: Lightning clips after the checks saw the gradients."""
        value = self.trainer.gradient_clip_val
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            return None
        algorithm = self.trainer.gradient_clip_algorithm
        return float(value), str(getattr(algorithm, "value", algorithm) or "norm")

    def schedule(self) -> tuple[int | None, list[str]]:
        """``max_steps``, else Lightning's estimate (None when unbounded), and the configured schedulers."""
        trainer = self.trainer
        total: float | None = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            with contextlib.suppress(Exception):
                total = trainer.estimated_stepping_batches
        known = isinstance(total, (int, float)) and not isinstance(total, bool) and math.isfinite(total)
        names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
        return (int(total) if known and total is not None else None), names

    def epoch_end_step(self, step: int, where: Where) -> int | None:
        """From Lightning's batches per epoch and gradient accumulation."""
        return epoch_end(step, where.get("batch", -1), self.trainer.num_training_batches,
                         self.trainer.accumulate_grad_batches)

    def loss_divisor(self) -> int:
        """Under automatic optimization Lightning divides the loss by ``accumulate_grad_batches`` before its
        backward, and hands ``on_before_backward`` the quotient."""
        return max(1, int(self.trainer.accumulate_grad_batches)) if self.pl_module.automatic_optimization else 1

    def module(self) -> nn.Module:
        return self.pl_module

    def optimizers(self) -> list[Any]:
        return self.trainer.optimizers

    def where(self) -> Where:
        where = {"epoch": self.trainer.current_epoch if self.epoch is None else self.epoch, "batch": self.batch_idx}
        if self.optimizer_index is not None:
            where["optimizer"] = self.optimizer_index
        return where

    def metrics_sink(self) -> MetricsSink | None:
        loggers = self.trainer.loggers
        if not loggers:
            return None

        def sink(metrics: dict[str, float], step: int) -> None:
            for logger in loggers:
                logger.log_metrics(metrics, step=step)

        return sink

    def console_printer(self) -> Callable[[str], None] | None:
        """Lines that respect the progress bar: TQDM's ``write`` (Lightning's ``print`` writes nothing while no bar
        is open), else the bar's ``print``; None without a bar (``stderr``)."""
        bar = self.trainer.progress_bar_callback
        if bar is None or not self.is_global_zero:
            return None
        if isinstance(bar, classes(TQDM_MODULE, "TQDMProgressBar")):  # tqdm's write clears every tqdm bar
            return lambda line: Tqdm.write(line, file=sys.stdout)
        return lambda line: bar.print(line)

    def exposed_metrics_sink(self) -> Callable[[dict[str, float]], None]:
        trainer = self.trainer

        def expose(values: dict[str, float]) -> None:
            trainer.callback_metrics.update({name: torch.tensor(value) for name, value in values.items()})

        return expose

    def artifact_stores(self) -> list[tuple[str, Any, str | None]]:
        stores: list[tuple[str, Any, str | None]] = []
        for logger in self.trainer.loggers:
            if isinstance(logger, classes("lightning.pytorch.loggers", "WandbLogger")):
                stores.append(("wandb", logger.experiment, None))
            elif isinstance(logger, classes("lightning.pytorch.loggers", "MLFlowLogger")):
                stores.append(("mlflow", logger.experiment, logger.run_id))
        return stores

    def all_gather(self) -> AllGather | None:
        return self.trainer.strategy.all_gather if self.world_size > 1 else None  # type: ignore[return-value]

    def histogram_writer(self) -> tuple[HistogramWriter | None, str]:
        loggers = self.trainer.loggers
        names = ", ".join(type(logger).__name__ for logger in loggers) or "no logger"
        return histogram_writer(getattr(logger, "experiment", None) for logger in loggers), names

    def tensorboard_writers(self) -> list[tuple[Any, str | None]]:
        return [(logger.experiment, getattr(logger, "log_dir", None)) for logger in self.trainer.loggers
                if isinstance(logger, classes("lightning.fabric.loggers", "TensorBoardLogger"))]

    def train_loader(self) -> Any:
        return self.trainer.train_dataloader

    def profiler_in_use(self) -> str | None:
        """``Trainer(profiler="pytorch")``: it records the fit with torch.profiler, and its output is the user's."""
        profiler = self.trainer.profiler
        if not any(cls.__name__ == "PyTorchProfiler" for cls in type(profiler).__mro__):
            return None
        where = getattr(profiler, "dirpath", None) or self.trainer.log_dir
        return (f"Trainer(profiler=...) runs Lightning's {type(profiler).__name__}, which records this fit with "
                f"torch.profiler (its report and traces go to {where})")

    def muted(self) -> contextlib.AbstractContextManager[Any]:
        return _logging_muted(self.pl_module)

    def replay(self) -> Replay | None:
        """Recompute ``training_step``'s loss (automatic optimization only: a manual one steps its optimizers)."""
        pl_module, trainer = self.pl_module, self.trainer
        if not pl_module.automatic_optimization:
            return None

        def training_loss(captured: Any) -> torch.Tensor | None:
            batch, batch_idx = captured
            with trainer.precision_plugin.forward_context(), _logging_muted(pl_module):
                output = pl_module.training_step(batch, batch_idx)
            return output.get("loss") if isinstance(output, Mapping) else output

        return training_loss
