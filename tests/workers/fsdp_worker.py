"""Sharded training on CPU (gloo) used by test_sharded.py: Lightning's ModelParallelStrategy with
FSDP2 (``fully_shard``) or tensor parallelism (``parallelize_module``), all four callbacks, every
check on every step, a NaN planted on one rank at one step.

Usage: python tests/workers/fsdp_worker.py OUT_DIR DP TP MODE NAN_RANK NAN_STEP

DP x TP processes are started by Lightning's launcher (DP=2 TP=1: FSDP2; DP=1 TP=2: tensor
parallel). Each rank writes OUT_DIR/result_<rank>.json with its decisions, the reference norms
of every step (``torch.nn.utils.get_total_norm`` where it accepts the gradients, and the full
tensors' norms), the plugin's host values of the same steps, whether the skipped step left every
local shard and the optimizer state bit-identical, the steps at which it entered an all-reduce,
and the checks that failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

from lightning_debug import DebugConfig, debug_callbacks  # noqa: E402
from lightning_debug.callbacks.base import RUN_ATTRIBUTE  # noqa: E402
from tests.harness.toolkit import (console_lines, exit_worker, fork_ranks, make_trainer,  # noqa: E402
                                   regression_data)

MAX_STEPS = 12


class MLP(nn.Module):
    """Three output features in ``extra``: uneven shards (2 + 1 rows), and an empty one for ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.extra(torch.relu(self.hidden(torch.relu(self.inp(x)))))))


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class Sharded(pl.LightningModule):
    def __init__(self, nan_rank: int, nan_step: int) -> None:
        super().__init__()
        self.model = MLP()
        self.nan_rank, self.nan_step = nan_rank, nan_step

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            # head stays a plain (replicated) module: RowwiseParallel needs even input shards
            parallelize_module(self.model, mesh["tensor_parallel"], {
                "inp": ColwiseParallel(), "hidden": RowwiseParallel(), "extra": ColwiseParallel(output_layouts=Replicate())})
        if mesh["data_parallel"].size() > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in (self.model.inp, self.model.hidden, self.model.extra, self.model.head):
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step:
            loss = loss * torch.tensor(float("nan"))  # NaN gradients: the reduce-scatter spreads them to every shard
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(regression_data(512), batch_size=16)


def local_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"param {name}": local(p).detach().clone() for name, p in module.named_parameters()}
    names = {id(p): name for name, p in module.named_parameters()}
    for parameter, values in optimizer.state.items():
        for key, value in values.items():
            if torch.is_tensor(value):
                state[f"state {names[id(parameter)]} {key}"] = local(value).detach().clone()
    return state


class Reference(pl.Callback):
    """Before the debug callbacks: the gradients' norms by torch's own functions."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, Any]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        named = [(name, p) for name, p in pl_module.named_parameters() if p.grad is not None]
        grads = [p.grad for _, p in named]
        per_parameter = {name: float(full(p.grad).double().norm()) for name, p in named}
        # get_total_norm rejects a mix of plain tensors and DTensors (tensor parallel with a plain head), and of
        # DTensors on different meshes (a 2-D mesh with layers sharded on its data-parallel sub-mesh)
        groups: dict[Any, list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
        parts = [float(full(torch.nn.utils.get_total_norm(group))) for group in groups.values()]
        total = math.sqrt(sum(part * part for part in parts))
        self.norms[trainer.global_step] = {"get_total_norm": total, "per_parameter": per_parameter,
                                           "from_full_tensors": math.sqrt(sum(v * v for v in per_parameter.values()))}


class Observer(pl.Callback):
    """After the debug callbacks: their decision, their host values, and what a skip left behind."""

    def __init__(self, nan_step: int) -> None:
        self.nan_step = nan_step
        self.decisions: list[list[Any]] = []
        self.measured: dict[int, dict[str, Any]] = {}
        self.before: dict[str, torch.Tensor] = {}
        self.skip_changed: list[str] | None = None
        self.reduce_steps: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        all_reduce = torch.distributed.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.reduce_steps.append(trainer.global_step)
            return all_reduce(*args, **kwargs)

        torch.distributed.all_reduce = counted

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        skipped = all(p.grad is None for group in optimizer.param_groups for p in group["params"])
        self.decisions.append([step, "skip" if skipped else "step"])
        numerics = getattr(trainer, RUN_ATTRIBUTE).numerics._current
        host = numerics.read()
        self.measured[step] = {"global_norm": host.global_grad_norm, "names": host.grad_names,
                               "grad_norms": host.grad_norms, "sharded": numerics.index.sharded,
                               "replicas": host.replica_names}
        if step == self.nan_step:
            self.before = local_state(pl_module, optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.nan_step + 1:
            after = local_state(pl_module, trainer.optimizers[0])
            self.skip_changed = sorted(key for key in self.before if not torch.equal(self.before[key], after[key]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("dp", type=int)
    parser.add_argument("tp", type=int)
    parser.add_argument("mode")
    parser.add_argument("nan_rank", type=int)
    parser.add_argument("nan_step", type=int)
    args = parser.parse_args()
    fork_ranks(args.dp * args.tp)
    pl.seed_everything(0, verbose=False)  # the plain (not parallelized) head starts alike on every rank
    config = DebugConfig(anomaly_detection_mode=args.mode, anomaly_check_frequency=1, gradient_checking_frequency=1,
                         memory_profiling_frequency=1, performance_profiling_frequency=1, log_gradients=True,
                         log_weights=True, level="advanced")
    reference, observer = Reference(), Observer(args.nan_step)
    trainer = make_trainer(args.out_dir / "run", [reference, *debug_callbacks(config), observer], max_steps=MAX_STEPS,
                           devices=args.dp * args.tp,
                           strategy=ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp))
    model = Sharded(args.nan_rank, args.nan_step)
    with console_lines() as caught:
        trainer.fit(model)
    run = getattr(trainer, RUN_ATTRIBUTE)
    full_checksum = float(sum(full(p).detach().double().sum() for p in model.parameters()))
    outcome = {
        "rank": trainer.global_rank, "global_step": trainer.global_step, "decisions": observer.decisions,
        "reference": reference.norms, "measured": observer.measured, "skip_changed": observer.skip_changed,
        "skipped_keys": len(observer.before), "reduce_steps": observer.reduce_steps,
        "params_finite": all(bool(torch.isfinite(full(p)).all()) for p in model.parameters()),
        "full_checksum": full_checksum, "failed_checks": run.failures.summary(),
        "warnings": [line for line in caught if "lightning-debug" in line],
        "output_dir": str(run.session.output_dir) if run.session.output_dir is not None else None,
        "log_dir": trainer.log_dir,
    }
    (args.out_dir / f"result_{trainer.global_rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
    exit_worker()
