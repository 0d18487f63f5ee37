"""The CUDA allocator's history of every allocation with its Python stack, on only while needed.

Recording costs a few microseconds per allocation, so the memory monitor switches it on when a
leak is suspected (or for the whole run at EXPERT level, so that an OOM leaves a full snapshot) and
off again once the leak is explained, never switching off a recording someone else started.

Example::

    >>> history = AllocationHistory(max_entries=1000)
    >>> history.ours, history.stop(), history.ours
    (False, None, False)
"""

from __future__ import annotations

from typing import Any

import torch


# torch's allocator history is private API (``torch.cuda.memory._record_memory_history``, ``_snapshot``, the
# ``_cuda_isHistoryEnabled`` query): probed here, and where a torch lacks one, recording is a failure said once.
RECORD = getattr(torch.cuda.memory, "_record_memory_history", None)
SNAPSHOT = getattr(torch.cuda.memory, "_snapshot", None)
IS_RECORDING = getattr(torch._C, "_cuda_isHistoryEnabled", None)


def snapshot() -> dict[str, Any]:
    """The allocator's snapshot (segments and the recorded history)."""
    if SNAPSHOT is None:
        raise RuntimeError("this torch has no torch.cuda.memory._snapshot: no allocation sites")
    return SNAPSHOT()


def history_enabled() -> bool:
    """Whether the CUDA allocator records its history now (by anyone); False without CUDA."""
    query = IS_RECORDING
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


class AllocationHistory:
    """Switches the recording on and off, remembering whether it was this object that switched it on."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.ours = False

    def start(self) -> Exception | None:
        """Record from now on (kept as is when already recording); the failure when it cannot."""
        if history_enabled():
            return None
        if RECORD is None or SNAPSHOT is None:
            return RuntimeError("this torch has no torch.cuda.memory._record_memory_history/_snapshot: no allocation "
                                "history")
        try:
            RECORD(enabled="all", context="alloc", stacks="python", max_entries=self.max_entries, clear_history=True)
        except Exception as failure:
            return failure
        self.ours = True
        return None

    def stop(self) -> None:
        """Stop recording, if this object started it."""
        if self.ours:
            self.ours = False
            RECORD(enabled=None)  # type: ignore[misc]
