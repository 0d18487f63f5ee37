"""What the four callbacks share: one run per trainer, driven from Lightning's hooks.

Each callback owns its area's monitor, made afresh for every fit (counts carry over only through a checkpoint).
At ``setup`` a trainer's callbacks join one :class:`~lightning_debug.run.Run`, stored on the trainer. The first
leads: its hooks become the run's events, once whatever the number of callbacks; the others keep their monitor's
state for checkpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_debug.config import (RUN_WIDE_FIELDS, Area, DebugConfig, fields_of, keyword_overrides, override_help,
                                    resolve_config)
from lightning_debug.callbacks.cli_usage import register as register_cli_usage
from lightning_debug.config_types import with_args
from lightning_debug.callbacks.frameworks import CALLBACK_BASES, check_trainer
from lightning_debug.core.context import RunStatus, exit_code
from lightning_debug.core.guard import Failures, describe, guarded
from lightning_debug.core.ledger import FrameworkWork
from lightning_debug.core.monitor import Decision, Monitor
from lightning_debug.monitors import AREA_SPECS, companion_monitors, run_monitors
from lightning_debug.core.monitor_states import load_monitor_states, monitor_states
from lightning_debug.run import Run
from lightning_debug.callbacks.context import LightningContext, RowLogger, count_logger_writes, restore_logger_writes

RUN_ATTRIBUTE = "_lightning_debug_run"
# Hooks Lightning calls for every callback on every batch; see DebugCallback._unsubscribe_idle_hooks.
BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
               "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end")
CONFIG_HELP = ("The shared settings (a DebugConfig); null means the defaults. The keyword arguments override its "
               "fields for this callback; null keeps the value from ``config``.")


def run_wide_config(configs: dict[str, DebugConfig]) -> DebugConfig:
    """One config for the run from its callbacks' configs (by name, the leader first): a run-wide field takes the
    value any of them set away from its default; two different values are a ``ValueError``.

    Example::

        >>> run_wide_config({"A": DebugConfig(), "B": DebugConfig(print_summary=False)}).print_summary
        False
        >>> run_wide_config({"A": DebugConfig(debug_output_dir="a"), "B": DebugConfig(debug_output_dir="b")})
        Traceback (most recent call last):
        ...
        ValueError: DebugConfig.debug_output_dir is a setting of the whole run, but A sets 'a' and B 'b': set it on one callback, or the same on all
    """
    defaults = DebugConfig()
    names = list(configs)
    merged: dict[str, Any] = {}
    chosen: dict[str, str] = {}
    for field in RUN_WIDE_FIELDS:
        for name in names:
            value = getattr(configs[name], field)
            if value == getattr(defaults, field):
                continue
            if field in merged and merged[field] != value:
                raise ValueError(f"DebugConfig.{field} is a setting of the whole run, but {chosen[field]} sets "
                                 f"{merged[field]!r} and {name} {value!r}: set it on one callback, or the same on all")
            merged[field], chosen[field] = value, name
    first = configs[names[0]]  # unchanged, not rebuilt: a rebuild checks the output path again, at setup
    return dataclasses.replace(first, **merged) if any(getattr(first, f) != v for f, v in merged.items()) else first


class DebugCallback(*CALLBACK_BASES):  # type: ignore[misc]
    """Base of the four callbacks: a thin adapter from Lightning hooks to the trainer's run, a ``Callback`` of
    ``lightning.pytorch`` and of ``pytorch_lightning`` where installed (:mod:`~lightning_debug.callbacks.frameworks`).
    """

    area: ClassVar[Area]
    own_fields: ClassVar[tuple[str, ...]] = ()
    """The fields that tell two callbacks of one class apart (the ``state_key``), from its area's ``AreaSpec``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class with an ``area`` takes its area's fields as keyword overrides, documented in its ``Args``."""
        super().__init_subclass__(**kwargs)
        if "area" in cls.__dict__:
            cls.own_fields = AREA_SPECS[cls.area].settings
            init = cls.__dict__.get("__init__") or getattr(cls.__init__, "__wrapped__", cls.__init__)
            cls.__init__ = keyword_overrides(init, cls.area)  # type: ignore[method-assign]
            cls.__doc__ = with_args(cls.__doc__, [("config", CONFIG_HELP),
                                                  *((name, override_help(name)) for name in fields_of(cls.area))])

    def __init__(self, config: DebugConfig | None = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        self.monitor: Monitor = self.make_monitor()
        self.companions: list[Monitor] = companion_monitors(self.monitor.area, self.config, type(self).__name__)
        self._run_monitors: list[Monitor] = []
        self._run: Run | None = None
        self._leads = False
        self._failures = Failures()
        self._rows = RowLogger()

    def make_monitor(self) -> Monitor:
        """A fresh monitor of this callback's area (its row in the table of areas)."""
        return AREA_SPECS[self.area].build(self.config, type(self).__name__)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__, _run=None, _leads=False, _run_monitors=[])
        return {key: value for key, value in state.items() if not (value is None and key in BATCH_HOOKS)}

    @property
    def failures(self) -> Failures:
        return self._run.failures if self._run is not None else self._failures

    @property
    def run(self) -> Run | None:
        """The run this callback takes part in (between ``setup`` and the end of fit)."""
        return self._run

    @property
    def state_key(self) -> str:
        # Lightning reads this on every hook call (profiler labels), so it is built once.
        key = self.__dict__.get("_state_key")
        if key is None:
            key = self._state_key = self._generate_state_key(
                **{name: getattr(self.config, name) for name in self.own_fields})
        return key

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        check_trainer(trainer)  # a pytorch_lightning too old to serve: what to install, before any step
        run = getattr(trainer, RUN_ATTRIBUTE, None)
        run_config = None
        if run is None or run.finished:  # this callback leads: the run's settings from every debug callback
            ours = [c for c in trainer.callbacks if isinstance(c, DebugCallback)]
            run_config = run_wide_config(_configs_leader_first(self, ours))
        self._join(trainer, pl_module, run_config)

    @guarded
    def _join(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", run_config: DebugConfig | None) -> None:
        self.monitor = self.make_monitor()
        source = type(self).__name__
        self.companions = companion_monitors(self.monitor.area, self.config, source)
        self._leave()  # a setup that fails below leaves this callback out of the fit, not half in it
        run = getattr(trainer, RUN_ATTRIBUTE, None)
        leads = run is None or run.finished
        run_wide = run_monitors(self.config, source) if leads else []
        if leads:
            config = run_config or self.config
            run = Run(config, LightningContext(trainer, pl_module, config), run_wide)
            setattr(trainer, RUN_ATTRIBUTE, run)
        for monitor in (self.monitor, *self.companions):
            run.add(monitor)
        run.ledger.notes_hooks = True
        self._run, self._leads, self._run_monitors = run, leads, run_wide
        self._rows = RowLogger()
        if leads:
            self._timed_loggers = count_logger_writes(trainer.loggers, run.session.own_time,
                                                      self._rows if run.logs_on_rows else None)
        self._unsubscribe_idle_hooks()

    def _unsubscribe_idle_hooks(self) -> None:
        """Answer None for the batch hooks this callback has no use for during this fit: Lightning calls every
        callable hook on every batch inside a profiler context, a cost for nothing in the callbacks that do not lead
        and in Lightning's no-op hooks. A subclass's own hook is left alone; :meth:`_leave` puts them back."""
        self._restore_hooks()
        for name in BATCH_HOOKS:
            own = getattr(type(self), name)
            if own is getattr(Callback, name) or (not self._leads and own is getattr(DebugCallback, name)):
                setattr(self, name, None)

    def _restore_hooks(self) -> None:
        for name in BATCH_HOOKS:
            if name in self.__dict__ and self.__dict__[name] is None:
                del self.__dict__[name]

    def _leave(self) -> None:
        if self._leads:
            self.failures.call("logging debug scalars", self._rows.flush)
        restore_logger_writes(self.__dict__.pop("_timed_loggers", []))
        self._run, self._leads, self._run_monitors = None, False, []
        self._restore_hooks()

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._leads:
            self._rows.start(trainer, pl_module)
            self._run.start(trainer.global_step)  # type: ignore[union-attr]

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._leads:
            self._run.epoch_start(trainer.global_step)  # type: ignore[union-attr]

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._leads:
            run = self._run
            if self._rows.holds:  # the last row's scalars, where Lightning wrote no row to take them
                run.session.own_time.call(run.failures.call, "logging debug scalars",  # type: ignore[union-attr]
                                          self._rows.flush)
            run.context.batch_idx = batch_idx  # type: ignore[union-attr]
            run.context.epoch = trainer.current_epoch  # type: ignore[union-attr]
            run.batch_start(trainer.global_step, batch, (batch, batch_idx))  # type: ignore[union-attr]

    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        if self._leads:
            self._run.before_backward(trainer.global_step, loss)  # type: ignore[union-attr]

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._leads:
            if self._run.before_optimizer_step(trainer.global_step, optimizer) is Decision.STOP:  # type: ignore[union-attr]
                trainer.should_stop = True

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._leads:
            run = self._run
            run.after_optimizer_step(trainer.global_step)  # type: ignore[union-attr]
            run.batch_end(batch)  # type: ignore[union-attr]
            if run.logs_on_rows and self._rows.batch_end(trainer, pl_module, batch_idx):  # type: ignore[union-attr]
                run.logging_row(lambda values: self._rows.log(trainer, values))  # type: ignore[union-attr]

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._leads and self._rows.holds:
            self._run.session.own_time.call(self.failures.call, "logging debug scalars",  # type: ignore[union-attr]
                                            self._rows.flush)

    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._leads:
            self._run.evaluation(trainer.global_step, True, batch)  # type: ignore[union-attr]

    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._leads:
            self._run.evaluation(trainer.global_step, False)  # type: ignore[union-attr]

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._leads:
            self._run.evaluation(trainer.global_step, False)  # type: ignore[union-attr]
            if not trainer.sanity_checking:  # what the performance monitor quotes for a slow step
                self._run.ledger.note(trainer.global_step, FrameworkWork.VALIDATION)  # type: ignore[union-attr]

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        if self._leads and self._run is not None:
            self._run.ledger.note(trainer.global_step, FrameworkWork.CHECKPOINT_SAVING)

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._leads:
            self._run.finalize(max(trainer.global_step - 1, 0))  # type: ignore[union-attr]

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self._run is not None:
            if self._leads:  # before the report: its end time bounds the run's points in TensorBoard
                self.failures.call("logging debug scalars", self._rows.flush)
            if self._leads and not self._run.abandon():  # abandoned: a Tuner's fit, which trains nothing we see
                self._run.finish(RunStatus.FINISHED, trainer.global_step)
            self._leave()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self._run is None:
            return
        if self._leads:
            self.failures.call("logging debug scalars", self._rows.flush)
            self._run.exception(trainer.global_step, exception)
            self._run.finish(RunStatus.of(exception), trainer.global_step, f"{type(exception).__name__}: {describe(exception)}",
                             exit_code(exception))
        self._leave()

    def state_dict(self) -> dict[str, Any]:
        """The monitor's counts and episodes; its companions' and run-wide monitors' under ``companions``."""
        if self._run is not None:
            self._run.deliver_pending()  # a checkpoint is a sync point anyway; include pending checks
        state = self.monitor.state_dict()
        others = monitor_states((*self.companions, *self._run_monitors))
        return dict(state, companions=others) if others else state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict)
        load_monitor_states((*self.companions, *self._run_monitors), state_dict.get("companions", {}))


def _configs_leader_first(leader: DebugCallback, callbacks: list[DebugCallback]) -> dict[str, DebugConfig]:
    """The callbacks' configs by name (class, and position when a class repeats), the leader first."""
    ordered = [leader, *(c for c in callbacks if c is not leader)]
    names = [type(c).__name__ for c in ordered]
    return {(name if names.count(name) == 1 else f"{name} #{i}"): c.config
            for i, (name, c) in enumerate(zip(names, ordered), 1)}


register_cli_usage(DebugCallback, DebugConfig)  # a cross-field error under LightningCLI: exit 2 (callbacks/cli_usage)
