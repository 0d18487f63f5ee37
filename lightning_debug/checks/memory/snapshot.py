"""Where leaked CUDA memory was allocated, from a ``torch.cuda.memory._snapshot()``.

The allocation history (``_record_memory_history``) is on only while a leak is suspected (or for
the whole run at EXPERT level); its replay names the user's line whose allocations stay alive.

Example::

    >>> from lightning_debug.checks.memory.snapshot import allocation_site
    >>> allocation_site([{"filename": "/usr/lib/python3.12/site-packages/torch/nn.py", "line": 1, "name": "f"},
    ...                  {"filename": "/home/me/project/train.py", "line": 42, "name": "training_step"}])
    'project/train.py:42 in training_step'
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_debug.checks.memory.readings import MB

LIBRARY_PATH_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen", "/torch/", "/lightning/",
                        "/pytorch_lightning/", "/lightning_fabric/", "/lightning_debug/")


def allocation_site(frames: Sequence[Mapping[str, Any]]) -> str:
    """``file:line in function`` of the innermost frame outside torch, Lightning (either import name) and the
    standard library (the user's line that allocated), else of the innermost frame.

    Example::

        >>> allocation_site([{"filename": "/src/pytorch_lightning/loops/fit_loop.py", "line": 9, "name": "run"},
        ...                  {"filename": "/home/me/train.py", "line": 41, "name": "training_step"}])
        'me/train.py:41 in training_step'
    """
    chosen = None
    for frame in frames:
        filename = str(frame.get("filename", "")).replace("\\", "/")
        if filename and not any(marker in filename for marker in LIBRARY_PATH_MARKERS):
            chosen = frame
            break
    chosen = chosen or (frames[0] if frames else None)
    if chosen is None:
        return "unknown (no stack recorded)"
    parts = str(chosen.get("filename", "?")).replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{chosen.get('line', '?')} in {chosen.get('name', '?')}"


def cuda_leak_sites(snapshot: Mapping[str, Any], device_index: int = 0, min_alive: int = 2,
                    limit: int = 5) -> list[dict[str, Any]]:
    """Allocation sites whose allocations stay alive, from a ``torch.cuda.memory._snapshot()`` taken
    while ``_record_memory_history`` was on.

    The trace is replayed: an allocation is alive when no free follows it. A site that allocates
    every step and frees it again (activations, gradients) has few of its allocations alive; a leak
    keeps most of them, so sites with at least ``min_alive`` live allocations and at least half of
    their recorded allocations alive are returned, most bytes first.
    """
    traces = snapshot.get("device_traces") or []
    if device_index >= len(traces):
        return []
    alive: dict[int, tuple[str, int]] = {}
    allocations: Counter[str] = Counter()
    for entry in traces[device_index]:
        action = entry.get("action")
        if action == "alloc":
            site = allocation_site(entry.get("frames") or [])
            alive[entry["addr"]] = (site, int(entry.get("size", 0)))
            allocations[site] += 1
        elif action in ("free_requested", "free_completed"):
            alive.pop(entry.get("addr"), None)
    count: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for site, nbytes in alive.values():
        count[site] += 1
        size[site] += nbytes
    sites = [{"site": site, "alive": count[site], "alive_mb": size[site] / MB, "allocations": allocations[site]}
             for site in count if count[site] >= min_alive and 2 * count[site] >= allocations[site]]
    return sorted(sites, key=lambda site: -site["alive_mb"])[:limit]
