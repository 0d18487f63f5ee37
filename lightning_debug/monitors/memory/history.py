"""The CUDA allocator's history with Python stacks, on only while needed (a few microseconds per allocation):
from a suspected leak until it is explained, or the whole run at EXPERT; another's recording is never stopped::

    >>> history = AllocationHistory(max_entries=1000)
    >>> history.ours, history.stop(), history.ours
    (False, None, False)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# torch's allocator history is private API: each function is looked up when used, and where a torch lacks one,
# recording is a failure said once (the memory checks go on without allocation sites).


def snapshot() -> dict[str, Any]:
    """The allocator's snapshot (segments and the recorded history)."""
    take = getattr(torch.cuda.memory, "_snapshot", None)
    if take is None:
        raise RuntimeError("this torch has no torch.cuda.memory._snapshot: no allocation sites")
    return take()


def record_options(record: Any, max_entries: int) -> dict[str, Any]:
    """The keywords the installed ``record`` takes: torch < 2.3's has no ``clear_history``::

        >>> def old_record(enabled="all", context="all", stacks="all", max_entries=1): pass
        >>> sorted(record_options(old_record, 10))
        ['context', 'enabled', 'max_entries', 'stacks']
    """
    options: dict[str, Any] = dict(enabled="all", context="alloc", stacks="python", max_entries=max_entries,
                                   clear_history=True)
    try:
        accepted = inspect.signature(record).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return options
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return options
    return {name: value for name, value in options.items() if name in accepted}


def history_enabled() -> bool:
    """Whether the CUDA allocator records its history now (by anyone)."""
    query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


class AllocationHistory:
    """Switches the recording on and off, remembering whether it switched it on."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.ours = False

    def start(self) -> Exception | None:
        """Record from now on (unless already recording); the failure when it cannot."""
        if history_enabled():
            return None
        record = getattr(torch.cuda.memory, "_record_memory_history", None)
        if record is None or getattr(torch.cuda.memory, "_snapshot", None) is None:
            return RuntimeError("this torch has no torch.cuda.memory._record_memory_history/_snapshot: no allocation "
                                "history")
        try:
            record(**record_options(record, self.max_entries))
        except Exception as failure:
            return failure
        self.ours = True
        return None

    def stop(self) -> None:
        """Stop recording, if this object started it."""
        if self.ours:
            self.ours = False
            torch.cuda.memory._record_memory_history(enabled=None)
