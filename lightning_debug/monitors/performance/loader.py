"""The training DataLoader's settings that decide its throughput, and what to change when the loop waits for it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def describe_loader(loader: Any) -> dict[str, Any] | None:
    """The settings of a DataLoader that decide its throughput (duck-typed; None if unknown): of a DataLoader, the
    first of a list or dict of them, a CombinedLoader's ``iterables``, or a settings dict given as is.

    Example::

        >>> from torch.utils.data import DataLoader
        >>> describe_loader(DataLoader(list(range(8)), batch_size=4))["num_workers"], describe_loader({"num_workers": 2})
        (0, {'num_workers': 2})
    """
    if isinstance(loader, Mapping) and "num_workers" in loader:
        return dict(loader)
    for _ in range(4):
        if loader is None or hasattr(loader, "num_workers"):
            break
        if hasattr(loader, "iterables"):
            loader = loader.iterables
        elif isinstance(loader, Mapping):
            loader = next(iter(loader.values()), None)
        elif isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        else:
            return None
    if loader is None or not hasattr(loader, "num_workers"):
        return None
    return {"num_workers": int(loader.num_workers), "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "prefetch_factor": getattr(loader, "prefetch_factor", None),
            "batch_size": getattr(loader, "batch_size", None)}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), which worker advice counts.

    Example::

        >>> usable_cpus() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def loader_advice(settings: Mapping[str, Any] | None, uses_cuda: bool, cpus: int, restarts: bool = False) -> list[str]:
    """What to change in the DataLoader when the loop waits for it; ``restarts``: the waits are mostly the first
    batch of an epoch, where a loader without persistent workers starts them again.

    Example::

        >>> loader_advice({"num_workers": 0, "pin_memory": False, "persistent_workers": False}, True, 8)[0]
        'num_workers=0 loads every batch in the training process: set num_workers to 4-8 (this machine has 8 CPUs).'
    """
    if settings is None:
        return ["Use worker processes (DataLoader(num_workers=...)) and make __getitem__ cheaper "
                "(decode, resize and tokenize ahead of time)."]
    advice = []
    workers = settings.get("num_workers", 0)
    suggested = f"{min(4, cpus)}-{max(min(8, cpus), 1)}" if cpus > 4 else str(max(cpus - 1, 1))
    if workers == 0:
        advice.append(f"num_workers=0 loads every batch in the training process: set num_workers to {suggested} "
                      f"(this machine has {cpus} CPUs).")
    elif restarts and not settings.get("persistent_workers"):
        advice.append(f"The steps that wait are the first batch of an epoch, where the DataLoader starts its {workers} "
                      "worker(s) again: persistent_workers=True keeps them alive between epochs (and does not re-run "
                      "the dataset's setup).")
    else:
        advice.append(f"{workers} worker(s) cannot keep up: raise num_workers (this machine has {cpus} CPUs), "
                      "raise prefetch_factor, or make __getitem__ cheaper (pre-decode, cache, smaller files).")
        if not settings.get("persistent_workers"):
            advice.append("persistent_workers=True keeps the workers alive between epochs instead of restarting "
                          "them (and re-running the dataset's setup) every epoch.")
    if uses_cuda and not settings.get("pin_memory"):
        advice.append("pin_memory=True makes host-to-GPU copies faster and lets them overlap with compute.")
    return advice
