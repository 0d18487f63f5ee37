"""Two CPU processes (gloo) under DDP, ``GradientHealthCallback`` at its defaults (issue 45, TrainCheck's
distributed silent errors): replicas that drift apart are ``replicas_diverged`` at the first check step after the
drift (step 100), naming the parameters and rank 1; the healthy twins (plain DDP, DDP with
``find_unused_parameters``) find nothing. FSDP2 and tensor parallelism (not replicas) are quiet in
``test_sharded.py``; one process compares nothing (``tests/unit/test_replicas.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.toolkit import read_events, read_report

WORKER = Path(__file__).resolve().parents[1] / "workers" / "replicas_worker.py"
TIMEOUT_S = 120
CHECK_STEP = 100  # the default gradient_checking_frequency's second check step, after the drift at step 30
EVERY_PARAMETER = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "head.weight", "head.bias"]


def run_replicas(tmp_path: Path, fault: str, strategy: str = "ddp") -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    process = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), fault, strategy], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        stderr = f"{stderr}\nHANG: killed after {TIMEOUT_S} s"
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert len(results) == 2, f"both ranks must finish; stderr:\n{stderr[-3000:]}"
    for result in results:
        assert result["exception"] is None and result["global_step"] == 101, result
        assert result["failed_checks"] == []
    assert results[0]["gate_log"] == results[1]["gate_log"], "the same collectives at the same steps on both ranks"
    assert [entry for entry in results[0]["gate_log"] if entry[1] == "numerics"] == [[0, "numerics"],
                                                                                    [CHECK_STEP, "numerics"]], \
        "one collective per check step (the shared pass), none on other steps"
    assert results[1]["output_dir"] is None
    return results


PLANTED = [  # fault, the parameters named
    ("clip-rank1", EVERY_PARAMETER),
    ("zero-rank1", EVERY_PARAMETER),
    ("reinit-rank1", ["hidden.weight", "hidden.bias"]),
    ("unsynced", EVERY_PARAMETER),
]


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize(("fault", "parameters"), PLANTED, ids=[fault for fault, _ in PLANTED])
def test_replicas_drifting_apart_are_named_with_the_parameters_and_the_rank(
        tmp_path: Path, fault: str, parameters: list[str]) -> None:
    """Clipping on rank 1 only, rank 1's gradients zeroed after the all-reduce, a layer re-initialised on rank 1,
    three steps without DDP's gradient sync: each is named at check step 100, with what drifted and rank 1."""
    zero, one = run_replicas(tmp_path, fault)
    assert zero["checksum"] != one["checksum"], "the planted fault made the replicas differ"
    debug_dir = Path(zero["output_dir"])
    found = [e for e in read_events(debug_dir) if e["kind"] == "replicas_diverged" and e.get("episode") == "start"]
    assert [e["step"] for e in found] == [CHECK_STEP]
    details = found[0]["details"]
    assert found[0]["severity"] == "error"
    assert details["parameters"] == parameters and details["ranks"] == [1] and details["agreeing_ranks"] == [0]
    assert details["judged"] == len(EVERY_PARAMETER)
    assert "rank 1" in found[0]["message"] and f"`{parameters[0]}`" in found[0]["message"]
    assert read_report(debug_dir)["findings"]["replicas_diverged"]["first_step"] == CHECK_STEP
    assert "replicas_diverged" in (debug_dir / "report.md").read_text()


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_find_unused_parameters_true"])
def test_healthy_ddp_replicas_find_nothing(tmp_path: Path, strategy: str) -> None:
    zero, one = run_replicas(tmp_path, "none", strategy)
    assert zero["checksum"] == one["checksum"], "DDP replicas are bit-identical"
    debug_dir = Path(zero["output_dir"])
    assert not [e for e in read_events(debug_dir) if e["severity"] in ("warning", "error")]


def test_one_process_compares_nothing(tmp_path: Path) -> None:
    """Without several processes there is nothing to compare: no replica norm is measured, no finding."""
    import lightning.pytorch as pl

    from lightning_debug import GradientHealthCallback
    from lightning_debug.callbacks.base import RUN_ATTRIBUTE
    from tests.harness.toolkit import TinyRegressor, fit_seeded

    compared: list[list[str]] = []

    class Observer(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            compared.append(getattr(trainer, RUN_ATTRIBUTE).numerics._current.read().replica_names)

    trainer = fit_seeded(tmp_path, TinyRegressor(), [GradientHealthCallback(gradient_checking_frequency=1),
                                                     Observer()], max_steps=3, logger=False)
    assert compared == [[], [], []]
    events = read_events(Path(getattr(trainer, RUN_ATTRIBUTE).session.output_dir))
    assert not [e for e in events if e["severity"] in ("warning", "error")]
