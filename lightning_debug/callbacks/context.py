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


def versioned_loggers() -> tuple[type, ...]:
    """The loggers with a version folder (TensorBoard, CSV) of ``lightning`` and ``pytorch_lightning``."""
    return classes("lightning.fabric.loggers", "TensorBoardLogger") + classes("lightning.fabric.loggers", "CSVLogger")


def resolve_output_dir(trainer: "pl.Trainer", config: DebugConfig) -> tuple[Path | None, str, str | None]:
    """This run's directory and id, decided on global zero and shared with every rank (call on every rank).

    A relative ``debug_output_dir`` goes into the first logger's version directory when it has one
    (TensorBoard, CSV: ``version_N/debug_outputs``), else under ``default_root_dir`` with the run id
    below it (``debug_outputs/<run id>``); an absolute one always gets the run id below it. So two
    runs never share a directory, whatever the logger (W&B, MLflow, none, ``fast_dev_run``).

    A directory that cannot be used (a path the file system cannot hold once joined to the logger's)
    is None with the reason as the third value: the run then writes no files, and the broadcast
    still happens on every rank.
    """
    run_id = new_run_id()
    directory: str | None = None
    problem: str | None = None
    if config.save_debug_info and trainer.is_global_zero:
        try:
            logger = trainer.loggers[0] if trainer.loggers else None
            versioned = isinstance(logger, versioned_loggers()) and logger.log_dir is not None
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


def lightning_logs_now(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> bool:
    """Whether Lightning writes a row of step metrics at the end of this training batch (the cadence that
    ``LearningRateMonitor`` follows: every ``log_every_n_steps`` batches that stepped, and when training stops)."""
    connector = trainer._logger_connector
    if not (connector.should_update_logs or trainer.fast_dev_run):
        return False
    return not (pl_module.automatic_optimization and trainer.fit_loop._should_accumulate())


def count_logger_writes(loggers: Iterable[Any], own_time: OwnTime) -> list[Any]:
    """Make each logger's ``log_metrics`` count as the plugin's own time for this fit; the loggers wrapped (give
    them to :func:`restore_logger_writes`).

    The data wait is timed from one batch's end to the next one's start, and Lightning writes its logging rows
    in between: with ``log_every_n_steps=1`` the write of every row (2 ms on a tiny model with ``log_gradients``,
    more through a logger that sends each row over the network) read as data wait, and a healthy tiny model was
    a ``dataloader_bottleneck``. The rows carry the plugin's scalars, and the write is no data wait whoever's
    values it holds, so it is left out of step timing as the plugin's own work is.
    """
    wrapped = []
    for logger in loggers:
        if "log_metrics" in vars(logger):  # ours already, or the user's own instance override
            continue
        original = logger.log_metrics

        def log_metrics(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            return own_time.call(_original, *args, **kwargs)

        logger.log_metrics = log_metrics
        wrapped.append(logger)
    return wrapped


def restore_logger_writes(loggers: Iterable[Any]) -> None:
    for logger in loggers:
        vars(logger).pop("log_metrics", None)


class RowLogger:
    """Debug scalars on Lightning's own rows, through ``LightningModule.log`` from ``on_train_batch_end``.

    Lightning keeps a value logged on an earlier row in its result collection and writes it again on
    every later row of the epoch; a debug value measured once (a check every 50 steps) would then repeat
    on rows where nothing was measured, so the names this logger wrote before and not now are reset.
    Values are CPU tensors: logging them moves nothing to the device.

    Once Lightning has written the row, :meth:`settle` takes them out too: Lightning walks every name of
    its result collection at the end of every batch (for ``callback_metrics``), and dozens of debug names
    that only change on rows would cost that walk on every step. ``callback_metrics`` and
    ``logged_metrics`` keep the row's values (Lightning updates those dictionaries, it does not replace
    them).
    """

    HOOK = "on_train_batch_end"

    def __init__(self) -> None:
        self._logged: set[str] = set()
        self._unsettled = False

    def settle(self, trainer: "pl.Trainer") -> None:
        """After Lightning wrote the last row (call it from the next batch's start): take this logger's names out
        of the result collection's walk until the next row updates them."""
        if not self._unsettled:
            return
        self._unsettled = False
        results = getattr(trainer, "_results", None)
        if results is not None:
            self._hide(results, self._logged)

    def _hide(self, results: Any, names: Iterable[str]) -> None:
        """Leave ``names`` out of Lightning's rows and walks until they are logged again: the flag Lightning's own
        reset sets. A value logged only on steps (these) is replaced, not accumulated, by the next ``log``, so the
        stored state needs no reset (which costs a tensor copy per state and name)."""
        for name in names:
            result = results.get(f"{self.HOOK}.{name}")
            if result is not None:
                result.has_reset = True

    def log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", values: dict[str, float]) -> None:
        results = getattr(trainer, "_results", None)
        if results is not None:
            self._hide(results, self._logged - values.keys())
        self._logged = set(values)
        if not values:
            return
        self._unsettled = True
        scalars = dict(zip(values, torch.tensor(list(values.values()), dtype=torch.float64).unbind()))
        fresh = self._update_known(trainer, pl_module, results, scalars)
        if fresh:
            pl_module.log_dict(fresh, on_step=True, on_epoch=False, prog_bar=False, logger=True, batch_size=1,
                               rank_zero_only=True)

    def _update_known(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", results: Any,
                      scalars: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Give Lightning the new value of each name it already holds as this logger registered it; return the
        others, for ``log_dict``.

        ``LightningModule.log`` validates its arguments and moves the stored metric to the value's device on
        every call (a walk over the metric's attributes): about 0.2 ms per name on a CPU, several times a
        launch-bound step. For a name Lightning already holds, with the metadata this logger always gives,
        the update is what ``log`` ends with; a new epoch (Lightning resets the hook's values on its first
        ``log``) or anything unexpected takes the public path.
        """
        connector = getattr(trainer, "_logger_connector", None)
        if results is None or connector is None or getattr(results, "dataloader_idx", 0) is not None:
            return scalars
        try:
            if connector.should_reset_tensors(pl_module._current_fx_name):
                return scalars
            fresh = {}
            for name, value in scalars.items():
                metric = results.get(f"{self.HOOK}.{name}")
                meta = getattr(metric, "meta", None)
                if meta is None or not meta.on_step or meta.on_epoch or not meta.logger or meta.prog_bar:
                    fresh[name] = value
                else:
                    results.update_metrics(f"{self.HOOK}.{name}", value, 1)
            return fresh
        except (AttributeError, TypeError, KeyError):
            return scalars


class LightningContext(RunContext):
    """The trainer's loggers, strategy, model and position, as the run sees them.

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
        self.epoch: int | None = None
        """The epoch of the last training batch: Lightning advances ``current_epoch`` when an epoch ends, before
        ``on_fit_end``, so the end of a run that stopped inside an epoch would name the next one."""

    @property  # type: ignore[override]
    def uses_grad_scaler(self) -> bool:
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def device(self) -> torch.device | None:
        return self.pl_module.device

    def gradient_clipping(self) -> tuple[float, str] | None:
        """``Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)``: Lightning clips after
        ``on_before_optimizer_step``, so the checks see the gradients before clipping."""
        value = self.trainer.gradient_clip_val
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            return None
        algorithm = self.trainer.gradient_clip_algorithm
        return float(value), str(getattr(algorithm, "value", algorithm) or "norm")

    def schedule(self) -> tuple[int | None, list[str]]:
        """``max_steps``, else Lightning's estimate of the optimizer steps of the fit (None when unbounded), and
        the configured schedulers."""
        trainer = self.trainer
        total: float | None = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            with contextlib.suppress(Exception):
                total = trainer.estimated_stepping_batches
        known = isinstance(total, (int, float)) and not isinstance(total, bool) and math.isfinite(total)
        names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
        return (int(total) if known and total is not None else None), names

    def epoch_end_step(self, step: int, where: Where) -> int | None:
        """From Lightning's batches per epoch and gradient accumulation; ``where["batch"]`` is the batch index
        within the epoch."""
        return epoch_end(step, where.get("batch", -1), self.trainer.num_training_batches,
                         self.trainer.accumulate_grad_batches)

    def module(self) -> nn.Module:
        return self.pl_module

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.pl_module.named_parameters()

    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.trainer.optimizers for group in optimizer.param_groups]

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
        """Lines that respect the progress bar: TQDM's ``write`` on the bars' stream (it clears the bars, prints the
        line and redraws them; Lightning's own ``print`` writes nothing while no bar is open), else the bar's
        ``print`` (rich: its console); None without a bar (``stderr``)."""
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
        if self.world_size <= 1:
            return None
        return self.trainer.strategy.all_gather  # type: ignore[return-value]

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
        """``Trainer(profiler="pytorch")`` (or a ``PyTorchProfiler`` instance, of ``lightning`` or
        ``pytorch_lightning``): it records the fit with torch.profiler, and its output is the user's."""
        profiler = self.trainer.profiler
        if not any(cls.__name__ == "PyTorchProfiler" for cls in type(profiler).__mro__):
            return None
        where = getattr(profiler, "dirpath", None) or self.trainer.log_dir
        return (f"Trainer(profiler=...) runs Lightning's {type(profiler).__name__}, which records this fit with "
                f"torch.profiler (its report and traces go to {where})")

    def replay(self) -> Replay | None:
        """Recompute ``training_step``'s loss from a captured ``(batch, batch_idx)`` (automatic optimization only:
        a manual ``training_step`` steps its optimizers)."""
        pl_module, trainer = self.pl_module, self.trainer
        if not pl_module.automatic_optimization:
            return None

        def training_loss(captured: Any) -> torch.Tensor | None:
            batch, batch_idx = captured
            with trainer.precision_plugin.forward_context(), _logging_muted(pl_module):
                output = pl_module.training_step(batch, batch_idx)
            return output.get("loss") if isinstance(output, Mapping) else output

        return training_loss
