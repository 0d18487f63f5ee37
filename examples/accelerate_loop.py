"""A plain Hugging Face Accelerate training loop with lightning-debug's checks (three added lines).

The model is a small MLP on random regression data; ``--plant`` puts a bug in it so there is
something to find:

- ``nan``: from step 30 on, one sample of each batch is NaN (non-finite loss and gradients);
  with ``--anomaly-mode skip`` those steps are dropped and the weights stay finite.
- ``unused``: a layer that never takes part in the forward (``missing_grad``).
- ``none``: a healthy run.

Run it on one process, or on several::

    python examples/accelerate_loop.py --plant nan --anomaly-mode skip
    torchrun --nproc_per_node 2 examples/accelerate_loop.py --plant nan --anomaly-mode stop
    accelerate launch examples/accelerate_loop.py --accumulation 4

Then look at ``runs/debug_outputs/<run id>/report.md`` (the path is printed) and ``tensorboard --logdir runs``.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import DebugConfig
from lightning_debug.accelerate import AccelerateDebugger


class MLP(nn.Module):
    def __init__(self, unused_layer: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        self.unused = nn.Linear(64, 64) if unused_layer else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plant", choices=["none", "nan", "unused"], default="nan")
    parser.add_argument("--anomaly-mode", choices=["warn", "raise", "skip", "stop"], default="skip")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--project-dir", default="runs")
    args = parser.parse_args()

    # cpu=True on a machine without GPUs, so that torchrun's processes form one job (gloo).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with="tensorboard",
                              project_dir=args.project_dir, gradient_accumulation_steps=args.accumulation)
    accelerator.init_trackers("accelerate_loop")
    torch.manual_seed(0)
    inputs = torch.randn(4096, 16)
    data = TensorDataset(inputs, inputs @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1))
    model = MLP(unused_layer=args.plant == "unused")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    config = DebugConfig(anomaly_detection_mode=args.anomaly_mode, gradient_checking_frequency=10,
                         memory_profiling_frequency=10, performance_profiling_frequency=5)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config, train_dataloader=loader)  # added line 1
    while debugger.step < args.steps and not debugger.should_stop:
        for x, y in loader:
            with accelerator.accumulate(model):
                if args.plant == "nan" and debugger.step >= 30:
                    x = x.clone()
                    x[0, 0] = float("nan")
                loss = nn.functional.mse_loss(model(x), y)
                debugger.backward(loss)                                           # added line 2
                optimizer.step()
                optimizer.zero_grad()
            if debugger.step >= args.steps or debugger.should_stop:
                break
    report = debugger.finish()                                                    # added line 3
    accelerator.end_training()

    if accelerator.is_main_process and report is not None:
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        print(f"{debugger.step} optimizer steps, should_stop={debugger.should_stop}, weights finite: {finite}; "
              f"findings: {', '.join(report['findings']) or 'none'}; files in {debugger.run.session.output_dir}")


if __name__ == "__main__":
    main()
