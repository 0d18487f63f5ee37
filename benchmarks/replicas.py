"""The cost of comparing DDP replicas (``replicas_diverged``) on a check step: two gloo processes on the CPU.

Each rank builds the same MLP, a gradient for every parameter, and times the check step's shared measurement
(:class:`~lightning_debug.core.numerics.StepNumerics`: the fused norm pass, its one all-reduce, the read-back) without
and with ``with_replicas`` (the weights' fused norm pass, one gather kernel, one float64 per parameter and rank more
in the same all-reduce), alternating, and the comparison itself on the host
(:func:`~lightning_debug.monitors.gradients.replicas.judge_replicas`); rank 0 prints medians, and a training step
(forward, backward, SGD) of the same model for scale.

    OMP_NUM_THREADS=1 python benchmarks/replicas.py --layers 24 --width 512 --repeats 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from lightning_debug.core.numerics import ParameterIndex, StepNumerics  # noqa: E402
from lightning_debug.monitors.gradients.replicas import judge_replicas  # noqa: E402


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, args.width)
    index = ParameterIndex(list(model.named_parameters()), rank)

    def train_step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()

    def measure(replicas: bool) -> StepNumerics:
        numerics = StepNumerics(0, index, None, dist.all_reduce, with_replicas=replicas)
        numerics.read()
        return numerics

    train_step()
    times: dict[str, list[float]] = {"step": [], "without": [], "with": [], "judge": []}
    for repeat in range(args.repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        train_step()
        step = time.perf_counter() - start
        order = [False, True] if repeat % 2 else [True, False]
        measured: dict[bool, float] = {}
        for replicas in order:
            dist.barrier()
            start = time.perf_counter()
            numerics = measure(replicas)
            measured[replicas] = time.perf_counter() - start
        host = numerics.read() if order[-1] else measure(True).read()
        start = time.perf_counter()
        verdict = judge_replicas(0, host.replica_names, host.replica_squares())
        judged = time.perf_counter() - start
        assert verdict is None and len(host.replica_names) == len(index)
        if repeat >= 2:  # the first two warm the caches and the plan
            times["step"].append(step)
            times["without"].append(measured[False])
            times["with"].append(measured[True])
            times["judge"].append(judged)
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        added = median_ms(times["with"]) - median_ms(times["without"]) + median_ms(times["judge"])
        print(f"{args.layers} x Linear({args.width}): {len(index)} tensors, {parameters / 1e6:.1f}M parameters, "
              f"2 gloo ranks, {args.repeats} repeats, torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s)")
        print(f"training step (forward, backward, all-reduce, SGD): {median_ms(times['step']):.2f} ms")
        print(f"check step measurement without replicas: {median_ms(times['without']):.2f} ms, "
              f"with: {median_ms(times['with']):.2f} ms; judge_replicas: {median_ms(times['judge']):.3f} ms")
        print(f"added per check step: {added:.2f} ms "
              f"({100 * added / median_ms(times['step']):.1f}% of one training step; "
              f"{100 * added / median_ms(times['step']) / args.every:.3f}% of training at one check every "
              f"{args.every} steps)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--every", type=int, default=100, help="gradient_checking_frequency")
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
