"""What every lightning-debug callback shares: config, session, resume, report, failure policy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_debug.config import DebugConfig, resolve_config
from lightning_debug.core.guard import guarded
from lightning_debug.core.monitor import Monitor
from lightning_debug.core.session import DebugSession
from lightning_debug.core.step_numerics import AllGather, StepNumerics

SESSION_ATTRIBUTE = "_lightning_debug_session"


def resolve_output_dir(trainer: "pl.Trainer", config: DebugConfig) -> Path | None:
    """``debug_output_dir``, under the trainer's ``log_dir`` when relative. Call on every rank."""
    if not config.save_debug_info:
        return None
    path = Path(config.debug_output_dir).expanduser()
    if not path.is_absolute():
        path = Path(trainer.log_dir or trainer.default_root_dir) / path
    return path


def lightning_sink(trainer: "pl.Trainer") -> Callable[[dict[str, float], int], None] | None:
    if not trainer.loggers:
        return None

    def sink(metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    return sink


def session_for(trainer: "pl.Trainer", config: DebugConfig) -> DebugSession:
    """The run's shared session, created by the first callback to ask."""
    session = getattr(trainer, SESSION_ATTRIBUTE, None)
    if session is None:
        session = DebugSession(resolve_output_dir(trainer, config), trainer.is_global_zero,
                               lightning_sink(trainer), config.to_dict())
        setattr(trainer, SESSION_ATTRIBUTE, session)
        if trainer.is_global_zero:
            from lightning_debug.tensorboard import attach_to_loggers

            attach_to_loggers(trainer.loggers, session)
    return session


def all_gather_for(trainer: "pl.Trainer") -> AllGather | None:
    if trainer.world_size <= 1:
        return None
    return lambda tensor: trainer.strategy.all_gather(tensor)


def grads_are_sharded(trainer: "pl.Trainer") -> bool:
    return type(trainer.strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")


class DebugCallback(Callback):
    """Base of the four callbacks: a thin adapter from Lightning hooks to one area's monitor.

    It owns what must behave the same everywhere: the validated :class:`DebugConfig` (a config
    object and/or keyword overrides), attaching the monitor to the run's shared
    :class:`DebugSession`, ``state_dict`` for resume (the monitor's counts and episodes), the
    report at fit end or on an exception, and the rule that a failing check warns once and never
    stops training.
    """

    own_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: DebugConfig | None = None, **overrides: Any) -> None:
        self.config = resolve_config(config, **overrides)
        self.monitor: Monitor = self.make_monitor()
        self._batch_idx = 0

    def make_monitor(self) -> Monitor:
        raise NotImplementedError

    @property
    def state_key(self) -> str:
        # Lightning reads this on every hook call (profiler labels), so it is built once.
        key = self.__dict__.get("_state_key")
        if key is None:
            key = self._state_key = self._generate_state_key(
                **{name: getattr(self.config, name) for name in self.own_fields})
        return key

    @guarded
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            self.monitor.attach(session_for(trainer, self.config))

    @guarded
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._batch_idx = batch_idx
        if self.monitor.attached:
            self.monitor.session.end_step(trainer.global_step - 1)

    @guarded
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.monitor.attached:
            self.monitor.session.poll(final=True)
            self.finalize(trainer, pl_module)

    @guarded
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or not self.monitor.attached:
            return
        self.monitor.session.finish("finished", trainer.global_step, final=self._last_to_finish())
        self.restore(trainer)
        self.monitor.detach()

    @guarded
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if not self.monitor.attached:
            return
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
        session = self.monitor.session
        try:
            session.poll(final=True)
            self.finalize(trainer, pl_module)
        finally:
            session.finish(status, trainer.global_step, f"{type(exception).__name__}: {exception}",
                           final=self._last_to_finish())
            self.restore(trainer)
            self.monitor.detach()

    def _last_to_finish(self) -> bool:
        """True for the last callback of the run still attached: its finish ends the run (plots, summary)."""
        return not any(getattr(other, "attached", False) for other in self.monitor.session.contributors
                       if other is not self.monitor)

    def finalize(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Last measurements at the end of fit or on an exception; subclasses override."""

    def restore(self, trainer: "pl.Trainer") -> None:
        """Undo global changes (anomaly mode, hooks, profilers); subclasses override."""

    def state_dict(self) -> dict[str, Any]:
        if self.monitor.attached:
            self.monitor.session.poll(final=True)  # a checkpoint is a sync point anyway; include pending checks
        return self.monitor.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict)

    def position(self, trainer: "pl.Trainer") -> dict[str, int]:
        return {"epoch": trainer.current_epoch, "batch": self._batch_idx}

    def step_numerics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int) -> StepNumerics:
        """This optimizer step's shared gradient/parameter pass (computed once for all callbacks)."""
        return self.monitor.session.step_numerics(step, pl_module.named_parameters, all_gather_for(trainer),
                                                  grads_are_sharded(trainer))


def config_field_docs() -> dict[str, str]:
    """Each DebugConfig field's one-paragraph description, from the ``Args:`` section of its docstring."""
    import dataclasses
    import inspect

    docs: dict[str, list[str]] = {}
    fields = {f.name for f in dataclasses.fields(DebugConfig)}
    current: str | None = None
    in_args = False
    for line in inspect.cleandoc(DebugConfig.__doc__ or "").splitlines():
        if line.strip() == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        if line and not line.startswith(" "):
            break
        name, _, text = line.strip().partition(":")
        if line.startswith("    ") and not line.startswith("     ") and name in fields:
            current = name
            docs[current] = [text.strip()]
        elif current is not None and line.strip():
            docs[current].append(line.strip())
    return {name: " ".join(parts) for name, parts in docs.items()}


def _document_keyword_overrides() -> None:
    """Help text for every callback's keyword overrides (LightningCLI ``--trainer.callbacks.help CLASS``).

    jsonargparse reads parameter descriptions from base-class docstrings too, so one ``Args:``
    section here, generated from DebugConfig's, documents the overrides of all four callbacks.
    """
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(DebugConfig)}
    lines = ["", "", "    Args:",
             "        config: The shared settings (a DebugConfig); null means the defaults. The keyword arguments",
             "            override its fields for this callback; null keeps the value from ``config``."]
    for name, text in config_field_docs().items():
        default = defaults[name]
        shown = default.name if hasattr(default, "name") else repr(default)
        lines.append(f"        {name}: {text} Null: the value in ``config`` (DebugConfig default: {shown}).")
    DebugCallback.__doc__ = (DebugCallback.__doc__ or "").rstrip() + "\n".join(lines) + "\n"


_document_keyword_overrides()
