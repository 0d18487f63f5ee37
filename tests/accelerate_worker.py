"""One process of the two-process Accelerate test (started by tests/test_accelerate.py with torchrun).

For each anomaly mode given, a fresh model is trained for a few steps, with every area of checks on
(so the gathers of the anomaly and performance checks run too), and a non-finite loss
planted on one rank only, from one step on. The plant adds ``log(0)`` to the loss: the gradients
stay finite, so only the process that computed the loss can know; the others learn it from the
gathered flags. Each process writes ``<out>/<mode>/result_rank<r>.json`` with what it decided, at
which step, and a checksum of its parameters, for the test to compare across ranks.

Usage::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/accelerate_worker.py \
        --out /tmp/x --modes raise stop skip --nan-rank 1 --nan-step 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_debug import AnomalyError, DebugConfig  # noqa: E402
from lightning_debug.accelerate import AccelerateDebugger  # noqa: E402


def train(accelerator: Accelerator, out: Path, mode: str, nan_rank: int, nan_step: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=generator), torch.randn(256, 1, generator=generator))
    loader = DataLoader(data, batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = DebugConfig(anomaly_detection_mode=mode, debug_output_dir=str(out / mode / "debug"),
                         gradient_checking_frequency=2, memory_profiling_frequency=2,
                         performance_profiling_frequency=1)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config)
    result: dict = {"rank": accelerator.process_index, "mode": mode, "raised_at": None, "stopped_at": None}
    with debugger:
        try:
            for x, y in loader:
                if debugger.step >= steps:
                    break
                loss = nn.functional.mse_loss(model(x), y)
                if accelerator.process_index == nan_rank and debugger.step >= nan_step:
                    loss = loss + torch.log(torch.zeros((), device=loss.device))
                debugger.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if debugger.should_stop:
                    result["stopped_at"] = debugger.step - 1
                    break
        except AnomalyError as error:
            result["raised_at"] = error.step
    parameters = [p.detach() for p in accelerator.unwrap_model(model).parameters()]
    result["steps_taken"] = debugger.step
    result["skipped_steps"] = debugger.anomalies.skipped_steps if debugger.anomalies else None
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
