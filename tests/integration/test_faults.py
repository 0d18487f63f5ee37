"""Faults of issue 27 in one process, each as a user or a machine would cause it: the plugin never stops
training, nothing it found is lost, and every file it writes gets one mode. Real Trainer, real files."""

from __future__ import annotations

import json
import os
import signal
import stat
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report


def plugin_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "lightning-debug" in str(w.message)]


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor(log_zero_from_step=3))
    messages = plugin_warnings(caught)
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(NanAt({1, 6, 16}))
    failed = [m for m in plugin_warnings(caught) if " failed " in m]
    assert len(failed) == 1 and "events.jsonl failed at step" in failed[0] and "kept and written" in failed[0]
    events = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss"]
    assert [(e["episode"], e["step"]) for e in events] == [
        ("start", 1), ("end", 4), ("start", 6), ("end", 9), ("start", 16), ("end", 19)]
    report = read_report(debug_dir(trainer))
    assert report["findings"]["nonfinite_loss"]["episodes"] == 3
    assert [name for name in report["failed_checks"] if name.startswith("writing")] == [
        f"writing {debug_dir(trainer) / 'events.jsonl'}"]
