"""Every bad value of every DebugConfig field given through LightningCLI is a parse error (issue 26).

The constraints are in the annotations jsonargparse reads (``PositiveInt``, ``UnitFraction``, ...,
lightning_debug/config_types.py), so a bad value stops the parser with exit code 2 and a message naming the
field, before any callback is built, given flat (the callback's keyword) or nested (its ``config:`` block).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_debug import (AnomalyDetectionCallback, DebugConfig, GradientHealthCallback, MemoryProfilerCallback,
                             PerformanceProfilerCallback)

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
CALLBACKS = (AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback, PerformanceProfilerCallback)
BAD_VALUES: dict[str, Any] = {
    "mode": "everything", "level": "deep", "anomaly_detection_mode": "ignore",
    "anomaly_check_frequency": 0, "gradient_checking_frequency": -5, "memory_profiling_frequency": 0,
    "performance_profiling_frequency": 2.5, "gradient_explosion_threshold": -1.0,
    "gradient_vanishing_threshold": -1e-6, "save_debug_info": "maybe", "debug_output_dir": " ",
    "log_gradients": "maybe", "log_activations": "maybe", "log_weights": "maybe", "log_memory": "maybe",
    "log_performance": "maybe", "memory_high_fraction": 1.5, "slow_step_factor": 1.0,
    "dataloader_bottleneck_share": 0.0, "profile_steps": [2, 500], "save_plots": "maybe", "print_summary": "maybe",
    "follow_log_cadence": "maybe", "expose_callback_metrics": "maybe",
}


def test_every_field_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) == {field.name for field in dataclasses.fields(DebugConfig)}
    for field, value in BAD_VALUES.items():  # each one is also rejected from Python, naming the field
        with pytest.raises(ValueError, match=field):
            DebugConfig(**{field: value})


def _parse(directory: Path, callback: type, init_args: dict[str, Any]) -> tuple[int | None, str]:
    from lightning.pytorch.cli import LightningCLI

    from tests.harness.toolkit import TinyRegressor

    document = {"trainer": {"logger": False, "enable_checkpointing": False, "callbacks": [
        {"class_path": f"lightning_debug.{callback.__name__}", "init_args": init_args}]}}
    path = directory / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            LightningCLI(TinyRegressor, run=False, args=["--config", str(path)], save_config_callback=None)
    except SystemExit as exit_info:
        return int(exit_info.code or 0), printed.getvalue()
    return None, printed.getvalue()


def _cases() -> list[tuple[str, type, bool]]:
    cases = [(field, AnomalyDetectionCallback, False) for field in BAD_VALUES]
    for callback in CALLBACKS:
        flat = [name for name in inspect.signature(callback.__init__).parameters if name in BAD_VALUES]
        cases += [(field, callback, True) for field in flat]
    return cases


@pytest.mark.parametrize("field, callback, flat", _cases(),
                         ids=lambda v: v.__name__ if isinstance(v, type) else ("flat" if v is True else
                                                                               "nested" if v is False else v))
def test_a_bad_value_is_a_parse_error_naming_the_field(tmp_path: Path, field: str, callback: type, flat: bool) -> None:
    value = BAD_VALUES[field]
    code, printed = _parse(tmp_path, callback, {field: value} if flat else {"config": {field: value}})
    assert code == 2, printed[-1500:]
    error = printed[printed.index("error:"):]
    assert f'"{field}"' in error or f"'{field}'" in error or f".{field}" in error, error
    assert "Traceback" not in printed


def test_out_of_range_from_the_command_line_exits_2_without_a_traceback(tmp_path: Path) -> None:
    """As a user runs it: the range check used to run in ``__post_init__``, after parsing (exit 1, a traceback)."""
    document = {"trainer": {"logger": False, "max_steps": 1, "callbacks": [
        {"class_path": "lightning_debug.MemoryProfilerCallback", "init_args": {"memory_high_fraction": 1.5}}]}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(document))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config", "bad.yaml"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr
    assert 'Parser key "memory_high_fraction"' in completed.stderr and "UnitFraction" in completed.stderr


# --- run-wide settings on any callback -----------------------------------------------------------------------------


def test_run_wide_settings_on_any_callback_are_honoured(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from tests.harness.toolkit import TinyRegressor

    callbacks = [AnomalyDetectionCallback(), GradientHealthCallback(),
                 MemoryProfilerCallback(DebugConfig(debug_output_dir="third_callback_dir", save_plots=False,
                                                    print_summary=False))]
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(TinyRegressor())
    written = list((tmp_path / "third_callback_dir").glob("*/report.json"))
    assert len(written) == 1, "the directory set on the third callback is the run's"
    assert not list(written[0].parent.glob("*.png")), "save_plots=False from the third callback"


def test_two_callbacks_that_disagree_on_a_run_wide_setting_are_an_error_naming_both(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from tests.harness.toolkit import TinyRegressor

    callbacks = [AnomalyDetectionCallback(debug_output_dir="a"), GradientHealthCallback(debug_output_dir="b")]
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with pytest.raises(ValueError, match="debug_output_dir is a setting of the whole run, but "
                                         "AnomalyDetectionCallback sets 'a' and GradientHealthCallback 'b'"):
        trainer.fit(TinyRegressor())
