"""The torch.profiler window beside another profiler: skipped and said once, never a profiler kept that failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_debug.monitors.performance import profiler as windows
from lightning_debug.monitors.performance.profiler import StepWindows, WindowStatus, native_stderr_quiet
from lightning_debug.monitors.performance.settings import PerformanceSettings


def test_the_private_torch_names_asked_are_there() -> None:
    """Pinned: torch has no public "is a profiler running"; these two are read (the first when present)."""
    assert callable(torch._C._autograd._profiler_enabled)
    assert isinstance(torch.autograd.profiler._is_profiler_enabled, bool)


def test_without_the_c_query_the_python_flag_tells(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C._autograd, "_profiler_enabled")
    assert windows.torch_profiler_running() is False
    monkeypatch.setattr(torch.autograd.profiler, "_is_profiler_enabled", True)
    assert windows.torch_profiler_running() is True


def make_windows(tmp_path: Path, said: list[str], in_use: object = None, window: tuple[int, int] = (1, 2)
                 ) -> StepWindows:
    return StepWindows(PerformanceSettings(profile_window=window), False, 0, tmp_path, lambda trace: None,
                       lambda *args: None, said.append, in_use=in_use)  # type: ignore[arg-type]


def test_a_users_profiler_skips_the_window_once_and_is_left_running(tmp_path: Path) -> None:
    said: list[str] = []
    step_windows = make_windows(tmp_path, said)
    from torch.profiler import profile

    with native_stderr_quiet():
        user = profile()
        user.start()
    try:
        for step in range(5):
            step_windows.boundary(step)
            assert not step_windows.active
        assert windows.torch_profiler_running()  # the user's profiler still records
    finally:
        with native_stderr_quiet():
            user.stop()
    assert step_windows.outcome is not None and step_windows.outcome["status"] is WindowStatus.SKIPPED
    assert len(said) == 1 and "steps 1-2" in said[0] and "already recording" in said[0]
    assert not (tmp_path / "profiler").exists()


def test_a_profiler_that_fails_to_start_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    step_windows = make_windows(tmp_path, said)

    class Failing:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.touched: list[str] = []

        def start(self) -> None:
            raise RuntimeError("kineto refused")

        def step(self) -> None:  # pragma: no cover - a dropped profiler is never stepped
            raise AssertionError("stepped")

    monkeypatch.setattr(torch.profiler, "profile", Failing)
    for step in range(5):
        step_windows.boundary(step)
    step_windows.restore()
    assert not step_windows.active
    assert step_windows.outcome is not None and step_windows.outcome["status"] is WindowStatus.FAILED
    assert len(said) == 1 and "kineto refused" in said[0]


def test_the_framework_profiler_is_named(tmp_path: Path) -> None:
    said: list[str] = []
    step_windows = make_windows(tmp_path, said, in_use=lambda: "Lightning's PyTorchProfiler records the fit")
    for step in range(4):
        step_windows.boundary(step)
    assert step_windows.outcome["status"] is WindowStatus.SKIPPED  # type: ignore[index]
    assert said == ["the torch.profiler window of profile_steps (steps 1-2) is skipped: Lightning's PyTorchProfiler "
                    "records the fit; torch runs one profiler at a time."]


def test_a_window_the_run_never_reached_says_so(tmp_path: Path) -> None:
    step_windows = make_windows(tmp_path, [], window=(5, 2))
    for step in range(3):
        step_windows.boundary(step)
    step_windows.not_reached(3)
    assert not step_windows.active
    assert step_windows.outcome["status"] is WindowStatus.NOT_REACHED  # type: ignore[index]
