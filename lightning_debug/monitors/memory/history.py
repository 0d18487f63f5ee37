"""The CUDA allocator's history of every allocation with its Python stack, on only while needed (it costs a
few microseconds per allocation): from a suspected leak until it is explained, or the whole run at EXPERT;
a recording someone else started is never switched off.

Example::

    >>> history = AllocationHistory(max_entries=1000)
    >>> history.ours, history.stop(), history.ours
    (False, None, False)
"""

from __future__ import annotations

import torch


def history_enabled() -> bool:
    """Whether the CUDA allocator records its history now (by anyone); False without CUDA."""
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
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
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=self.max_entries, clear_history=True)
        except Exception as failure:
            return failure
        self.ours = True
        return None

    def stop(self) -> None:
        """Stop recording, if this object started it."""
        if self.ours:
            self.ours = False
            torch.cuda.memory._record_memory_history(enabled=None)
