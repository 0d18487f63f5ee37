"""MemoryProfilerCallback: CPU and CUDA memory, leaks found and explained, OOM post-mortem."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_debug.callbacks.base import DebugCallback, guarded, resolve_output_dir
from lightning_debug.checks.memory import is_out_of_memory
from lightning_debug.config import DebugConfig, DebugLevel
from lightning_debug.monitors.memory import MemoryMonitor


class MemoryProfilerCallback(DebugCallback):
    """Memory over the run, what grows and why, and what to do after an out-of-memory error.

    Every ``memory_profiling_frequency`` optimizer steps, after backward and before the optimizer
    step, it reads host-side counters only (no GPU sync): process RSS, available system memory, the
    C heap in use, and on CUDA allocated, reserved, peak since the last check (the peak counter is
    reset each check), fragmentation and the share of the device. They are logged as
    ``debug/memory/*`` and summarised in the report.

    - ``memory_high``: CUDA reserved above ``memory_high_fraction`` of the device, or system memory
      used above that fraction of the machine.
    - ``memory_growth``: a robust (Theil-Sen) trend over the last readings rises steadily beyond
      allocator and warm-up noise. A census of live tensors (and on CUDA an allocation history) is
      taken only then and again one check later; the event gives MB per step, the step at which
      memory runs out, and which tensors pile up, e.g. "~1 tensor/step with grad_fn
      MseLossBackward0 stays alive: a list keeps losses with their graphs; store loss.detach() or
      loss.item()".
    - ``oom``: on an out-of-memory error, ``oom_step<N>.md`` in the debug output directory (phase,
      step, batch shapes, largest live tensors, ``torch.cuda.memory_summary()``, a snapshot for
      pytorch.org/memory_viz when allocation history was on, the fixes), then the error propagates
      unchanged.
    - ``level=ADVANCED``: per-phase memory (forward, backward, optimizer) on check steps;
      ``level=EXPERT`` records CUDA allocation history for the whole run.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import MemoryProfilerCallback
        >>> trainer = pl.Trainer(callbacks=[MemoryProfilerCallback(memory_profiling_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    own_fields = ("memory_profiling_frequency",)

    def __init__(
        self,
        config: DebugConfig | None = None,
        *,
        memory_profiling_frequency: int | None = None,
        log_memory: bool | None = None,
        level: DebugLevel | str | None = None,
        save_debug_info: bool | None = None,
        debug_output_dir: str | None = None,
        memory_high_fraction: float | None = None,
    ) -> None:
        super().__init__(config, memory_profiling_frequency=memory_profiling_frequency, log_memory=log_memory,
                         level=level, save_debug_info=save_debug_info, debug_output_dir=debug_output_dir,
                         memory_high_fraction=memory_high_fraction)
        self._batch: Any = None
        self._step_in_progress = 0

    def make_monitor(self) -> MemoryMonitor:
        return MemoryMonitor(self.config, type(self).__name__)

    @property
    def memory(self) -> MemoryMonitor:
        return self.monitor  # type: ignore[return-value]

    @guarded
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self.memory.postmortem_dir = resolve_output_dir(trainer, self.config)
            self.memory.rank = trainer.global_rank

    @guarded
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.memory.start(pl_module.device)

    @guarded
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._batch = batch
        self._step_in_progress = trainer.global_step
        self.memory.phase("forward", trainer.global_step)

    @guarded
    def on_before_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", loss: torch.Tensor) -> None:
        self.memory.phase("backward", trainer.global_step)

    @guarded
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        self.memory.phase("optimizer", step)
        if self.monitor.attached and self.memory.due(step):
            self.memory.measure(step, self.position(trainer), pl_module.device)

    @guarded
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.memory.phase("end", self._step_in_progress)
        self._batch = None

    @guarded
    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch = batch
        self.memory.phase("validation", trainer.global_step)

    @guarded
    def on_validation_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.memory.phase("end", trainer.global_step)
        self._batch = None

    @guarded
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        try:
            if self.monitor.attached and is_out_of_memory(exception):
                self.memory.post_mortem(exception, trainer.global_step, self.position(trainer), self._batch)
        finally:
            self._batch = None
            super().on_exception(trainer, pl_module, exception)

    def finalize(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.memory.finalize(max(trainer.global_step - 1, 0), self.position(trainer))

    def restore(self, trainer: "pl.Trainer") -> None:
        self.memory.restore()
