"""The out-of-memory post-mortem's data: is it an OOM, what the batch held, what to try.

Example::

    >>> from lightning_debug.checks.memory.oom import is_out_of_memory, oom_fixes
    >>> is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")), len(oom_fixes(None))
    (True, 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_debug.checks.memory.readings import MemoryPhase, format_bytes, shape_text

OOM_PATTERNS = ("out of memory", "can't allocate memory", "cannot allocate memory")
OUT_OF_MEMORY: type[Exception] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
"""The allocator's out-of-memory error: ``torch.OutOfMemoryError`` (any accelerator) where the installed torch
has it, else ``torch.cuda.OutOfMemoryError`` (older torch: 2.2 has only that one), which it aliases."""


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA and other accelerators), Python's ``MemoryError``, or a
    RuntimeError whose message says an allocation failed (CPU allocator, MPS)."""
    if isinstance(error, (OUT_OF_MEMORY, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    try:
        message = str(error).lower()
    except Exception:  # a user's exception whose __str__ raises is not an allocator's
        return False
    return any(pattern in message for pattern in OOM_PATTERNS)


def describe_batch(batch: Any, limit: int = 20) -> list[str]:
    """``'batch[0]: [16, 8] float32 on cpu (512 B)'`` for each tensor in a (nested) batch.

    Example::

        >>> import torch
        >>> describe_batch({"x": torch.zeros(2, 3)})
        ["batch['x']: [2, 3] float32 on cpu (24 B)"]
    """
    lines: list[str] = []

    def visit(value: Any, path: str, depth: int) -> None:
        if len(lines) >= limit or depth > 6:
            return
        if isinstance(value, torch.Tensor):
            lines.append(f"{path}: {shape_text(value.shape)} {str(value.dtype).removeprefix('torch.')} on "
                         f"{value.device} ({format_bytes(value.element_size() * value.numel())})")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for position, item in enumerate(value):
                visit(item, f"{path}[{position}]", depth + 1)

    visit(batch, "batch", 0)
    return lines


def oom_fixes(phase: MemoryPhase | None, fragmentation_share: float = 0.0) -> list[str]:
    """What to try after an out-of-memory error, the most specific first."""
    fixes = []
    if phase is MemoryPhase.OPTIMIZER:
        fixes.append("The optimizer step ran out: its state (Adam keeps two copies of every parameter) does "
                     "not fit. Shard it (FSDP / DeepSpeed ZeRO), use a lighter optimizer (SGD, 8-bit Adam), "
                     "or train fewer parameters.")
    if fragmentation_share > 0.1:
        fixes.append("Much memory is reserved but not allocated (fragmentation): set "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    fixes += [
        "Smaller batch: lower batch_size (a half roughly halves the activations).",
        "Gradient accumulation: keep the effective batch with Trainer(accumulate_grad_batches=k) and a batch "
        "k times smaller.",
        "Mixed precision: Trainer(precision='bf16-mixed') (or '16-mixed') halves activation memory.",
        "Activation checkpointing: torch.utils.checkpoint (or FSDP activation_checkpointing_policy) recomputes "
        "activations in backward instead of keeping them.",
    ]
    return fixes
