"""Faults of issue 27 in one process, each as a user or a machine would cause it: the plugin never stops
training, nothing it found is lost, and every file it writes gets one mode. Real Trainer, real files."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import TinyRegressor, console_lines, debug_dir, make_trainer, read_events, read_report


class NanAt(TinyRegressor):
    """The loss is NaN on the given optimizer steps only."""

    def __init__(self, steps: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nan_steps = steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + torch.log(torch.zeros(())) if self.trainer.global_step in self.nan_steps else loss


# --- a failing setup degrades, never kills ----------------------------------------------------------
@pytest.mark.parametrize("logger", ["tensorboard", "csv"])
def test_an_output_directory_the_file_system_cannot_hold_degrades_to_no_files(tmp_path: Path, logger: str) -> None:
    """A relative debug_output_dir that is valid alone (components under 255 bytes, under 4095 bytes in
    all) but too long once joined to the logger's version directory: before, setup failed, the guard
    warned, and on_train_start raised AttributeError at step 0. Now training goes on with one warning,
    the checks still run (the NaN is on the console), and nothing is written."""
    relative = "/".join(["d" * 250] * 16 + ["e" * 75])
    assert len(relative) < 4096
    made = TensorBoardLogger(str(tmp_path)) if logger == "tensorboard" else CSVLogger(str(tmp_path))
    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig(debug_output_dir=relative)), max_steps=8,
                           logger=made)
    with console_lines() as lines:
        trainer.fit(TinyRegressor(log_zero_from_step=3))
    messages = [line for line in lines if "lightning-debug" in line]
    assert trainer.global_step == 8
    failed = [m for m in messages if " failed " in m]
    assert len(failed) == 1 and "choosing the output directory failed" in failed[0]
    assert "File name too long" in failed[0] and "this run writes no files" in failed[0]
    assert any("nonfinite_loss" in m for m in messages), "the checks go on without files"
    assert not list(tmp_path.rglob("events.jsonl")) and not list(tmp_path.rglob("report.json"))


# --- the user's exception, untouched --------------------------------------------------------------------
class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ on purpose")


def test_a_user_exception_whose_str_raises_propagates_untouched_and_the_report_is_written(tmp_path: Path) -> None:
    planted = UnprintableError()

    class Raising(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 5:
                raise planted
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig()), max_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnprintableError) as raised:
            trainer.fit(Raising(log_zero_from_step=2))
    assert raised.value is planted
    report = read_report(debug_dir(trainer))
    assert report["status"] == "failed" and report["last_step"] == 5
    assert report["error"] == "UnprintableError: <str() of this UnprintableError raised RuntimeError>"
    assert "nonfinite_loss" in report["findings"]


# --- SIGTERM ------------------------------------------------------------------------------------------
def test_sigterm_is_reported_as_interrupted_not_failed(tmp_path: Path) -> None:
    """Lightning turns SIGTERM into SIGTERMException (a SystemExit) at the end of the batch."""

    class Terminated(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 6:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig()), max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SystemExit):
            trainer.fit(Terminated(log_zero_from_step=3))
    report = read_report(debug_dir(trainer))
    assert report["status"] == "interrupted" and report["last_step"] in (6, 7)
    assert report["findings"]["nonfinite_loss"]["first_step"] == 3


def test_sys_exit_with_a_code_in_the_step_is_failed_with_the_code(tmp_path: Path) -> None:
    """``sys.exit(3)`` in a step is a failure (before, every SystemExit read as an interruption)."""

    class Exits(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 6:
                sys.exit(3)
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig()), max_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SystemExit):
            trainer.fit(Exits(log_zero_from_step=3))
    report = read_report(debug_dir(trainer))
    assert report["status"] == "failed" and report["exit_code"] == 3 and report["error"] == "SystemExit: 3"
    assert report["findings"]["nonfinite_loss"]["first_step"] == 3


# --- one file mode ------------------------------------------------------------------------------------
def test_every_file_the_run_writes_follows_the_umask(tmp_path: Path) -> None:
    """Before, report.json, report.md and debug_analysis.png were 0600 (mkstemp) and events.jsonl 0644."""
    previous = os.umask(0o027)
    try:
        trainer = make_trainer(tmp_path, debug_callbacks(DebugConfig(save_plots=True)), max_steps=8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TinyRegressor(log_zero_from_step=3))
    finally:
        os.umask(previous)
    files = sorted(path for path in debug_dir(trainer).iterdir() if path.is_file())
    names = {path.name for path in files}
    assert {"events.jsonl", "report.json", "report.md"} <= names
    modes = {path.name: oct(stat.S_IMODE(path.stat().st_mode)) for path in files}
    assert set(modes.values()) == {"0o640"}, modes


# --- nothing found is lost ------------------------------------------------------------------------------
class EventsFileBlocked(pl.Callback):
    """From step ``block`` to step ``unblock`` events.jsonl is a directory (a real ``IsADirectoryError`` on
    every write, as a full or read-only disk would give, and one that root cannot write through either)."""

    def __init__(self, block: int, unblock: int) -> None:
        self.block, self.unblock = block, unblock

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        events = debug_dir(trainer) / "events.jsonl"
        saved = events.with_name("saved.jsonl")
        if trainer.global_step == self.block:
            events.rename(saved)
            events.mkdir()
        elif trainer.global_step == self.unblock:
            events.rmdir()
            saved.rename(events)


def test_a_write_that_fails_for_a_while_is_retried_and_nothing_is_lost(tmp_path: Path) -> None:
    """Before, one failed write turned events.jsonl off for the rest of the run."""
    callbacks = [*debug_callbacks(DebugConfig()), EventsFileBlocked(block=5, unblock=13)]
    trainer = make_trainer(tmp_path, callbacks, max_steps=24)
    with console_lines() as lines:
        trainer.fit(NanAt({1, 6, 16}))
    failed = [m for m in lines if "lightning-debug" in m and " failed " in m]
    assert len(failed) == 1 and "events.jsonl failed at step" in failed[0] and "kept and written" in failed[0]
    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss"]
    assert [(e["episode"], e["step"]) for e in events] == [
        ("start", 1), ("end", 4), ("start", 6), ("end", 9), ("start", 16), ("end", 19)]
    report = read_report(debug_dir(trainer))
    assert report["findings"]["nonfinite_loss"]["episodes"] == 3
    assert [name for name in report["failed_checks"] if name.startswith("writing")] == [
        f"writing {debug_dir(trainer) / 'events.jsonl'}"]


KILLED_WORKER = Path(__file__).resolve().parents[1] / "workers" / "killed_worker.py"
KILL_TIMEOUT_S = 240


@pytest.mark.timeout(KILL_TIMEOUT_S + 60)
def test_a_sigkilled_run_rebuilt_offline_counts_every_episode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NaN on every 5th step (4, 9, ..., 294), SIGKILL at step 298. events.jsonl holds the first 25
    episodes one by one and a summary line at 50; the TensorBoard scalars hold the rest. Before: the
    writer stopped after 25 episodes and the rebuild ignored the scalars for a kind the events had,
    so the issue's 2,500-step run was "25 episodes, steps 4-124" instead of 500 up to step 2,494."""
    from lightning_debug.cli import main

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    completed = subprocess.run([sys.executable, str(KILLED_WORKER), str(tmp_path), "298"], capture_output=True,
                               text=True, timeout=KILL_TIMEOUT_S, env=env)
    assert completed.returncode == -signal.SIGKILL, completed.stderr[-3000:]
    directory = tmp_path / "tb" / "version_0" / "debug_outputs"
    assert not (directory / "report.json").exists()
    lines = [e for e in read_events(directory) if e["kind"] == "nonfinite_loss"]
    assert len([e for e in lines if e["episode"] == "start"]) == 25
    assert [e["details"]["episodes"] for e in lines if e["episode"] == "summary"] == [50]
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    finding = read_report(directory)["findings"]["nonfinite_loss"]
    assert (finding["episodes"], finding["steps"], finding["first_step"], finding["last_step"]) == (59, 59, 4, 294)
    assert finding["source"] == "events.jsonl and tensorboard"
    out = capsys.readouterr().out
    assert "steps 4-294" in out and "completed from the TensorBoard scalars" in out


# --- the offline report on large or odd files -----------------------------------------------------------
def write_hostile_events(path: Path, megabytes: int = 50) -> int:
    """20,000 events of as many runs, then events of one last run with 100 KB messages and details: what
    the rebuild keeps of them is bounded, so its memory must not follow the file's size."""
    with open(path, "w", encoding="utf-8") as stream:
        for number in range(20_000):
            stream.write(json.dumps({"step": number, "kind": "slow_step", "severity": "warning", "message": "m",
                                     "run": f"run-{number:08d}-" + "r" * 60}) + "\n")
        blob = "x" * 100_000
        for number in range(megabytes * 1_000_000 // 220_000):
            stream.write(json.dumps({"step": number, "kind": f"kind_{number % 40}", "severity": "warning",
                                     "message": blob, "episode": "start", "run": "last",
                                     "details": {"first_step": number, "blob": blob}}) + "\n")
    return path.stat().st_size


MEASURE_REBUILD = """
import resource, sys
from pathlib import Path
from lightning_debug.report.offline import rebuild
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = rebuild(Path(sys.argv[1]), plots=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024, result.events, len(result.report["findings"]))
"""


@pytest.mark.timeout(180)
def test_the_offline_report_keeps_its_memory_bounded_whatever_the_file(tmp_path: Path) -> None:
    """The issue measured 431 MB for 200 MB of events of distinct runs and 711 MB with 1 MiB messages.
    On this file (about 50 MB) main 82aa5ef grew by 47 MB (it kept every message whole); now the
    messages are cut to 2,000 characters on read and at most 1,000 run ids are remembered."""
    size = write_hostile_events(tmp_path / "events.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    completed = subprocess.run([sys.executable, "-c", MEASURE_REBUILD, str(tmp_path)], capture_output=True, text=True,
                               timeout=150, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    grown, events, kinds = (int(value) for value in completed.stdout.split())
    assert events > 20_000 and kinds == 40
    assert grown < size // 10, f"peak RSS grew by {grown >> 20} MB reading {size >> 20} MB"
    report = read_report(tmp_path)
    assert max(len(entry["first_message"]) for entry in report["findings"].values()) <= 2000
    assert (tmp_path / "report.json").stat().st_size < 1_000_000 and (tmp_path / "report.md").stat().st_size < 1_000_000


def write_events(directory: Path, *records: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "events.jsonl", "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record) + "\n")


NAN_AT_3 = {"step": 3, "kind": "nonfinite_loss", "severity": "error", "message": "The loss is NaN at step 3.",
            "episode": "start"}


@pytest.mark.timeout(180)
def test_report_piped_into_head_ends_quietly_and_rebuilds_every_run(tmp_path: Path) -> None:
    """Before: a BrokenPipeError traceback, and the runs after the pipe closed were not rebuilt."""
    for number in range(12):
        write_events(tmp_path / f"run{number:02d}", NAN_AT_3)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    script = (f"{sys.executable} -m lightning_debug.cli report {tmp_path} --no-plots | head -n 2; "
              "echo \"exit=${PIPESTATUS[0]}\" >&2")
    completed = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=150, env=env)
    assert len(completed.stdout.splitlines()) == 2
    assert "Traceback" not in completed.stderr and "BrokenPipe" not in completed.stderr, completed.stderr[-2000:]
    assert "exit=0" in completed.stderr
    assert all((tmp_path / f"run{number:02d}" / "report.json").is_file() for number in range(12))


def test_terminal_escapes_from_events_are_printed_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_debug.cli import main

    hostile = dict(NAN_AT_3, message="NaN \x1b[2J\x1b]0;owned\x07 at \u202eevil\r", callback="\x1b[31mred")
    write_events(tmp_path, hostile, {"step": 5, "kind": "odd\x1bkind", "severity": "warning", "message": "x"})
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u202e" not in out
    assert "NaN \\x1b[2J\\x1b]0;owned\\x07 at \\u202eevil" in out and "odd\\x1bkind" in out
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "\x1b" not in markdown and "\\x1b[2J" in markdown


def test_any_kind_string_is_plotted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a `$` in a kind made matplotlib's mathtext fail, and the command exited 2."""
    pytest.importorskip("matplotlib")
    from lightning_debug.cli import main

    write_events(tmp_path, NAN_AT_3, {"step": 5, "kind": "cost$x^{2", "severity": "warning", "message": "x"},
                 {"step": 6, "kind": "$\\frac{a}{", "severity": "info", "message": "y"})
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not drawn" not in out
    assert (tmp_path / "debug_analysis.png").stat().st_size > 1000


def test_a_run_under_a_directory_whose_name_is_not_utf8_is_rebuilt(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_debug.cli import main

    directory = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run-\xff\xfe"))
    write_events(directory, NAN_AT_3)
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    report = read_report(directory)
    assert report["findings"]["nonfinite_loss"]["first_step"] == 3
    assert "run-\\udcff\\udcfe" in report["rebuilt"]["events"]
    assert "run-\\udcff\\udcfe" in (directory / "report.md").read_text(encoding="utf-8")
    assert "run-\\udcff\\udcfe" in capsys.readouterr().out


def test_events_kept_while_writing_fails_are_bounded_and_a_cut_line_stays_one_bad_line(tmp_path: Path) -> None:
    from lightning_debug.core.events import EventLog
    from lightning_debug.core.guard import Failures
    from lightning_debug.report.events_file import read_events_file

    path = tmp_path / "events.jsonl"
    path.write_text('{"step": 0, "kind": "slow_step"}\n{"step": 1, "ki')  # a crash in the middle of a write
    log = EventLog(tmp_path, Failures())
    log.max_pending = 3
    saved = tmp_path / "saved.jsonl"
    path.rename(saved)
    path.mkdir()  # unwritable from here on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2, 7):
            log.write({"step": step, "kind": "nonfinite_loss", "severity": "error", "message": f"NaN at {step}"})
    assert log.pending == 3
    path.rmdir()
    saved.rename(path)
    log.write({"step": 7, "kind": "nonfinite_loss", "severity": "error", "message": "NaN at 7"})
    events = read_events_file(path)
    assert events.bad_lines == 1 and not events.truncated_last_line
    assert [(e["kind"], e["step"]) for e in events.records] == [
        ("slow_step", 0), ("events_lost", 2), ("nonfinite_loss", 5), ("nonfinite_loss", 6), ("nonfinite_loss", 7)]
    assert events.records[1]["details"] == {"lost": 3}
    assert log.failures.summary()[f"writing {path}"]["count"] == 5
