"""Data sets read by DataLoader workers in tests/integration/test_memory_workers.py, in a module of their own: a
spawned worker imports the module that defines its data set, and this one imports torch alone."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

ROW = 16384
"""Floats a record: 64 KB."""


class Records(Dataset):
    """Records of ``ROW`` floats; ``keep=True`` keeps a copy of each one served (a cache that only grows, in each
    worker); ``path`` reads them from a memory-mapped file instead of making them."""

    def __init__(self, count: int, keep: bool = False, path: Path | None = None) -> None:
        self.count, self.keep, self.path = count, keep, path
        self.kept: list[torch.Tensor] = []
        self._view: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.count

    def _mapped(self) -> torch.Tensor:
        if self._view is None:  # opened in the process that reads it (each worker maps the file itself)
            assert self.path is not None
            with open(self.path, "rb") as handle:
                buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._view = torch.frombuffer(buffer, dtype=torch.float32).view(self.count, ROW)
        return self._view

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self._mapped()[index] if self.path is not None else torch.full((ROW,), float(index % 7))
        if self.keep:
            self.kept.append(record.clone())
        return record.clone(), torch.zeros(1)


class CachedRecords(Dataset):
    """A record made on its first access and kept (64 KB), by index: a bounded cache. Two persistent workers read a
    shuffled epoch each, so each worker fills its own cache with the half it is given, a quarter more of the data
    set the next epoch, an eighth the one after: the workers grow all through the run, slower each epoch.
    ``per_serving=True`` is the leak beside it: a copy kept each time a record is served, at the same pace every
    epoch."""

    def __init__(self, count: int = 600, per_serving: bool = False) -> None:
        self.count, self.per_serving = count, per_serving
        self.cache: dict[Any, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (len(self.cache), index) if self.per_serving else index
        if key not in self.cache:
            self.cache[key] = torch.full((ROW,), float(index % 7))
        return self.cache[key].clone(), torch.zeros(1)
