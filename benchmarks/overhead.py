"""Step-time overhead of lightning-debug against a plain Lightning Trainer, and against the anchors
users have today (``Trainer(detect_anomaly=True)``, the ``grad_norm`` logging recipe,
``DeviceStatsMonitor``).

Configurations run interleaved (A B C ... A B C ...) so drift hits all of them alike; each run
times the steady-state steps after a warm-up, and the table shows the median per-step time and its
ratio to its plain loop. On CPU a small MLP; with CUDA also a ~134M-parameter GPT-like model in bf16.

    python benchmarks/overhead.py                 # CPU model, 5 rounds
    python benchmarks/overhead.py --rounds 7 --steps 300 --only plain,anomaly_warn

Results are printed as a Markdown table (paste into docs/performance.md with the machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_debug import (AnomalyDetectionCallback, DebugConfig, GradientHealthCallback, MemoryProfilerCallback,
                             PerformanceProfilerCallback)


def per_step_median(stamps: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


class StepClock(pl.Callback):
    """Time per step after ``warmup``.

    On CPU (one intra-op thread, so all work runs on the main thread): the median per-step *CPU time
    of the main thread* (``time.thread_time``), which a busy shared machine does not inflate the way
    it inflates wall time; the wall-time median is kept too. On CUDA: the mean wall time over the
    window, synchronizing only at its two ends.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.seconds_per_step = float("nan")
        self.wall_seconds_per_step = float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            if not self.wall and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter())
            self.cpu.append(time.thread_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.wall.append(time.perf_counter())
            self.seconds_per_step = (self.wall[-1] - self.wall[0]) / (len(self.wall) - 1)
            self.wall_seconds_per_step = self.seconds_per_step
        else:
            self.seconds_per_step = per_step_median(self.cpu)
            self.wall_seconds_per_step = per_step_median(self.wall)


class GradNormRecipe(pl.Callback):
    """Lightning's documented recipe: ``self.log_dict(grad_norm(self, norm_type=2))`` every step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


class MLP(pl.LightningModule):
    def __init__(self, width: int = 512, depth: int = 6) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TokenData(Dataset):
    def __init__(self, vocab: int, length: int, size: int) -> None:
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.length + 1,), generator=torch.Generator().manual_seed(index))


class GPT(pl.LightningModule):
    """~134M parameters: 12 layers, width 768, 12 heads, vocabulary 32000, untied head."""

    def __init__(self, vocab: int = 32000, width: int = 768, depth: int = 12, heads: int = 12, length: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        hidden = self.blocks(self.embed(inputs) + self.position[:, : inputs.shape[1]], mask=self.mask, is_causal=True)
        logits = self.head(self.norm(hidden))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=torch.cuda.is_available())


def every_step(**overrides: Any) -> DebugConfig:
    return DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                       performance_profiling_frequency=1, save_debug_info=False, print_summary=False,
                       save_plots=False, **overrides)


def configurations() -> dict[str, Callable[[], dict[str, Any]]]:
    from lightning.pytorch.callbacks import DeviceStatsMonitor

    return {
        "plain": lambda: {},
        "anomaly_warn": lambda: {"callbacks": [AnomalyDetectionCallback(every_step())]},
        "anomaly_raise": lambda: {"callbacks": [AnomalyDetectionCallback(every_step(anomaly_detection_mode="raise"))]},
        "anomaly_advanced": lambda: {"callbacks": [AnomalyDetectionCallback(every_step(level="advanced"))]},
        "gradients_per_param": lambda: {"callbacks": [GradientHealthCallback(every_step(log_gradients=True))]},
        "memory": lambda: {"callbacks": [MemoryProfilerCallback(every_step())]},
        "performance": lambda: {"callbacks": [PerformanceProfilerCallback(every_step())]},
        "all_four": lambda: {"callbacks": [cls(every_step()) for cls in (AnomalyDetectionCallback, GradientHealthCallback,
                                                                        MemoryProfilerCallback, PerformanceProfilerCallback)]},
        "all_four_defaults": lambda: {"callbacks": [cls(DebugConfig(save_debug_info=False, print_summary=False,
                                                                    save_plots=False))
                                                    for cls in (AnomalyDetectionCallback, GradientHealthCallback,
                                                                MemoryProfilerCallback, PerformanceProfilerCallback)]},
        "anchor_detect_anomaly": lambda: {"detect_anomaly": True},
        "anchor_grad_norm_recipe": lambda: {"callbacks": [GradNormRecipe()]},
        "anchor_device_stats": lambda: {"callbacks": [DeviceStatsMonitor()]},
    }


ACCELERATE_CONFIGURATIONS: dict[str, Callable[[], DebugConfig] | None] = {
    "accelerate_plain": None,
    "accelerate_anomaly_warn": lambda: every_step(mode="anomaly_detection"),
    "accelerate_all_four": lambda: every_step(),
}


def run_accelerate_once(name: str, steps: int, warmup: int) -> float:
    """The same MLP, data and optimizer in a plain Accelerate loop, with or without the debugger."""
    import contextlib
    import io

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_debug.accelerate import AccelerateDebugger

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = MLP().net
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(64 * (steps + 1), 64), torch.randn(64 * (steps + 1), 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=64))
    make_config = ACCELERATE_CONFIGURATIONS[name]
    debugger = AccelerateDebugger(accelerator, model, optimizer, make_config()) if make_config else None
    backward = debugger.backward if debugger is not None else accelerator.backward
    stamps: list[float] = []
    wall: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (x, y) in enumerate(loader):
            if step >= warmup:
                stamps.append(time.thread_time() if not torch.cuda.is_available() else time.perf_counter())
                wall.append(time.perf_counter())
            if step == steps:
                break
            backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        elapsed = per_step_median(stamps)
        if debugger is not None:
            with contextlib.redirect_stdout(io.StringIO()):
                debugger.finish()
    return elapsed


class HookTimer:
    """Main-thread CPU time spent inside lightning-debug's hooks, measured within the run itself."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, callbacks: list[pl.Callback]) -> None:
        for callback in callbacks:
            if not type(callback).__module__.startswith("lightning_debug"):
                continue
            for name in dir(type(callback)):
                if name.startswith("on_") or name in ("setup", "teardown", "state_dict"):
                    setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started
        return timed


HOOK_TIMES: dict[str, list[tuple[float, float]]] = {}


def run_once(model_name: str, name: str, steps: int, warmup: int) -> float:
    if name in ACCELERATE_CONFIGURATIONS:
        return run_accelerate_once(name, steps, warmup)
    torch.manual_seed(0)
    if model_name == "gpt":
        model: pl.LightningModule = GPT()
        loader = DataLoader(TokenData(32000, 512, 8 * (steps + 1)), batch_size=8, num_workers=2, pin_memory=True)
        extra: dict[str, Any] = {"accelerator": "gpu", "precision": "bf16-mixed"}
    else:
        model = MLP()
        data = TensorDataset(torch.randn(64 * (steps + 1), 64), torch.randn(64 * (steps + 1), 1))
        loader = DataLoader(data, batch_size=64)
        extra = {"accelerator": "cpu"}
    options = configurations()[name]()
    clock = StepClock(warmup)
    hooks = HookTimer()
    hooks.wrap(options.get("callbacks", []))
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(max_steps=steps, devices=1, logger=CSVLogger(os.environ.get("BENCH_DIR", "/tmp/ld-bench")),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock, *options.pop("callbacks", [])], **options,
                         **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    if hooks.seconds:
        total_cpu = clock.cpu[-1] - clock.cpu[0] if len(clock.cpu) > 1 else float("nan")
        HOOK_TIMES.setdefault(name, []).append((hooks.seconds / steps, total_cpu / max(len(clock.cpu) - 1, 1)))
    return clock.seconds_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "gpt"], default="gpt" if torch.cuda.is_available() else "mlp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1: stabler)")
    args = parser.parse_args()
    if args.model == "mlp":
        torch.set_num_threads(args.threads)
    every_name = [*configurations(), *(ACCELERATE_CONFIGURATIONS if args.model == "mlp" else {})]
    names = [n for n in every_name if not args.only or n in args.only.split(",")]
    if "plain" not in names:
        names.insert(0, "plain")
    if any(n.startswith("accelerate") for n in names) and "accelerate_plain" not in names:
        names.insert(1, "accelerate_plain")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            times[name].append(run_once(args.model, name, args.steps, args.warmup))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    device = torch.cuda.get_device_name() if args.model == "gpt" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\nModel: {args.model}; device: {device}; torch {torch.__version__}; lightning {pl.__version__}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps ({args.warmup} warm-up); "
          f"{'median step of each run, ' if args.model == 'mlp' else ''}median over runs\n")
    unit = " (main-thread CPU time)" if args.model == "mlp" else ""
    print(f"| configuration | median ms/step{unit} | ratio to its plain loop | spread (min-max ms) |")
    print("|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        baseline = statistics.median(times["accelerate_plain" if name.startswith("accelerate") else "plain"])
        print(f"| {name} | {median * 1e3:.2f} | {median / baseline:.3f}x | "
              f"{min(times[name]) * 1e3:.2f}-{max(times[name]) * 1e3:.2f} |")
    if HOOK_TIMES and args.model == "mlp":
        print("\nWithin-run cost of lightning-debug's hooks (main-thread CPU time; immune to drift between runs):\n")
        print("| configuration | hooks ms/step | rest of the step ms | overhead |")
        print("|---|---|---|---|")
        for name, samples in HOOK_TIMES.items():
            hook_ms = statistics.median(h for h, _ in samples) * 1e3
            step_ms = statistics.median(t for _, t in samples) * 1e3
            print(f"| {name} | {hook_ms:.3f} | {step_ms - hook_ms:.2f} | {step_ms / (step_ms - hook_ms):.3f}x |")


if __name__ == "__main__":
    main()
