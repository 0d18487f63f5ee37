"""Two CPU processes (gloo) under DDP, ``GradientHealthCallback`` at its defaults (issue 45, TrainCheck's
distributed silent errors): replicas that drift apart are ``replicas_diverged`` at the first check step after the
drift (step 100), naming the parameters and rank 1; every rank trained on the same batches
(``use_distributed_sampler=False``) is ``same_batch_on_ranks``; the healthy twins (plain DDP, DDP with
``find_unused_parameters``, a ``DistributedSampler`` of the module's own) find nothing; one process compares nothing. FSDP2 and tensor parallelism (shards are not
replicas) are quiet in ``test_sharded.py``. The two-process cases are fits one after the other in one torchrun job
(``tests/workers/replicas_worker.py``), so its imports, most of the time, are paid once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.toolkit import REPO, read_events, read_report, run_children

WORKER = Path(__file__).resolve().parents[1] / "workers" / "replicas_worker.py"
TIMEOUT_S = 240
CHECK_STEP = 100  # the default gradient_checking_frequency's second check step, after the drift at step 30
EVERY_PARAMETER = ["inp.weight", "inp.bias", "hidden.weight", "hidden.bias", "head.weight", "head.bias"]
HEALTHY = ["none:ddp", "none:ddp_find_unused_parameters_true", "own-sampler"]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of this file, one fit after the other in one two-process job (torchrun, gloo)."""
    out = tmp_path_factory.mktemp("replicas")
    cases = [fault for fault, _ in PLANTED] + HEALTHY + ["same-batches"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
               str(out), *cases]
    completed = run_children(command, TIMEOUT_S, REPO)
    assert completed.returncode == 0, f"torchrun exited with {completed.returncode}:\n{completed.stdout[-5000:]}"
    return out


def results(out: Path, case: str) -> list[dict[str, Any]]:
    results = [json.loads((out / case / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["exception"] is None and result["global_step"] == 101, result
        assert result["failed_checks"] == []
        assert result["seconds"] < 60, "a fit of 101 steps of a tiny MLP"
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
        fits: Path, fault: str, parameters: list[str]) -> None:
    """Clipping on rank 1 only, rank 1's gradients zeroed after the all-reduce, a layer re-initialised on rank 1,
    three steps without DDP's gradient sync: each is named at check step 100, with what drifted and rank 1."""
    zero, one = results(fits, fault)
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
@pytest.mark.parametrize("case", HEALTHY)
def test_healthy_ddp_replicas_find_nothing(fits: Path, case: str) -> None:
    zero, one = results(fits, case)
    assert zero["checksum"] == one["checksum"], "DDP replicas are bit-identical"
    debug_dir = Path(zero["output_dir"])
    assert not [e for e in read_events(debug_dir) if e["severity"] in ("warning", "error")]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_every_rank_training_on_the_same_batches_is_named(fits: Path) -> None:
    """``use_distributed_sampler=False`` with the module's shuffled loader: both ranks shuffle with seed 0 and train on
    the same batches, with the same loss. Named at check step 100 (held from step 0), from the fingerprints and losses
    the shared pass's one collective carries; its twin, the same setting beside a ``DistributedSampler`` of the
    module's own, is quiet (``test_healthy_ddp_replicas_find_nothing``)."""
    zero, one = results(fits, "same-batches")
    debug_dir = Path(zero["output_dir"])
    found = [e for e in read_events(debug_dir) if e["severity"] in ("warning", "error") and e.get("episode") != "end"]
    assert [(e["kind"], e["step"], e["details"]["since_step"], e["details"]["ranks"]) for e in found] == [
        ("same_batch_on_ranks", CHECK_STEP, 0, 2)]
    assert "accelerator.prepare()" in found[0]["message"] and "DistributedSampler" in found[0]["message"]


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
