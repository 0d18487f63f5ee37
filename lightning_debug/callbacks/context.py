"""What a Lightning ``Trainer`` tells a run: the :class:`RunContext` of the Lightning adapter."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
from torch import nn

from lightning_debug.config import DebugConfig
from lightning_debug.core.metrics import MetricsSink
from lightning_debug.core.context import HistogramWriter, Replay, RunContext
from lightning_debug.core.session import Where, new_run_id, run_directory
from lightning_debug.core.numerics import AllGather
from lightning_debug.report.tensorboard import histogram_writer

# Strategies whose parameters are plain tensors holding one rank's shard (DTensor shards need no flag).
PLAIN_SHARDING_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")

def resolve_output_dir(trainer: "pl.Trainer", config: DebugConfig) -> tuple[Path | None, str]:
    """This run's directory and id, decided on global zero and shared with every rank (call on every rank).

    A relative ``debug_output_dir`` goes into the first logger's version directory when it has one
    (TensorBoard, CSV: ``version_N/debug_outputs``), else under ``default_root_dir`` with the run id
    below it (``debug_outputs/<run id>``); an absolute one always gets the run id below it. So two
    runs never share a directory, whatever the logger (W&B, MLflow, none, ``fast_dev_run``).
    """
    run_id = new_run_id()
    directory: str | None = None
    failure: str | None = None
    if config.save_debug_info and trainer.is_global_zero:
        try:  # a failure still joins the broadcast below, so that no rank waits in it alone
            logger = trainer.loggers[0] if trainer.loggers else None
            versioned = isinstance(logger, (TensorBoardLogger, CSVLogger)) and logger.log_dir is not None
            base = Path(logger.log_dir) if versioned else Path(trainer.default_root_dir)  # type: ignore[union-attr]
            directory = str(run_directory(config.debug_output_dir, base, run_id, versioned))
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            if trainer.world_size <= 1:
                raise
    if trainer.world_size > 1:
        run_id, directory, failure = trainer.strategy.broadcast((run_id, directory, failure))
    if failure is not None:  # on every rank alike
        raise RuntimeError(f"the debug output directory could not be made on rank 0 ({failure})")
    return (Path(directory) if directory is not None else None), run_id


@contextlib.contextmanager
def _logging_muted(pl_module: "pl.LightningModule") -> Iterator[None]:
    """A replayed ``training_step`` must not log a second time."""
    pl_module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


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
        self.output_dir, self.run_id = resolve_output_dir(trainer, config)
        self.log_every_n_steps = trainer.log_every_n_steps
        self.is_global_zero = trainer.is_global_zero
        self.world_size = trainer.world_size
        self.rank = trainer.global_rank
        self.grads_sharded = type(trainer.strategy).__name__ in PLAIN_SHARDING_STRATEGIES
        self.batch_idx = 0

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

    def module(self) -> nn.Module:
        return self.pl_module

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.pl_module.named_parameters()

    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.trainer.optimizers for group in optimizer.param_groups]

    def optimizers(self) -> list[Any]:
        return self.trainer.optimizers

    def where(self) -> Where:
        where = {"epoch": self.trainer.current_epoch, "batch": self.batch_idx}
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

    def exposed_metrics_sink(self) -> Callable[[dict[str, float]], None]:
        trainer = self.trainer

        def expose(values: dict[str, float]) -> None:
            trainer.callback_metrics.update({name: torch.tensor(value) for name, value in values.items()})

        return expose

    def artifact_stores(self) -> list[tuple[str, Any, str | None]]:
        stores: list[tuple[str, Any, str | None]] = []
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger):
                stores.append(("wandb", logger.experiment, None))
            elif isinstance(logger, MLFlowLogger):
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
                if isinstance(logger, TensorBoardLogger)]

    def train_loader(self) -> Any:
        return self.trainer.train_dataloader

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
