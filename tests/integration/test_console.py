"""Live findings on the console through the ``lightning_debug`` logger (issue 26): visible under
``warnings.filterwarnings("ignore")``, one clean line each, not glued onto Lightning's TQDM bar."""

from __future__ import annotations

import contextlib
import io
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


# --- the end-of-fit summary is text a person can copy (issue 44) ----------------------------------------------------

SUMMARY_SCRIPT = textwrap.dedent("""
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    sys.modules["matplotlib.backends.backend_agg"] = None  # matplotlib missing: the summary says how to draw
    if {hide_rich!r}:
        sys.modules["rich.console"] = None  # rich missing (Lightning imported it already, we must not)
    from lightning_debug import DebugConfig, debug_callbacks
    from tests.harness.toolkit import TinyRegressor

    for version, force in enumerate({forces!r}):
        os.environ.pop("FORCE_COLOR", None)
        os.environ.update({{"FORCE_COLOR": "1"}} if force else {{}})
        print(f"=== {{version}}", flush=True)
        trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, enable_checkpointing=False,
                             enable_model_summary=False, enable_progress_bar=False,
                             logger=TensorBoardLogger({root!r}, name="[exp1]", version=version),
                             callbacks=debug_callbacks(DebugConfig(gradient_checking_frequency=1)))
        trainer.fit(TinyRegressor(log_zero_from_step=3))
""")


@pytest.mark.parametrize("rich", [True, False], ids=["rich-installed", "no-rich"])
def test_the_summary_keeps_brackets_and_never_folds_a_path_or_a_command(tmp_path: Path, rich: bool) -> None:
    """A folder named ``runs-[exp1]`` (rich read it as markup: ``runs-/``), paths past the console's width (folded
    over two lines) and the install hint (``"lightning-debug[plots]"`` lost its extra): each path and command is
    whole on one line, with rich installed and piped (plain text), with rich forced by its public ``FORCE_COLOR``
    switch (colours, still unfolded at 60 columns), and without rich (``FORCE_COLOR`` or not); the demo's lines
    point only at files that exist."""
    from lightning_debug.demo import print_summary
    from tests.harness.toolkit import child_env

    root = tmp_path / "runs-[exp1]" / "a-long-folder-name-that-passes-any-console-width-on-its-own"
    env = child_env(COLUMNS="60")
    env.pop("FORCE_COLOR", None), env.pop("TTY_COMPATIBLE", None)
    forces = [False, True]
    script = SUMMARY_SCRIPT.format(root=str(root), hide_rich=not rich, forces=forces)
    completed = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    outputs = completed.stdout.split("=== ")[1:]
    assert len(outputs) == len(forces), completed.stdout
    for version, (force, output) in enumerate(zip(forces, outputs)):
        assert ("\x1b[" in output) is (rich and force), output
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in output.splitlines()]
        log_dir = root / "[exp1]" / f"version_{version}"
        debug_dir = log_dir / "debug_outputs"
        quoted = f"'{debug_dir}'"
        expected = {
            "report": f"report: {debug_dir / 'report.md'}",
            "plot": f"plots: not drawn, matplotlib is not installed: pip install matplotlib, then "
                    f"lightning-debug report {quoted}",
            "tensorboard": f"tensorboard: tensorboard --logdir '{log_dir}'",
        }
        for what, line in expected.items():
            assert any(" ".join(printed.split()) == line for printed in lines), (what, line, output)
        assert any(line.startswith("lightning-debug: run finished at step 8, 2 kind(s) of finding") for line in lines), \
            lines
        assert any(re.match(r"error\s+nonfinite_activation\s+steps? 3\b", line) for line in lines), lines
        assert any(re.match(r"error\s+nonfinite_loss\s+steps 3-7\s+conseq", line) for line in lines), lines

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        print_summary(debug_dir, log_dir)
    demo = buffer.getvalue()
    assert "debug_analysis.png" in demo and "look at" not in demo, demo
    assert f"debug_analysis.png was not drawn (it needs matplotlib): pip install matplotlib, then lightning-debug " \
           f"report {quoted}" in demo and f"tensorboard --logdir '{log_dir}'" in demo, demo
