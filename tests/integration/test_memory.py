"""MemoryProfilerCallback and MemoryMonitor: scalars, memory_high, leaks found and explained, OOM post-mortem.

Real Trainer runs on CPU with tiny models; events, reports and TensorBoard files are read back.
"""

from __future__ import annotations

import multiprocessing
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_debug import DebugConfig, MemoryProfilerCallback
from lightning_debug.checks.memory import (
    GroupGrowth,
    census_growth,
    cuda_leak_sites,
    describe_batch,
    explain_growth,
    fit_trend,
    graph_growth,
    heap_in_use,
    is_out_of_memory,
    is_steady_growth,
    take_census,
)
from lightning_debug.monitors.memory import MemoryMonitor
from tests.harness.toolkit import (console_lines, 
    TinyRegressor,
    debug_dir,
    make_trainer,
    plain_run,
    read_events,
    read_report,
    read_scalars,
    regression_data,
)

pytestmark = pytest.mark.timeout(120)


class KeepsLosses(TinyRegressor):
    """``keep_losses=True`` plants the classic leak: every loss is kept together with its graph."""

    def __init__(self, keep_losses: bool = False, fail_at_step: int | None = None,
                 error: BaseException | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.keep_losses = keep_losses
        self.history: list[torch.Tensor] = []
        self.fail_at_step = fail_at_step
        self.error = error

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.trainer.global_step == self.fail_at_step:
            assert self.error is not None
            raise self.error
        loss = super().training_step(batch, batch_idx)
        if self.keep_losses:
            self.history.append(loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=32, seed=1), batch_size=16)


def memory_events(trainer: Any, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if kind is None or e["kind"] == kind]


# --- scalars -------------------------------------------------------------------------------------------------


def test_scalars_are_logged_at_the_configured_steps(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=5)], max_steps=16,
                           limit_val_batches=0)
    trainer.fit(KeepsLosses())
    scalars = read_scalars(trainer.log_dir)
    assert [step for step, _ in scalars["debug/memory/cpu_rss_mb"]] == [0, 5, 10, 15]
    assert all(value > 1 for _, value in scalars["debug/memory/cpu_rss_mb"])
    assert [step for step, _ in scalars["debug/memory/cpu_available_mb"]] == [0, 5, 10, 15]
    if heap_in_use() is not None:  # on every row that shows memory (log_every_n_steps=1)
        assert [step for step, _ in scalars["debug/memory/cpu_heap_mb"]] == [0, 5, 10, 15]
    assert not any(tag.startswith("debug/memory/cuda_") for tag in scalars)  # no CUDA device, no CUDA scalars
    report = read_report(debug_dir(trainer))
    assert report["stats"]["memory/cpu_rss_mb"]["count"] == 4
    assert "## Memory" in (debug_dir(trainer) / "report.md").read_text()


def test_log_memory_false_logs_nothing(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2, log_memory=False)],
                           max_steps=6, limit_val_batches=0)
    trainer.fit(KeepsLosses())
    assert not any(tag.startswith("debug/memory/") for tag in read_scalars(trainer.log_dir))
    assert read_report(debug_dir(trainer))["stats"]["memory/cpu_rss_mb"]["count"] == 3


# --- leaks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frequency", [10, 1])
def test_planted_leak_is_found_and_explained(tmp_path: Path, frequency: int) -> None:
    """Checked every step with Lightning's default logging rows, the C heap is read only on the readings the trend
    takes and at least every 8 steps, and the leak is found as well."""
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=frequency)], max_steps=250,
                           limit_val_batches=0, log_every_n_steps=50 if frequency == 1 else 1)
    with console_lines(r"Memory grows steadily.*\(memory_growth"):
        trainer.fit(KeepsLosses(keep_losses=True))
    growth = [e for e in memory_events(trainer, "memory_growth") if e.get("episode") == "start"]
    assert len(growth) == 1, memory_events(trainer)
    event = growth[0]
    assert event["step"] < 250 and event["severity"] == "warning"
    assert "grad_fn MseLossBackward0" in event["message"]
    assert "loss.detach()" in event["message"] and "loss.item()" in event["message"]
    details = event["details"]
    assert details["tensors"][0]["grad_fn"] == "MseLossBackward0"
    assert details["tensors"][0]["per_step"] == pytest.approx(1.0, abs=0.2)
    assert details["mb_per_step"] > 0 and details["run_out_step"] > event["step"]
    report = read_report(debug_dir(trainer))
    assert report["findings"]["memory_growth"]["first_step"] == event["step"]
    assert report["sections"]["memory"]["growth"]["status"] == "growing"
    assert report["sections"]["memory"]["cost_ms"]["census"]["count"] == 2  # only to confirm, never per step
    stats = report["stats"]
    assert stats["memory/cpu_rss_mb"]["count"] == 250 // frequency
    if heap_in_use() is not None:  # every reading at 10 steps apart; every 8th or so checked every step
        heap_readings = stats["memory/cpu_heap_mb"]["count"]
        assert heap_readings == 25 if frequency == 10 else 30 <= heap_readings <= 33, heap_readings


class ClearsLosses(KeepsLosses):
    """Keeps every loss with its graph, as :class:`KeepsLosses` does, and lets them all go from step ``clear_at`` on
    (outputs kept for a metric computed and cleared at the end of the epoch)."""

    def __init__(self, clear_at: int) -> None:
        super().__init__(keep_losses=True)
        self.clear_at = clear_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step >= self.clear_at:
            self.history.clear()
        return loss


@pytest.mark.parametrize("clear_at", [None, 175], ids=["kept", "cleared"])
def test_a_growth_suspected_at_the_last_reading_is_judged_by_the_runs_end(tmp_path: Path, clear_at: int | None) -> None:
    """A run that ends right after the reading that first suspects a leak (step 170 of 180 here) has no later reading
    to confirm it: the end of the run is that reading. It names the leak at the last step (the report said
    "suspected" and "No problems found" before); its twin lets what it kept go before the end, and is quiet."""
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=10)], max_steps=180,
                           limit_val_batches=0)
    trainer.fit(KeepsLosses(keep_losses=True) if clear_at is None else ClearsLosses(clear_at))
    growth = [(e["step"], e["severity"]) for e in memory_events(trainer, "memory_growth") if e.get("episode") == "start"]
    status = read_report(debug_dir(trainer))["sections"]["memory"]["growth"]["status"]
    if clear_at is None:
        assert growth == [(179, "warning")] and status == "growing"
    else:
        assert growth == [] and status == "no steady growth"


def test_healthy_run_reports_no_growth(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=10)], max_steps=250,
                           limit_val_batches=2)
    trainer.fit(KeepsLosses(keep_losses=False, optimizer="adam"))
    assert memory_events(trainer, "memory_growth") == []
    section = read_report(debug_dir(trainer))["sections"]["memory"]
    assert section["growth"]["status"] == "no steady growth"
    assert section["growth"]["trends"]["cpu_rss"]["readings"] >= 20
    assert section["cost_ms"]["census"]["count"] == 0


class KeepsRunningTotal(TinyRegressor):
    """The PyTorch FAQ's ``total_loss += loss``: the running total keeps every step's graph, one tensor throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.running = torch.zeros(())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.running = self.running + loss
        return loss


def _fit_again_beside_a_stale_total(root: Path) -> None:
    stale = KeepsRunningTotal()
    make_trainer(root / "first", [], max_steps=400, limit_val_batches=0).fit(stale)
    trainer = make_trainer(root / "second", [MemoryProfilerCallback(memory_profiling_frequency=10)],
                           max_steps=250, limit_val_batches=0)
    trainer.fit(KeepsRunningTotal())
    assert stale.running.grad_fn is not None  # the stale total was alive, with its graph, all along


def test_a_growing_running_total_is_named_beside_a_bigger_stale_one(tmp_path: Path) -> None:
    """A notebook fits again while the module of the fit before, with its running total and that total's bigger
    (unchanging) graph, is still referenced: the new total's growing graph is still named as the cause. Both fits
    run in a process of their own: the series judged is the training process's, and a test process that ran other
    tests first may hand memory back to the system during the fit (the suite missed the growth once, with two busy
    processes beside it)."""
    child = multiprocessing.get_context("spawn").Process(target=_fit_again_beside_a_stale_total, args=(tmp_path,))
    child.start()
    child.join(150)
    assert child.exitcode == 0
    [events] = [read_events(path.parent) for path in (tmp_path / "second").rglob("events.jsonl")]
    growth = [e for e in events if e["kind"] == "memory_growth" and e.get("episode") == "start"]
    assert len(growth) == 1, events
    assert "running total" in growth[0]["message"] and "loss.item()" in growth[0]["message"], growth[0]["message"]
    assert growth[0]["details"]["growing_graphs"][0]["grad_fn"] == "AddBackward0"


class KeepsEpochOutputs(TinyRegressor):
    """Lightning's recipe for an epoch-level metric: each step's outputs appended in ``training_step`` (here 130 KB
    a step), read and cleared in ``on_train_epoch_end``; 150 steps an epoch. ``clear=False`` is the bug: the list
    is never cleared, so it grows across epochs."""

    def __init__(self, clear: bool) -> None:
        super().__init__()
        self.clear, self.outputs, self.kept = clear, [], 0
        self.extra = torch.Generator().manual_seed(0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.outputs.append(torch.randn(16, 2048, generator=self.extra))
        self.kept = max(self.kept, len(self.outputs))
        return loss

    def on_train_epoch_end(self) -> None:
        if self.clear:
            torch.stack([output.mean() for output in self.outputs])
            self.outputs.clear()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=16 * 150), batch_size=16)


def test_outputs_kept_for_the_end_of_each_epoch_are_no_leak(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=1)], max_epochs=4,
                           max_steps=-1, limit_val_batches=0, log_every_n_steps=50)
    model = KeepsEpochOutputs(clear=True)
    trainer.fit(model)
    assert trainer.global_step == 600 and model.kept == 150, "150 steps of outputs (19 MB) piled up in each epoch"
    assert memory_events(trainer, "memory_growth") == []
    assert [e["kind"] for e in memory_events(trainer) if e["severity"] in ("warning", "error", "critical")] == []
    assert read_report(debug_dir(trainer))["sections"]["memory"]["growth"]["status"] != "growing"


def test_outputs_never_cleared_are_named_once_the_epoch_ends_without_releasing_them(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=1)], max_epochs=2,
                           max_steps=-1, limit_val_batches=0, log_every_n_steps=50)
    trainer.fit(KeepsEpochOutputs(clear=False))
    growth = [e for e in memory_events(trainer, "memory_growth") if e.get("episode") == "start"]
    assert len(growth) == 1 and 150 <= growth[0]["step"] < 200, [e["step"] for e in growth]
    assert growth[0]["details"]["tensors"][0]["shape"] == [16, 2048]

class DecodedOnce(torch.utils.data.Dataset):
    """A dataset that decodes each sample on first access (a 64 KB tensor) and keeps it: memory grows through the
    first epoch, by 38 MB, and stays there."""

    def __init__(self, samples: int = 600) -> None:
        self.samples, self.cache = samples, {}

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.cache:
            self.cache[index] = torch.randn(16384, generator=torch.Generator().manual_seed(index))
        decoded = self.cache[index]
        return decoded[:8], decoded[8:9]


class CachesItsData(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.dataset = DecodedOnce()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=4, shuffle=True)


def test_a_cache_filled_in_the_first_epoch_is_no_leak(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=1)], max_epochs=3,
                           max_steps=-1, limit_val_batches=0, log_every_n_steps=50)
    model = CachesItsData()
    trainer.fit(model)
    assert trainer.global_step == 450 and len(model.dataset.cache) == 600, "the plant: 38 MB decoded in epoch 0"
    assert [e["kind"] for e in memory_events(trainer) if e["severity"] in ("warning", "error", "critical")] == []
    assert read_report(debug_dir(trainer))["sections"]["memory"]["growth"]["status"] != "growing"


# --- memory_high ---------------------------------------------------------------------------------------------


def test_memory_high_uses_the_configured_fraction(tmp_path: Path) -> None:
    callback = MemoryProfilerCallback(DebugConfig(memory_profiling_frequency=2), memory_high_fraction=1e-6)
    trainer = make_trainer(tmp_path, [callback], max_steps=8, limit_val_batches=0)
    with console_lines("System memory"):
        trainer.fit(KeepsLosses())
    high = memory_events(trainer, "memory_high")
    starts = [e for e in high if e.get("episode") == "start"]
    assert len(starts) == 1 and starts[0]["step"] == 0  # one episode, not one line per check step
    assert starts[0]["details"]["device"] == "cpu" and starts[0]["details"]["limit"] == 1e-6
    assert read_report(debug_dir(trainer))["findings"]["memory_high"]["steps"] == 4


@pytest.mark.parametrize("value", [0, 1.5, -0.1, "high", True])
def test_invalid_memory_high_fraction_names_the_field(value: Any) -> None:
    with pytest.raises(ValueError, match="memory_high_fraction"):
        MemoryProfilerCallback(memory_high_fraction=value)


# --- out of memory -------------------------------------------------------------------------------------------


def test_oom_writes_a_post_mortem_and_the_original_error_propagates(tmp_path: Path) -> None:
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    model = KeepsLosses(fail_at_step=3, error=error)
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2)], max_steps=10,
                           limit_val_batches=0)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised, console_lines("Out of memory"):
        trainer.fit(model)
    assert raised.value is error
    oom = memory_events(trainer, "oom")
    assert len(oom) == 1 and oom[0]["step"] == 3 and oom[0]["severity"] == "critical"
    assert oom[0]["details"]["phase"] == "forward"
    assert oom[0]["details"]["batch"][0].startswith("batch[0]: [16, 8] float32")
    post_mortem = Path(oom[0]["details"]["post_mortem"])
    assert post_mortem == debug_dir(trainer) / "oom_step3.md"
    text = post_mortem.read_text()
    assert "Out of memory at step 3 (during forward)" in text and "Tried to allocate 20.00 GiB" in text
    for fix in ("Smaller batch", "Gradient accumulation", "Mixed precision", "Activation checkpointing"):
        assert fix in text
    assert "## Largest live tensors" in text and "| [16, 8] | float32 | cpu |" in text
    report = read_report(debug_dir(trainer))
    assert report["status"] == "failed" and report["findings"]["oom"]["first_step"] == 3


class OutOfMemoryIn(KeepsLosses):
    """Runs out of memory at step 3 in ``phase``: in the backward pass (a gradient hook) or in the optimizer's step."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.phase == "backward" and self.trainer.global_step == 3:
            loss.register_hook(self._raise)
        return loss

    def _raise(self, grad: torch.Tensor) -> torch.Tensor:
        raise self.oom

    def configure_optimizers(self) -> torch.optim.Optimizer:
        model = self

        class Failing(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                loss = super().step(closure)
                if model.phase == "optimizer" and model.trainer.global_step == 3:
                    raise model.oom
                return loss

        return Failing(self.parameters(), lr=0.01)


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_an_oom_between_check_steps_names_its_phase(tmp_path: Path, phase: str) -> None:
    model = OutOfMemoryIn(phase)
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2)], max_steps=10,
                           limit_val_batches=0)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised, console_lines("Out of memory"):
        trainer.fit(model)
    assert raised.value is model.oom
    oom = memory_events(trainer, "oom")
    assert len(oom) == 1 and oom[0]["step"] == 3 and oom[0]["details"]["phase"] == phase


def test_other_errors_get_no_post_mortem(tmp_path: Path) -> None:
    error = ValueError("a bug in the user's code")
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2)], max_steps=10,
                           limit_val_batches=0)
    with pytest.raises(ValueError) as raised:
        trainer.fit(KeepsLosses(fail_at_step=2, error=error))
    assert raised.value is error
    assert memory_events(trainer, "oom") == [] and not list(debug_dir(trainer).glob("oom_*"))


# --- ADVANCED: phases ---------------------------------------------------------------------------------------


def test_advanced_level_records_memory_per_phase(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2, level="advanced")],
                           max_steps=6, limit_val_batches=0)
    trainer.fit(KeepsLosses())
    section = read_report(debug_dir(trainer))["sections"]["memory"]
    if heap_in_use() is None:
        pytest.skip("per-phase CPU readings need glibc's mallinfo2")
    assert {"forward", "backward", "optimizer"} <= set(section["phases"])
    assert section["phases"]["forward"]["count"] == 3  # check steps 0, 2, 4 only
    scalars = read_scalars(trainer.log_dir)
    assert [step for step, _ in scalars["debug/memory/phase/forward_mb"]] == [0, 2, 4]
    assert "| forward |" in section["markdown"]["Memory"]


# --- the monitor in a plain loop (what the Accelerate debugger calls) ----------------------------------------


def test_monitor_finds_a_leak_in_a_plain_training_loop(tmp_path: Path) -> None:
    monitor = MemoryMonitor(DebugConfig(memory_profiling_frequency=5), "plain_loop")
    run = plain_run([monitor], tmp_path)
    # Each kept loss holds its graph, about 70 KB of activations: some 20 MB over the run, far above the
    # heap's growth floor and its noise in a process that has run the rest of the suite.
    model = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(300):
        run.batch_start(step, x)
        loss = nn.functional.l1_loss(model(x), y)
        kept.append(loss)
        run.before_backward(step, loss)
        loss.backward()
        run.before_optimizer_step(step, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        run.after_optimizer_step(step + 1)
        run.batch_end()
    run.exception(299, ValueError("not memory"))
    run.finish("finished", 300)
    events = read_events(tmp_path)
    growth = [e for e in events if e["kind"] == "memory_growth" and e.get("episode") == "start"]
    assert len(growth) == 1, events
    assert "grad_fn MeanBackward0" in growth[0]["message"] and "loss.detach()" in growth[0]["message"]
    assert growth[0]["callback"] == "plain_loop"
    assert not [e for e in events if e["kind"] == "oom"]


def leaking_loop(run: Any, steps: range, kept: list[torch.Tensor] | None) -> None:
    """A plain loop; with ``kept``, each step keeps a 1 MB tensor with its graph there (a leak)."""
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in steps:
        run.batch_start(step, x)
        loss = nn.functional.mse_loss(model(x), y)
        if kept is not None:
            kept.append(model.weight.sum() * torch.ones(256, 1024))
        run.before_backward(step, loss)
        loss.backward()
        run.before_optimizer_step(step, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        run.after_optimizer_step(step + 1)
        run.batch_end()


@pytest.mark.parametrize("same_process", [True, False])
def test_a_growth_suspected_at_a_checkpoint_is_confirmed_after_the_resume_as_memory_says(
        tmp_path: Path, same_process: bool) -> None:
    """The suspicion and the window travel in the checkpoint. Resumed in the same process (a notebook), memory that goes
    on growing is named at the reading where the uninterrupted run names it (step 50), explained from a census the
    resumed run takes at its first check. Resumed in a new process, the memory the process before leaked is gone:
    the window starts again at the first reading that fell back, so the new process's own leak is named from its own
    readings (with the stale window, readings below the old ones hide it for the window's length)."""
    config = DebugConfig(memory_profiling_frequency=1)
    before = MemoryMonitor(config, "plain_loop")
    kept: list[torch.Tensor] = []
    leaking_loop(plain_run([before], tmp_path / "before"), range(46), kept)
    assert before.report_section()["growth"]["status"] == "suspected"
    resumed = MemoryMonitor(config, "plain_loop")
    resumed.load_state_dict(before.state_dict())
    if not same_process:
        kept = []
    run = plain_run([resumed], tmp_path / "resumed")
    leaking_loop(run, range(46, 110), kept)
    run.finish("finished", 110)
    growth = [e for e in read_events(tmp_path / "resumed")
              if e["kind"] == "memory_growth" and e.get("episode") == "start"]
    assert len(growth) == 1 and growth[0]["details"]["tensors"][0]["grad_fn"] == "MulBackward0", growth
    if same_process:
        assert growth[0]["step"] == 50 and growth[0]["details"]["census_steps"] == [46, 50]
    else:
        assert 90 <= growth[0]["step"] <= 100, growth[0]["step"]


def test_state_dict_keeps_counts_and_statistics() -> None:
    monitor = MemoryMonitor(DebugConfig(memory_profiling_frequency=1))
    plain_run([monitor])
    for step in range(3):
        monitor.measure(step, {"epoch": 0, "batch": step}, None)
    restored = MemoryMonitor(DebugConfig(memory_profiling_frequency=1))
    restored.load_state_dict(monitor.state_dict())
    assert restored.stats["cpu_rss_mb"].count == 3


# --- the pure analyses ---------------------------------------------------------------------------------------


def test_trend_separates_steady_growth_from_noise_and_warm_up() -> None:
    noise = random.Random(0)
    steps = list(range(20, 340, 10))
    mb = 2**20
    steady = [(s, 100 * mb + 8192 * s + noise.uniform(-20_000, 20_000)) for s in steps]
    assert is_steady_growth(fit_trend(steady), floor=mb)
    flat_noisy = [(s, 100 * mb + noise.uniform(-3 * mb, 3 * mb)) for s in steps]
    assert not is_steady_growth(fit_trend(flat_noisy), floor=mb)
    warm_up_then_flat = [(s, 100 * mb + (5 * mb if s > 40 else 0)) for s in steps]
    assert not is_steady_growth(fit_trend(warm_up_then_flat), floor=mb)
    creep = [(s, 100 * mb + 128 * s) for s in steps]  # monotone but tiny: allocator creep
    assert not is_steady_growth(fit_trend(creep), floor=mb)
    assert not is_steady_growth(fit_trend(steady[:5]), floor=mb)  # too few readings to tell


def test_census_groups_by_shape_dtype_and_grad_fn() -> None:
    weight = torch.randn(4, 3, requires_grad=True)
    kept = [(weight * 2).sum() for _ in range(5)]
    census = take_census(kept + [torch.zeros(7, dtype=torch.int64)])
    assert census.groups[((), "float32", "cpu", "SumBackward0")] == [5, 20]
    assert census.groups[((7,), "int64", "cpu", "")] == [1, 56]
    assert census.graph_nodes[((), "float32", "cpu", "SumBackward0")] == 3
    assert census.largest(1)[0]["dtype"] == "int64"


def test_a_running_total_is_recognised_by_its_growing_graph() -> None:
    weight = torch.randn(3, requires_grad=True)
    total = torch.zeros(()) + (weight * 2).sum()
    before = take_census([total, weight])
    for _ in range(20):
        total = total + (weight * 2).sum()
    after = take_census([total, weight])
    assert census_growth(before, after, 20) == []  # as many tensors as before...
    graphs = graph_growth(before, after, 20)  # ...but one graph grew
    assert graphs[0].grad_fn == "AddBackward0" and graphs[0].nodes_after > graphs[0].nodes_before + 20
    text = explain_growth([], 20, graphs)
    assert "running total" in text and "loss.item()" in text


def test_explanation_without_a_graph_names_the_kept_tensors() -> None:
    group = GroupGrowth((16, 10), "float32", "cpu", "", 100, 64_000, 2.0, 0)
    text = explain_growth([group], 50)
    assert text.startswith("~2 tensors/step (shape [16, 10], float32 on cpu) without a graph stay alive")
    assert "outside tensors" in explain_growth([], 50)


def test_cuda_leak_sites_from_a_recorded_history() -> None:
    def frames(line: int) -> list[dict[str, Any]]:
        return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"},
                {"filename": "/home/me/project/train.py", "line": line, "name": "training_step"}]

    trace: list[dict[str, Any]] = []
    for step in range(10):
        trace.append({"action": "alloc", "addr": 1000 + step, "size": 512, "frames": frames(42)})  # kept
        trace.append({"action": "alloc", "addr": 5000, "size": 4096, "frames": frames(40)})  # freed each step
        trace.append({"action": "free_requested", "addr": 5000, "size": 4096, "frames": []})
        trace.append({"action": "free_completed", "addr": 5000, "size": 4096, "frames": []})
    trace.append({"action": "alloc", "addr": 9000, "size": 2**20, "frames": frames(7)})  # one-off, still alive
    sites = cuda_leak_sites({"segments": [], "device_traces": [trace]})
    assert [site["site"] for site in sites] == ["project/train.py:42 in training_step"]
    assert sites[0]["alive"] == 10 and sites[0]["allocations"] == 10


def test_out_of_memory_errors_are_recognised() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 1 bytes"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_batch_description_walks_nested_batches() -> None:
    batch = {"input": (torch.zeros(2, 3), [torch.ones(4, dtype=torch.int64)]), "meta": "not a tensor"}
    assert describe_batch(batch) == ["batch['input'][0]: [2, 3] float32 on cpu (24 B)",
                                     "batch['input'][1][0]: [4] int64 on cpu (32 B)"]


# --- CUDA (run where a GPU is present; skipped on CPU-only machines) -----------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class KeepsActivations(KeepsLosses):
    """On CUDA: keeps a [16, 4096] activation with its graph every step (256 KB/step of device memory)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wide = nn.Linear(8, 4096)
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        wide = self.wide(x)
        self.kept.append(wide)
        return nn.functional.mse_loss(self(x), y) + 0.0 * wide.mean()


class AllocatesTooMuch(KeepsLosses):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 2:
            torch.empty(2**50, dtype=torch.uint8, device=self.device)  # 1 PB: a real CUDA OOM
        return super().training_step(batch, batch_idx)


@cuda_only
def test_cuda_leak_is_found_with_its_allocation_site(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=10)], max_steps=200,
                           accelerator="cuda", limit_val_batches=0)
    with console_lines("Memory grows steadily"):
        trainer.fit(KeepsActivations())
    scalars = read_scalars(trainer.log_dir)
    for name in ("cuda_allocated_mb", "cuda_reserved_mb", "cuda_peak_mb"):
        assert [step for step, _ in scalars[f"debug/memory/{name}"]][:3] == [0, 10, 20]
    event = [e for e in memory_events(trainer, "memory_growth") if e.get("episode") == "start"][0]
    assert event["details"]["series"] == "cuda_allocated"
    assert event["details"]["tensors"][0]["shape"] == [16, 4096]
    assert event["details"]["tensors"][0]["grad_fn"] == "AddmmBackward0"
    assert any("test_memory.py" in site["site"] for site in event["details"]["cuda_sites"])
    assert Path(event["details"]["snapshot"]).exists()
    assert not torch._C._cuda_isHistoryEnabled()  # history was on only while confirming


@cuda_only
def test_cuda_oom_post_mortem_has_the_allocator_summary_and_snapshot(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [MemoryProfilerCallback(memory_profiling_frequency=2, level="expert")],
                           max_steps=10, accelerator="cuda", limit_val_batches=0)
    with pytest.raises(torch.cuda.OutOfMemoryError), console_lines("Out of memory"):
        trainer.fit(AllocatesTooMuch())
    oom = memory_events(trainer, "oom")[0]
    assert oom["step"] == 2 and oom["details"]["phase"] == "forward"
    text = Path(oom["details"]["post_mortem"]).read_text()
    assert "torch.cuda.memory_summary()" in text and "on cuda:0" in text
    assert Path(oom["details"]["snapshot"]).exists()
    assert not torch._C._cuda_isHistoryEnabled()
