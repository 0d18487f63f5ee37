"""The out-of-memory post-mortem: the ``oom_step<N>`` document and the critical ``oom`` finding pointing at it::

    >>> from lightning_debug.checks.memory import MemoryPhase, MemoryReading, oom_fixes
    >>> evidence = OomEvidence(step=3, phase="backward", error="OutOfMemoryError: CUDA out of memory",
    ...                        reading=MemoryReading(1, 2, 3, None), batch=[], largest=[],
    ...                        fixes=oom_fixes(MemoryPhase.BACKWARD))
    >>> oom_finding(evidence, None, None).message[:52]
    'Out of memory at step 3 during backward (OutOfMemory'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.memory import MemoryReading
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity


@dataclass(frozen=True)
class OomEvidence:
    """What was seen when memory ran out."""

    step: int
    phase: str
    error: str
    reading: MemoryReading
    batch: list[str]
    largest: list[dict[str, Any]]
    fixes: list[str]
    cuda_summary: str | None = None


def fragmentation_share(reading: MemoryReading) -> float:
    """The share of the device reserved but not allocated (0 off CUDA): above a tenth, the fixes start with
    ``expandable_segments``::

        >>> fragmentation_share(MemoryReading(1, 2, 3, None, cuda_allocated=50, cuda_reserved=70, cuda_total=100))
        0.2
    """
    if reading.cuda_reserved is None or not reading.cuda_total:
        return 0.0
    return (reading.cuda_reserved - (reading.cuda_allocated or 0)) / reading.cuda_total


def oom_document(evidence: OomEvidence, snapshot: str | None) -> dict[str, Any]:
    """The ``oom_post_mortem`` document (rendered by the report as ``oom_step<N>.md``)."""
    return {"document": "oom_post_mortem", "step": evidence.step, "phase": evidence.phase, "error": evidence.error,
            "memory_mb": evidence.reading.metrics(), "batch": evidence.batch, "largest_tensors": evidence.largest,
            "fixes": evidence.fixes, "cuda_memory_summary": evidence.cuda_summary, "snapshot": snapshot}


def oom_finding(evidence: OomEvidence, path: str | None, snapshot: str | None) -> Finding:
    """The critical ``oom`` finding, pointing at the post-mortem at ``path``."""
    fixes = evidence.fixes
    first_line = evidence.error.splitlines()[0][:300]
    message = (f"Out of memory at step {evidence.step} during {evidence.phase} ({first_line})."
               + (f" Post-mortem: {path}." if path else "") + " " + " ".join(fixes[:-4])
               + " Try: a smaller batch, gradient accumulation (accumulate_grad_batches), mixed precision "
               "(precision='bf16-mixed'), activation checkpointing.")
    return Finding(Kind.OOM, Severity.CRITICAL, message, {
        "phase": evidence.phase, "error": evidence.error[:2000], "post_mortem": path,
        "snapshot": snapshot, "batch": evidence.batch, "largest_tensors": evidence.largest[:5],
        "memory_mb": evidence.reading.metrics(), "fixes": fixes})
