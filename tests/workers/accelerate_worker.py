"""One process of the two-process Accelerate test (started by tests/integration/test_accelerate.py with torchrun).

For each anomaly mode given, a fresh model is trained for a few steps, with every area of checks on
(so the gathers of the anomaly and performance checks run too), and a non-finite loss
planted on one rank only, from one step on. The plant adds ``log(0)`` to the loss: the gradients
stay finite, so only the process that computed the loss can know; the others learn it from the
gathered flags. Each process writes ``<out>/<mode>/result_rank<r>.json`` with what it decided, at
which step, and a checksum of its parameters, for the test to compare across ranks.

Mode ``unprepared`` is a healthy loop whose DataLoader was not given to ``accelerator.prepare`` (model and optimizer
were): every process reads the same batches, and nothing is planted.

Mode ``fsdp2`` is ``skip`` for a user who shards the model with ``fully_shard`` (FSDP2) before
``accelerator.prepare(optimizer, loader)``: NaN gradients on one rank at one step (they reach every
shard), the gradient norms of the other steps compared with ``torch.nn.utils.get_total_norm``.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/workers/accelerate_worker.py \
        --out /tmp/x --modes raise stop skip --nan-rank 1 --nan-step 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_debug import AnomalyError, DebugConfig  # noqa: E402
from lightning_debug.config import Area  # noqa: E402
from lightning_debug.accelerate import AccelerateDebugger  # noqa: E402


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(accelerator: Accelerator, out: Path, mode: str, nan_rank: int, nan_step: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.ReLU(), nn.Linear(3, 1))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator))
    loader = DataLoader(data, batch_size=8)
    sharded = mode == "fsdp2"
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (accelerator.num_processes,))
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizer, loader = accelerator.prepare(optimizer, loader)  # preparing the model would wrap it in DDP
    elif mode == "unprepared":  # the loader left out of prepare(): every process reads all of it, in one order
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = DebugConfig(anomaly_detection_mode="skip" if sharded or mode == "unprepared" else mode, debug_output_dir=str(out / mode / "debug"),
                         gradient_checking_frequency=2, memory_profiling_frequency=2,
                         performance_profiling_frequency=1)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config)
    result: dict = {"rank": accelerator.process_index, "mode": mode, "raised_at": None, "stopped_at": None,
                    "norms": [], "decisions": []}
    with debugger:
        try:
            for x, y in loader:
                if debugger.step >= steps:
                    break
                loss = nn.functional.mse_loss(model(x), y)
                if mode == "unprepared":
                    pass
                elif sharded and accelerator.process_index == nan_rank and debugger.step == nan_step:
                    loss = loss * torch.tensor(float("nan"))  # NaN gradients, spread to every shard
                elif not sharded and accelerator.process_index == nan_rank and debugger.step >= nan_step:
                    loss = loss + torch.log(torch.zeros((), device=loss.device))
                step = debugger.step
                debugger.backward(loss)
                grads = [p.grad for p in model.parameters()]
                result["decisions"].append([step, "skip" if all(g is None for g in grads) else "step"])
                if sharded and all(g is not None for g in grads):
                    host = debugger.run.numerics._current.read()
                    result["norms"].append([host.global_grad_norm,
                                            float(full(torch.nn.utils.get_total_norm(grads)))])
                optimizer.step()
                optimizer.zero_grad()
                if debugger.should_stop:
                    result["stopped_at"] = debugger.step - 1
                    break
        except AnomalyError as error:
            result["raised_at"] = error.step
    parameters = [full(p.detach()) for p in accelerator.unwrap_model(model).parameters()]
    result["steps_taken"] = debugger.step
    result["failed_checks"] = debugger.run.failures.summary()
    result["sharded"] = debugger.run.numerics._current.index.sharded
    anomalies = debugger.run.monitor(Area.ANOMALY)
    result["skipped_steps"] = anomalies.skipped_steps if anomalies is not None else None
    result["params_finite"] = all(bool(torch.isfinite(p).all()) for p in parameters)
    result["param_checksum"] = float(sum(p.double().sum() for p in parameters))
    (out / mode).mkdir(parents=True, exist_ok=True)
    (out / mode / f"result_rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", default=["raise", "stop", "skip"])
    parser.add_argument("--nan-rank", type=int, default=1)
    parser.add_argument("--nan-step", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes != 2:
        raise SystemExit(f"expected 2 processes, got {accelerator.num_processes}")
    for mode in args.modes:
        train(accelerator, args.out, mode, args.nan_rank, args.nan_step, args.steps)
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything the test reads is written and flushed. Without C++ static destructors: at interpreter exit a
    # torch-internal thread of the process group sometimes aborts the process after a finished run ("terminate
    # called without an active exception", seen in two full local suites on the 2-core machine), which is not what
    # these tests are about.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
