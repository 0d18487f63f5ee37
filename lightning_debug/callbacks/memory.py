"""MemoryProfilerCallback: CPU and CUDA memory, leaks found and explained, OOM post-mortem."""

from __future__ import annotations

from lightning_debug.callbacks.base import DebugCallback
from lightning_debug.config import Area
from lightning_debug.core.kinds import with_kinds


class MemoryProfilerCallback(DebugCallback):
    """Memory over the run, what grows and why, and what to do after an out-of-memory error.

    Every ``memory_profiling_frequency`` optimizer steps, before the optimizer step, it reads host-side
    counters only (no GPU sync): process RSS, available system memory, the C heap in use, and on CUDA
    allocated, reserved, peak since the last check, fragmentation and the share of the device, logged as
    ``debug/memory/*``. The C heap, whose reading walks the allocator's free lists (milliseconds when
    fragmented), is read once per logging row, every 8 steps and on the readings the growth trend takes.

    A steady rise is told from allocator and warm-up noise by a robust (Theil-Sen) trend over the last
    readings; a census of live tensors (and on CUDA an allocation history) is taken only then and again one
    check later, and the finding gives MB per step, the step at which memory runs out, and which tensors pile
    up, e.g. "~1 tensor/step with grad_fn MseLossBackward0 stays alive: a list keeps losses with their graphs;
    store loss.detach() or loss.item()". After an out-of-memory error, ``oom_step<N>.md`` in the debug output
    directory holds the phase, step, batch shapes, largest live tensors, ``torch.cuda.memory_summary()``, a
    snapshot for pytorch.org/memory_viz when allocation history was on, and the fixes.

    ``level=ADVANCED`` measures per-phase memory (forward, backward, optimizer) on check steps;
    ``level=EXPERT`` records CUDA allocation history for the whole run.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_debug import MemoryProfilerCallback
        >>> trainer = pl.Trainer(callbacks=[MemoryProfilerCallback(memory_profiling_frequency=10)],
        ...                      max_steps=1, logger=False, enable_progress_bar=False)
    """

    area = Area.MEMORY


MemoryProfilerCallback.__doc__ = with_kinds(MemoryProfilerCallback.__doc__, (Area.MEMORY,))
