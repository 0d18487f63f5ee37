"""``lightning-debug report`` reads only its own run's TensorBoard points (issue 44).

Two fits write to one logger version folder (``version=0`` fixed, or one logger given to both trainers, so one
event file holds both runs): the first healthy, the second with a NaN loss from step 9. The report of the first
must not take the second's NaN from the TensorBoard scalars as its own ``nonfinite_loss``; the second's names it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_debug import AnomalyDetectionCallback, DebugConfig
from lightning_debug.callbacks.base import RUN_ATTRIBUTE
from lightning_debug.cli import main as cli
from tests.harness.toolkit import TinyRegressor, read_report

pytestmark = pytest.mark.timeout(240)

QUIET: dict[str, Any] = dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)


@pytest.mark.parametrize("writers", ["a logger each, version 0", "one logger for both"])
def test_the_offline_report_of_a_run_reads_only_its_own_tensorboard_points(tmp_path: Path, writers: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    shared = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    directories = []
    for planted in (None, 9):  # the first run is healthy, the second has a NaN loss from step 9
        logger = shared if writers == "one logger for both" else TensorBoardLogger(str(tmp_path), name="tb", version=0)
        trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=20, logger=logger, log_every_n_steps=1,
                             callbacks=[AnomalyDetectionCallback(DebugConfig(print_summary=False, save_plots=False))], **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TinyRegressor(log_zero_from_step=planted))
        directories.append(getattr(trainer, RUN_ATTRIBUTE).session.output_dir)
    first, second = directories
    assert read_report(first)["findings"] == {} and "nonfinite_loss" in read_report(second)["findings"]
    assert read_report(first)["started"] < read_report(first)["ended"] < read_report(second)["started"]
    version = tmp_path / "tb" / "version_0"
    assert first.parent == version and second.parent.parent == version

    assert cli(["report", str(first), "--no-plots"]) == 0
    rebuilt = read_report(first)
    assert rebuilt["findings"] == {}, "the second run's NaN is not the first run's"
    assert rebuilt["rebuilt"]["findings_from_tensorboard"] == []
    assert cli(["report", str(first), "--no-plots"]) == 0, "a second rebuild keeps the run's time span"
    assert read_report(first)["findings"] == {}

    assert cli(["report", str(second), "--no-plots"]) == 0
    named = read_report(second)
    assert named["findings"]["nonfinite_loss"]["first_step"] == 9
    assert named["rebuilt"]["tensorboard"], "the second run's own TensorBoard points are read too"
    capsys.readouterr()


def test_a_run_without_its_report_is_read_up_to_the_next_runs_start(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A killed run has no report.json, so no recorded end: its points end where the next run in the folder began."""
    directories = []
    for planted, steps in ((3, 10), (12, 20)):  # both with a NaN loss: the first at steps 3-9, the second 12-19
        trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=steps, log_every_n_steps=1,
                             logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
                             callbacks=[AnomalyDetectionCallback(DebugConfig(print_summary=False, save_plots=False))],
                             **QUIET)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TinyRegressor(log_zero_from_step=planted))
        directories.append(getattr(trainer, RUN_ATTRIBUTE).session.output_dir)
    first, _ = directories
    (first / "report.json").unlink()
    (first / "report.md").unlink()
    assert cli(["report", str(first), "--no-plots"]) == 0
    finding = read_report(first)["findings"]["nonfinite_loss"]
    assert (finding["first_step"], finding["last_step"]) == (3, 9), "nothing of the second run's NaN at 12-19"
    capsys.readouterr()
