"""What a step's gradient pass costs when MoE experts get no token: ``ParameterIndex.local_grads`` and the
plan's squared norms, 8 experts of 1024 x 1024 of which 6 have no gradient, one thread.

A missing gradient is measured from a zero the index keeps per slot; before issue 28's sixth pass it was a
fresh zero tensor of the expert's size each step (run this script at an earlier revision to compare).

    OMP_NUM_THREADS=1 python benchmarks/missing_grads.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from lightning_debug.core.numerics import ParameterIndex


def main(repeats: int = 200) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    experts = nn.ModuleList([nn.Linear(1024, 1024, bias=False) for _ in range(8)])
    x = torch.randn(4, 1024)
    (experts[0](x).sum() + experts[1](x).sum()).backward()
    index = ParameterIndex(list(experts.named_parameters()))

    def once() -> torch.Tensor:
        grads, _ = index.local_grads()
        return index.plan.squares(grads)

    for _ in range(5):
        once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"median {times[len(times) // 2] * 1e3:.3f} ms per step (local_grads + squared norms; 6 of 8 experts "
          "of 1024 x 1024 without a gradient)")


if __name__ == "__main__":
    main()
