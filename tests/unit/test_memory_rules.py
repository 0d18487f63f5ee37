"""The memory rules fed recorded readings directly: no Trainer, no monitor, milliseconds each.

Covers ``memory_high`` (:mod:`lightning_debug.monitors.memory.high`), the leak rule
(:mod:`lightning_debug.monitors.memory.growth`), the OOM post-mortem
(:mod:`lightning_debug.monitors.memory.post_mortem`) and the typed settings.
"""

from __future__ import annotations

from collections.abc import Callable

import dataclasses
import random

import pytest
import torch

from lightning_debug import DebugConfig
from lightning_debug.checks.memory import MB, GroupGrowth, MemoryPhase, MemoryReading, fit_trend, oom_fixes
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.memory import MemorySettings
from lightning_debug.monitors.memory.growth import (
    GROWTH_FLOORS,
    GrowthSeries,
    GrowthStatus,
    growth_finding,
    growth_status,
    growth_verdict,
    judge_growth,
)
from lightning_debug.core.verdicts import ConfirmedBy, VerdictEngine
from lightning_debug.monitors.memory import history as history_module
from lightning_debug.monitors.memory.high import high_memory
from lightning_debug.monitors.memory.history import AllocationHistory
from lightning_debug.monitors.memory.post_mortem import OomEvidence, fragmentation_share, oom_document, oom_finding

GB = 1024 * MB


def cpu_reading(heap: float, rss: float = 500 * MB, available: float = 8 * GB, total: float = 16 * GB
                ) -> MemoryReading:
    return MemoryReading(cpu_rss=int(rss), cpu_available=int(available), cpu_total=int(total), cpu_heap=int(heap))


def cuda_reading(allocated: float, reserved: float | None = None, total: float = 80 * GB) -> MemoryReading:
    return dataclasses.replace(cpu_reading(100 * MB), cuda_allocated=int(allocated),
                               cuda_reserved=int(reserved if reserved is not None else allocated),
                               cuda_peak=int(allocated), cuda_total=int(total))


SUSPECT, CONFIRM, ONGOING, HEALTHY = "suspect", "confirm", "ongoing", "healthy"


def replay(readings: list[tuple[int, MemoryReading]], settings: MemorySettings = MemorySettings(),
           elements: Callable[[int], int | None] = lambda step: None) -> tuple[list[str | None], GrowthSeries]:
    """The leak rule's decisions over recorded readings, as the monitor takes them (None: skipped; growth seen
    first, confirmed, going on, or none); ``elements`` gives each step's input size."""
    series = GrowthSeries(settings.window, settings.warmup_readings, settings.min_spacing)
    verdicts = VerdictEngine()
    steps: list[str | None] = []
    for step, reading in readings:
        if not series.add(step, reading.leak_series(), elements(step)):
            steps.append(None)
            continue
        growing = series.growing()
        decided = judge_growth(step, growing, verdicts)
        if not growing:
            steps.append(HEALTHY)
        elif decided is None:
            steps.append(SUSPECT)
        else:
            steps.append(CONFIRM if decided.by is ConfirmedBy.PERSISTED else ONGOING)
    return steps, series


# --- memory_high ------------------------------------------------------------------------------------


def test_memory_high_fires_for_a_nearly_full_gpu_with_its_numbers() -> None:
    found = high_memory(cuda_reading(60 * GB, reserved=76 * GB), step=40, limit=0.9)
    assert [key for key, _ in found] == ["cuda"]
    finding = found[0][1]
    assert finding.kind is Kind.MEMORY_HIGH and finding.severity is Severity.WARNING
    assert finding.details["fraction"] == pytest.approx(0.95) and finding.details["reserved_mb"] == 76 * 1024
    assert "95% of the device" in finding.message and "step 40" in finding.message


def test_memory_high_fires_for_the_machine_when_little_is_available() -> None:
    found = high_memory(cpu_reading(1 * GB, available=0.5 * GB), step=3, limit=0.9)
    assert [key for key, _ in found] == ["cpu"]
    assert found[0][1].details["fraction"] == pytest.approx(1 - 0.5 / 16)


def test_memory_high_is_silent_below_the_limit_and_without_a_total() -> None:
    assert high_memory(cuda_reading(60 * GB, reserved=70 * GB), step=1, limit=0.9) == []
    assert high_memory(MemoryReading(cpu_rss=1, cpu_available=0, cpu_total=0, cpu_heap=None), 1, 0.9) == []


# --- the leak rule ------------------------------------------------------------------------------------


def test_growth_that_has_stopped_is_no_leak() -> None:
    """A RAM cache filled over the first 250 steps, then flat (readings every 50 steps, the defaults' spacing): the
    window's line still rises after the cache is full, its latest half does not. A leak that keeps its pace is named."""
    def cache(step: int) -> float:
        return 200 * MB + 1.6 * MB * min(step, 250)

    steps, series = replay([(step, cpu_reading(cache(step))) for step in range(0, 1000, 50)])
    assert SUSPECT not in steps and series.growing() == {}, steps
    _, at_350 = replay([(step, cpu_reading(cache(step))) for step in range(0, 400, 50)])
    trend = at_350.trends["cpu_heap"]
    assert trend.slope > 0 and trend.consistency >= 0.7, "at step 350 the whole window's line alone calls it growth"
    leak, _ = replay([(step, cpu_reading(200 * MB + 1.6 * MB * step)) for step in range(0, 1000, 50)])
    assert CONFIRM in leak


def test_host_memory_that_steps_up_with_a_schedule_of_larger_inputs_is_no_leak() -> None:
    """A sequence-length schedule, 4x the tokens every 100 steps, every step checked (readings 8 steps apart): the
    heap steps up with the input (the arenas follow the activations' size), which the window's line calls growth.
    Judged with the input's size it is not; once the window holds one size only, a leak is named again."""
    def tokens(step: int) -> int:
        return 8 * 16 * 4 ** min(step // 100, 2)

    def heap(step: int) -> float:
        return 200 * MB + 4 * MB * min(step // 100, 2) + 0.01 * MB * (step % 7)

    settings = MemorySettings(window=32, warmup_readings=2, min_spacing=8)
    schedule = [(step, cpu_reading(heap(step))) for step in range(0, 300)]
    blind, _ = replay(schedule, settings)
    assert CONFIRM in blind, "without the input's size the steps read as growth"
    steps, series = replay(schedule, settings, tokens)
    assert SUSPECT not in steps and series.input_grew()
    leak_later = [(step, cpu_reading(heap(step) + (0.2 * MB * (step - 300) if step > 300 else 0)))
                  for step in range(0, 900)]
    assert CONFIRM in replay(leak_later, settings, tokens)[0], "a leak after the schedule is named"


def test_a_leak_under_batches_of_random_lengths_is_still_named() -> None:
    """Length-bucketed batches (8 to 160 tokens at random) are no schedule: the input's halves have the same median."""
    lengths = torch.randint(8, 160, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    leak = [(step, cpu_reading(200 * MB + 0.5 * MB * step)) for step in range(0, 400, 10)]
    steps, series = replay(leak, elements=lambda step: 8 * lengths[step])
    assert CONFIRM in steps and not series.input_grew()


def test_a_steady_leak_is_suspected_then_confirmed_then_ongoing() -> None:
    readings = [(step, cpu_reading(200 * MB + 0.5 * MB * step)) for step in range(0, 400, 10)]
    steps, series = replay(readings)
    assert steps[:2] == [None, None], "the warm-up readings stay out"
    decided = [step for step in steps if step is not None]
    first = decided.index(SUSPECT)
    assert decided[first:first + 3] == [SUSPECT, CONFIRM, ONGOING]
    assert set(series.growing()) == {"cpu_heap"}, "the resident set stays flat"
    assert series.trends["cpu_heap"].slope == pytest.approx(0.5 * MB)


def test_a_noisy_flat_heap_never_reads_as_growth() -> None:
    noise = random.Random(0)
    readings = [(step, cpu_reading(300 * MB + noise.uniform(-4, 4) * MB, rss=900 * MB + noise.uniform(-64, 64) * MB))
                for step in range(0, 1000, 10)]
    steps, _ = replay(readings)
    assert set(steps) <= {None, HEALTHY}


def test_a_warm_up_jump_is_no_leak() -> None:
    heap = [200 * MB] * 6 + [260 * MB] * 34  # optimizer state built lazily, then flat
    steps, _ = replay([(10 * i, cpu_reading(value)) for i, value in enumerate(heap)])
    assert set(steps) <= {None, HEALTHY}


def test_slow_creep_under_the_floor_is_no_leak() -> None:
    creep = 0.5 * GROWTH_FLOORS["cpu_heap"] / 300  # half the floor over the whole window
    steps, _ = replay([(step, cpu_reading(200 * MB + creep * step)) for step in range(0, 320, 10)])
    assert set(steps) <= {None, HEALTHY}


def test_growth_that_stops_ends_the_suspicion() -> None:
    """Growth suspected, or confirmed, ends with the first reading that sees none: the verdict engine holds it no
    more (the report says so) and the next growth is suspected afresh."""
    trend = fit_trend([(step, 1e6 * step) for step in range(8)])
    assert trend is not None
    for readings_growing in (1, 3):
        verdicts = VerdictEngine()
        for step in range(readings_growing):
            judge_growth(step, {"cpu_heap": trend}, verdicts)
        assert growth_status(verdicts, judged=True) is (GrowthStatus.SUSPECTED if readings_growing == 1
                                                        else GrowthStatus.GROWING)
        assert judge_growth(readings_growing, {}, verdicts) is None
        assert growth_status(verdicts, judged=True) is GrowthStatus.NONE
        assert judge_growth(readings_growing + 1, {"cpu_heap": trend}, verdicts) is None  # suspected again


def test_readings_too_close_together_are_skipped_and_the_window_is_bounded() -> None:
    series = GrowthSeries(window=4, warmup_readings=0, min_spacing=8)
    added = [series.add(step, {"cpu_rss": float(step)}) for step in (0, 3, 8, 20, 30, 40, 50)]
    assert added == [True, False, True, True, True, True, True]
    assert [step for step, _ in series.points["cpu_rss"]] == [20, 30, 40, 50]
    assert series.readings == 7


def test_the_verdict_marks_which_trends_are_significant() -> None:
    rising = fit_trend([(step, 2 * MB * step) for step in range(0, 80, 10)])
    flat = fit_trend([(step, 100 * MB) for step in range(0, 80, 10)])
    assert rising is not None and flat is not None
    verdict = growth_verdict(GrowthStatus.GROWING, {"cpu_heap": rising, "cpu_rss": flat}, "it grows")
    assert verdict["status"] == "growing" and verdict["message"] == "it grows"
    assert verdict["trends"]["cpu_heap"]["significant"] and not verdict["trends"]["cpu_rss"]["significant"]
    assert growth_verdict(GrowthStatus.NOT_ENOUGH, {}) == {"status": "not enough readings", "trends": {}}


def test_the_growth_finding_says_when_the_gpu_runs_out_and_what_piles_up() -> None:
    trend = fit_trend([(step, 1 * GB + 4 * MB * step) for step in range(0, 80, 10)])
    assert trend is not None
    kept = GroupGrowth((), "float32", "cuda:0", "NllLossBackward0", 20, 80, 1.0, 12)
    sites = [{"site": "train.py:42 in training_step", "alive": 20, "alive_mb": 0.1, "allocations": 20}]
    finding = growth_finding(70, {"cuda_allocated": trend}, {"cuda_allocated": trend},
                             cuda_reading(2 * GB, total=4 * GB), 50, [kept], [], sites, "snap.pickle", 12.34)
    assert finding.kind is Kind.MEMORY_GROWTH and finding.severity is Severity.WARNING
    assert finding.details["run_out_step"] == 70 + 512 and finding.details["headroom_mb"] == 2048
    assert finding.details["census_steps"] == [50, 70] and finding.details["census_ms"] == 12.3
    assert "CUDA memory allocated +4.0 MB/step" in finding.message
    assert "NllLossBackward0" in finding.message and "train.py:42 in training_step" in finding.message


def test_the_growth_finding_without_headroom_left_names_no_step() -> None:
    trend = fit_trend([(step, -1.0 * MB * step) for step in range(0, 80, 10)])
    assert trend is not None
    finding = growth_finding(70, {"cpu_heap": trend}, {"cpu_heap": trend}, cpu_reading(1 * GB), 60, [], [], [],
                             None, 1.0)
    assert finding.details["run_out_step"] is None and "runs out" not in finding.message


# --- out of memory ------------------------------------------------------------------------------------


def test_the_oom_post_mortem_points_at_its_file_and_the_phase_fix() -> None:
    evidence = OomEvidence(step=9, phase="optimizer", error="OutOfMemoryError: CUDA out of memory.\nmore",
                           reading=cuda_reading(79 * GB), batch=["batch[0]: [64, 512] float32 on cuda:0 (128.0 KB)"],
                           largest=[{"shape": [4096, 4096], "dtype": "float32", "device": "cuda:0", "grad_fn": None,
                                     "count": 3, "mb": 192.0}] * 7, fixes=oom_fixes(MemoryPhase.OPTIMIZER))
    finding = oom_finding(evidence, "/runs/oom_step9.md", None)
    assert finding.kind is Kind.OOM and finding.severity is Severity.CRITICAL
    assert finding.message.startswith(
        "Out of memory at step 9 during optimizer (OutOfMemoryError: CUDA out of memory.)")
    assert "Post-mortem: /runs/oom_step9.md." in finding.message and "Shard it" in finding.message
    assert len(finding.details["largest_tensors"]) == 5 and finding.details["post_mortem"] == "/runs/oom_step9.md"
    document = oom_document(evidence, "snap.pickle")
    assert document["document"] == "oom_post_mortem" and document["snapshot"] == "snap.pickle"
    assert len(document["largest_tensors"]) == 7 and document["memory_mb"]["cuda_allocated_mb"] == 79 * 1024


def test_an_oom_without_a_written_post_mortem_says_so_by_omission() -> None:
    evidence = OomEvidence(3, "outside a training step", "MemoryError: ", cpu_reading(1 * GB), [], [], oom_fixes(None))
    finding = oom_finding(evidence, None, None)
    assert "Post-mortem" not in finding.message and finding.details["post_mortem"] is None


def test_a_fragmented_gpu_puts_expandable_segments_among_the_fixes() -> None:
    fragmented = cuda_reading(40 * GB, reserved=60 * GB)
    assert fragmentation_share(fragmented) == pytest.approx(0.25)
    assert fragmentation_share(cpu_reading(1 * GB)) == 0.0
    assert any("expandable_segments" in fix for fix in oom_fixes(None, fragmentation_share(fragmented)))
    assert not any("expandable_segments" in fix for fix in oom_fixes(None, fragmentation_share(cuda_reading(40 * GB))))


# --- CUDA allocation history ----------------------------------------------------------------------------


def test_the_allocation_history_switches_off_only_what_it_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    recording = [False]
    monkeypatch.setattr(history_module, "history_enabled", lambda: recording[0])
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled=None, **options: calls.append((enabled, options.get("max_entries"))))
    ours = AllocationHistory(max_entries=123)
    assert ours.start() is None and ours.ours and calls == [("all", 123)]
    ours.stop()
    ours.stop()
    assert calls == [("all", 123), (None, None)] and not ours.ours
    recording[0] = True  # someone else records: left alone
    theirs = AllocationHistory(max_entries=123)
    assert theirs.start() is None and not theirs.ours
    theirs.stop()
    assert len(calls) == 2


def test_a_history_that_cannot_start_returns_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**options: object) -> None:
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(history_module, "history_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse)
    history = AllocationHistory(max_entries=1)
    failure = history.start()
    assert isinstance(failure, RuntimeError) and not history.ours


# --- settings -----------------------------------------------------------------------------------------


def test_settings_come_from_the_config_and_are_frozen() -> None:
    settings = MemorySettings.from_config(DebugConfig(memory_profiling_frequency=7, memory_high_fraction=0.5,
                                                      log_memory=False, level="expert"))
    assert (settings.frequency, settings.high_fraction, settings.log_memory) == (7, 0.5, False)
    assert settings.phase_readings and settings.whole_run_history
    assert not MemorySettings.from_config(DebugConfig()).phase_readings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.frequency = 1  # type: ignore[misc]


def test_readings_match_psutil_and_survive_a_closed_descriptor() -> None:
    import os

    import psutil

    from lightning_debug.checks.memory import readings

    rss, file_pages, available = readings.rss_and_available()
    assert rss == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)
    assert 0 <= file_pages <= psutil.Process().memory_info().shared * 1.05
    assert available == pytest.approx(psutil.virtual_memory().available, rel=0.05)
    files = readings._proc_files(os.getpid())
    if files is not None:  # Linux: the descriptors are kept; a library that closes them costs one psutil reading
        os.close(files[0])
        os.close(files[1])
        assert readings.rss_and_available()[0] == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)
        reopened = readings._proc_files(os.getpid())
        assert reopened is not None and readings._resident(os.pread(reopened[0], 4096, 0))[0] > 0
