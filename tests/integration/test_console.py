"""Live findings on the console through the ``lightning_debug`` logger (issue 26): visible under
``warnings.filterwarnings("ignore")``, one clean line each, not glued onto Lightning's TQDM bar."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import TinyRegressor, make_trainer

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import warnings
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning_debug import DebugConfig, debug_callbacks
    from tests.harness.toolkit import TinyRegressor

    config = DebugConfig(gradient_checking_frequency=1, print_summary=False, save_plots=False)
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=True, callbacks=debug_callbacks(config),
                         default_root_dir={root!r})
    trainer.fit(TinyRegressor(log_zero_from_step=5, unused_layer=True))
""")


def test_a_finding_reaches_the_console_under_filterwarnings_ignore_on_its_own_line(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("PYTHONWARNINGS", None)
    completed = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(tmp_path))], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    console = completed.stdout + completed.stderr
    segments = [segment.strip() for segment in re.split(r"[\r\n]", console)]
    ours = [segment for segment in segments if "lightning-debug: [step" in segment]
    assert any(s.startswith("lightning-debug: [step 5] The loss is NaN/Inf") for s in ours), console[-3000:]
    assert any("(missing_grad" in s for s in ours), ours
    assert all(s.startswith("lightning-debug: [step") for s in ours), "each line stands alone, not after the bar"
    assert "UserWarning" not in console and "lightning-debug:0:" not in console


def test_findings_are_log_records_of_the_lightning_debug_logger(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    config = DebugConfig(gradient_checking_frequency=1, anomaly_detection_mode="skip", print_summary=False,
                         save_plots=False)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=12)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="lightning_debug"):
        warnings.filterwarnings("ignore")
        trainer.fit(TinyRegressor(log_zero_from_step=5))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_debug"]
    assert any(line.startswith("lightning-debug: [step 5] The loss is NaN/Inf") for line in lines), lines
    assert all("\n" not in line for line in lines)
    assert not [w for w in caught if "lightning-debug" in str(w.message)], "no finding is a Python warning"
