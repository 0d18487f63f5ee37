"""Memory outside the training process's own heap: the DataLoader's worker processes, and file pages.

A Dataset that keeps something from every item it serves grows in its workers, where the training process's readings
(and its tensor census) do not look (pytorch/pytorch#62066, #5902). A memory-mapped data set (Arrow, ``np.memmap``)
read through an epoch grows the resident set by page cache the kernel takes back: no leak. Real Trainer runs with
real worker processes; the events and report are read back.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import MemoryProfilerCallback
from lightning_debug.checks.memory import MemoryReading
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report
from tests.harness.worker_records import ROW, CachedRecords, Records

pytestmark = pytest.mark.timeout(180)
SPAWN = "spawn"
"""The workers' start method. A forked worker inherits the training process's heap, and its free chunks first take what
a worker keeps without growing its resident set (copied pages stay resident once): in a test process that ran other
tests first, hundreds of MB (docs/memory.md). Spawned workers start with an empty heap, as forkserver's do."""


class ReadsRecords(TinyRegressor):
    """``keep_batches=True``: the training step keeps every batch it was given (shared memory from the workers)."""

    def __init__(self, dataset: Dataset, workers: int, keep_batches: bool = False) -> None:
        super().__init__()
        self.dataset, self.workers, self.keep_batches = dataset, workers, keep_batches
        self.batches: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step((batch[0][:, :8], batch[1]), batch_idx)
        if self.keep_batches:  # read whole, as a step that uses them does: a page of it untouched is not resident
            self.batches.append(batch[0])
            loss = loss + 0.0 * batch[0].mean()
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=16, num_workers=self.workers, persistent_workers=self.workers > 0,
                          multiprocessing_context=SPAWN if self.workers else None)


class FilePages(pl.Callback):
    """The plant's check: the file pages the reading processes map at the last batch (the twin must grow them)."""

    def __init__(self, workers: int) -> None:
        self.workers, self.mapped_mb = workers, 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == trainer.max_steps - 1:
            pids = [worker.pid for worker in multiprocessing.active_children()] if self.workers else ["self"]
            self.mapped_mb = sum(file_pages(pid) for pid in pids) / 2**20


def file_pages(pid: object) -> int:
    with open(f"/proc/{pid}/status", "rb") as handle:
        line = next(line for line in handle if line.startswith(b"RssFile:"))
    return int(line.split()[1]) * 1024


def warnings_of(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if e["severity"] in ("warning", "error", "critical")]


def fit(tmp_path: Path, model: ReadsRecords, steps: int, *callbacks: pl.Callback) -> pl.Trainer:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=10), *callbacks],
                           max_steps=steps, limit_val_batches=0, log_every_n_steps=10)
    trainer.fit(model)
    return trainer


def test_a_cache_that_grows_in_the_loader_workers_is_named(tmp_path: Path) -> None:
    """1 MB a step kept across two persistent workers: the training process's memory is flat, the workers' is not."""
    trainer = fit(tmp_path, ReadsRecords(Records(16 * 200, keep=True), workers=2), steps=150)
    growth = [e for e in warnings_of(trainer) if e.get("episode") == "start"]
    assert [e["kind"] for e in growth] == ["memory_growth"], warnings_of(trainer)
    event = growth[0]
    assert event["details"]["series"] == "workers_rss" and event["details"]["mb_per_step"] >= 0.8
    assert "2 DataLoader worker processes" in event["message"] and "lru_cache" in event["message"], event["message"]
    report = read_report(debug_dir(trainer))
    assert report["stats"]["memory/workers_rss_mb"]["max"] > report["stats"]["memory/workers_rss_mb"]["min"] + 64
    assert report["sections"]["memory"]["growth"]["trends"]["cpu_rss"]["significant"] is False


class ShuffledEpochs(ReadsRecords):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                          multiprocessing_context=SPAWN)


@pytest.mark.parametrize("per_serving", [False, True])
def test_a_cache_each_worker_fills_slower_every_epoch_is_told_from_a_leak(tmp_path: Path, per_serving: bool) -> None:
    """Two epochs of 150 steps. The bounded cache was a `memory_growth` warning at step 160, its window across the end
    of epoch 0; the growth's pace after an epoch's end is now compared with its pace before (`EPOCH_PACE`). Later
    epochs are left out: their growth, a few MB read from the workers' resident sets, is too small for its pace to be
    read reliably (one run of four epochs under a loaded CI named it at step 510: docs/memory.md)."""
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=10)], max_epochs=2,
                           max_steps=-1, limit_val_batches=0, log_every_n_steps=10)
    trainer.fit(ShuffledEpochs(CachedRecords(per_serving=per_serving), workers=2))
    workers = read_report(debug_dir(trainer))["stats"]["memory/workers_rss_mb"]
    assert workers["max"] - workers["min"] > 50, "the plant: the workers grew by their caches"
    growth = [e for e in warnings_of(trainer) if e.get("episode") == "start"]
    if per_serving:
        assert [e["kind"] for e in growth] == ["memory_growth"], warnings_of(trainer)
        assert growth[0]["details"]["series"] == "workers_rss"
    else:
        assert warnings_of(trainer) == []


def test_loader_workers_that_keep_nothing_are_read_and_quiet(tmp_path: Path) -> None:
    trainer = fit(tmp_path, ReadsRecords(Records(16 * 200), workers=2), steps=150)
    assert warnings_of(trainer) == []
    report = read_report(debug_dir(trainer))
    assert report["stats"]["memory/workers_rss_mb"]["count"] >= 10
    assert report["sections"]["memory"]["growth"]["trends"]["workers_rss"]["readings"] >= 10


@pytest.mark.parametrize("workers", [0, 2])
def test_a_memory_mapped_data_set_read_through_an_epoch_is_no_leak(tmp_path: Path, workers: int) -> None:
    """150 MB of records read from a mapped file, 1 MB a step: the readers' resident sets grow by file pages."""
    path = tmp_path / "records.f32"
    (torch.arange(16 * 150.0)[:, None] % 97 / 97 + torch.zeros(ROW)).numpy().tofile(path)  # distinct records
    pages = FilePages(workers)
    trainer = fit(tmp_path, ReadsRecords(Records(16 * 150, path=path), workers=workers), 150, pages)
    assert pages.mapped_mb > 100, "the plant: the file's pages are mapped by the processes that read it"
    assert warnings_of(trainer) == []


def _fit_keeping_batches(root: Path) -> None:
    fit(root, ReadsRecords(Records(16 * 200), workers=2, keep_batches=True), steps=150)


def test_batches_kept_from_the_loader_workers_are_named(tmp_path: Path) -> None:
    """The twin of leaving file pages out: the workers hand batches over in shared memory, which the C heap does not
    count and the resident set without file pages does. The fit runs in a process of its own: this series is the
    training process's, and a test process that ran other tests first may hand memory back to the system during it
    (the suite missed the growth once in about ten runs under two busy workers)."""
    child = multiprocessing.get_context(SPAWN).Process(target=_fit_keeping_batches, args=(tmp_path,))
    child.start()
    child.join(150)
    assert child.exitcode == 0
    [events] = [read_events(path.parent) for path in tmp_path.rglob("events.jsonl")]
    warnings = [e for e in events if e["severity"] in ("warning", "error", "critical")]
    growth = [e for e in warnings if e.get("episode") == "start"]
    assert [e["kind"] for e in growth] == ["memory_growth"], warnings
    assert growth[0]["details"]["series"] == "cpu_rss" and growth[0]["details"]["mb_per_step"] >= 0.8
    assert growth[0]["details"]["tensors"][0]["shape"] == [16, ROW], growth[0]["details"]["tensors"]


def test_the_leak_series_leave_file_pages_out() -> None:
    reading = MemoryReading(cpu_rss=900, cpu_available=1, cpu_total=2, cpu_heap=None, cpu_rss_file=600,
                            workers_rss=70, workers=2)
    assert reading.leak_series() == {"cpu_rss": 300.0, "workers_rss": 70.0}
    assert reading.metrics()["cpu_rss_mb"] == 900 / 2**20 and reading.metrics()["workers_rss_mb"] == 70 / 2**20
    assert "workers_rss" not in MemoryReading(1, 1, 2, None).leak_series()


@pytest.mark.parametrize("cleared", [False, True])
def test_a_growth_waiting_for_an_epoch_the_run_ends_inside_is_judged_at_the_end(tmp_path: Path, cleared: bool) -> None:
    """A one-pass Accelerate loop: the epoch's length is known (``train_dataloader``), the run's is not, so a growth
    waits for the epoch's end, which is the run's. A leak (1 MB a step kept) ended "suspected" with no finding; it is
    named at the end. Outputs kept for the epoch and cleared after the loop, before ``finish()``, are released."""
    from accelerate import Accelerator

    from lightning_debug import DebugConfig
    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness.toolkit import fresh_accelerate, regression_data, run_dir

    kept: list[torch.Tensor] = []
    with fresh_accelerate():
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
        model = nn.Linear(8, 1)
        prepared, optimizer, loader = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.01),
            DataLoader(regression_data(samples=16 * 300), batch_size=16))
        debugger = AccelerateDebugger(accelerator, prepared, optimizer, DebugConfig(
            memory_profiling_frequency=10, save_plots=False, print_summary=False), train_dataloader=loader)
        for x, y in loader:
            debugger.backward(nn.functional.mse_loss(prepared(x), y))
            optimizer.step()
            optimizer.zero_grad()
            kept.append(torch.randn(16, ROW))
        if cleared:
            kept.clear()
        debugger.finish()
    events = [e for e in read_events(run_dir(tmp_path / "debug_outputs")) if e["severity"] == "warning"]
    report = read_report(run_dir(tmp_path / "debug_outputs"))
    if cleared:
        assert events == [] and report["sections"]["memory"]["growth"]["status"] != "growing", events
    else:
        assert [e["kind"] for e in events] == ["memory_growth"], events
        assert events[0]["details"]["tensors"][0]["shape"] == [16, ROW], events[0]["details"]["tensors"]
