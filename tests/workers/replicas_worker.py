"""Two CPU processes (gloo) under DDP with ``GradientHealthCallback`` at its defaults (check steps 0 and 100), used by
``tests/integration/test_replicas.py``: the replicas drift apart on rank 1 (issue 45, TrainCheck's distributed
silent errors), or a healthy twin.

Usage: torchrun --standalone --nproc_per_node 2 tests/workers/replicas_worker.py OUT_DIR CASE [CASE ...]

CASE is FAULT or FAULT:STRATEGY (default ``ddp``), one fit each, one after the other in the same two processes (the
imports, most of a two-process test's time, are paid once). FAULT: ``none``; ``clip-rank1`` (rank 1 clips its
gradients to a norm of 1e-3 in ``on_before_optimizer_step``, after DDP's all-reduce); ``zero-rank1`` (rank 1's
gradients zeroed there: a broken link delivering zeros); ``reinit-rank1`` (rank 1 re-initialises ``hidden`` at step
:data:`PLANT_STEP`: a reload or ``.to()`` done on one rank); ``unsynced`` (steps :data:`PLANT_STEP` to +2 run with
DDP's gradient sync off, as a forward around the wrapper); ``same-batches`` (``use_distributed_sampler=False``: every
rank shuffles the whole data set with one seed, so every rank trains on the same batches) and its twin ``own-sampler``
(``use_distributed_sampler=False`` beside a ``DistributedSampler`` of the module's own). Each rank writes OUT_DIR/CASE/result_<rank>.json: its
weights' checksum, how training ended, where rank zero wrote, the collectives the plugin made, the fit's seconds.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_debug import GradientHealthCallback  # noqa: E402
from lightning_debug.callbacks.base import RUN_ATTRIBUTE  # noqa: E402
from tests.harness.toolkit import TinyRegressor, exit_worker, make_trainer, regression_data  # noqa: E402

MAX_STEPS = 101
PLANT_STEP = 30


class Drifting(TinyRegressor):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if self.fault == "reinit-rank1" and self.global_rank == 1 and step == PLANT_STEP:
            self.hidden.reset_parameters()
        if self.fault == "unsynced":
            self.trainer.strategy.model.require_backward_grad_sync = not PLANT_STEP <= step < PLANT_STEP + 3

    def train_dataloader(self) -> DataLoader:
        if self.fault != "own-sampler":
            return super().train_dataloader()
        data = regression_data()
        return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, shuffle=True, seed=0))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # after the callbacks' hook of the same name, which measured the step
        if self.global_rank != 1:
            return
        if self.fault == "clip-rank1":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1e-3)
        elif self.fault == "zero-rank1":
            for parameter in self.parameters():
                if parameter.grad is not None:
                    parameter.grad.zero_()


def fit(out_dir: Path, fault: str, strategy: str) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(out_dir / "run", [GradientHealthCallback()], max_steps=MAX_STEPS, devices=2,
                           strategy=strategy, logger=False,
                           use_distributed_sampler=fault not in ("same-batches", "own-sampler"))
    model = Drifting(fault)
    outcome: dict[str, Any] = {"exception": None}
    started = time.perf_counter()
    try:
        trainer.fit(model)
    except Exception as error:
        outcome["exception"] = f"{type(error).__name__}: {error}"
    run = getattr(trainer, RUN_ATTRIBUTE, None)
    session = getattr(run, "session", None)
    outcome.update(rank=trainer.global_rank, global_step=trainer.global_step, seconds=time.perf_counter() - started,
                   checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
                   output_dir=str(session.output_dir) if getattr(session, "output_dir", None) else None,
                   failed_checks=sorted(run.failed_checks()) if run is not None else [],
                   gate_log=[list(entry) for entry in run.gate.log] if run is not None else [])
    (out_dir / f"result_{trainer.global_rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    out_dir = Path(sys.argv[1])
    warnings.simplefilter("ignore")
    for case in sys.argv[2:]:
        fault, _, strategy = case.partition(":")
        (out_dir / case).mkdir(parents=True, exist_ok=True)
        fit(out_dir / case, fault, strategy or "ddp")


if __name__ == "__main__":
    main()
    exit_worker()
