"""Step-time overhead of lightning-debug against a plain Lightning Trainer, and against the anchors
users have today (``Trainer(detect_anomaly=True)``, the ``grad_norm`` logging recipe,
``DeviceStatsMonitor``).

Configurations run interleaved (A B C ... A B C ...) so drift hits all of them alike; each run
times the steady-state steps after a warm-up, and the table shows the median per-step time and its
ratio to its plain loop. Models (``--model``):

- ``mlp``: a 1.1M-parameter MLP (8 parameter tensors), the CPU default;
- ``tiny``: a launch-bound MLP (8 layers of width 32, batch 8): the step is all per-operation overhead;
- ``gpt2``: a ``transformers`` GPT-2 built from its config (12 layers, width 128: 148 parameter tensors);
- ``sweep``: the many-tensor sweep: an ``nn.ParameterList`` of N tensors of 16 elements whose sums enter an
  MSE loss with a ``Linear(8, 1)``, SGD, batch 8, for each N of ``--tensors``; it ends with the slope fit,
  the cost added per parameter tensor: (overhead at 1,000 tensors - overhead at 100) / 900, from step times
  (each run against the plain run of its round), from the time inside the hooks, and from the hooks plus the
  optimizer's update (where the cost of reading the gradients lands: the optimizer finds their Python objects
  made); ``anchor_read_gradients`` reads every ``.grad`` and nothing more, the floor of any such check;
- ``llama24``: a ``transformers`` Llama with 24 tiny layers (width 32; 219 parameter tensors), whose decoder
  slices its ``ModuleList`` in every forward (issue 28: the plan must not be rebuilt for it);
- ``switch``: a ``transformers`` Switch-Transformers MoE (8 experts; its router reassigns ``self.classifier``
  every forward); ``mixtral``: a ``transformers`` Mixtral MoE (4 experts, top-2); ``switch_sparse``: a
  Switch-Transformers MoE with 32 wider experts (d_ff 1024, 8.8M parameters), of which 16-32 expert matrices
  get no token and so no gradient on a step;
- ``many``: the sweep's model at the first size of ``--tensors`` only (``--tensors 100``: 100 parameter
  tensors, a launch-bound ~2 ms step), in the ordinary table;
- ``gpt``: with CUDA, a ~134M-parameter GPT-like model in bf16.

``--json PATH`` also writes every run's per-step time, so that ``benchmarks/side_by_side.py`` can
compare two checkouts round by round.

    python benchmarks/overhead.py                 # CPU MLP, 5 rounds
    python benchmarks/overhead.py --rounds 7 --steps 300 --only plain,anomaly_warn
    python benchmarks/overhead.py --model sweep --tensors 10,100,1000,2000,5000 --steps 220 --warmup 20

Results are printed as Markdown tables (paste into docs/performance.md with the machine).
"""

from __future__ import annotations

import argparse
import itertools
import math
import operator
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
                             PerformanceProfilerCallback, debug_callbacks)


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
        self.ended = False
        # The step's tail, main-thread CPU time from the gradients being final to the batch's end: the
        # checks of on_before_optimizer_step and the optimizer's update (this clock's hooks run first).
        self.tail_seconds = 0.0
        self._tail_started: float | None = None

    @property
    def in_tail(self) -> bool:
        return self._tail_started is not None

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.cpu and not self.ended:
            self._tail_started = time.thread_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._tail_started is not None:
            self.tail_seconds += time.thread_time() - self._tail_started
            self._tail_started = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.warmup:
            if not self.wall and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter())
            self.cpu.append(time.thread_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ended = True
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.wall.append(time.perf_counter())
            self.seconds_per_step = (self.wall[-1] - self.wall[0]) / (len(self.wall) - 1)
            self.wall_seconds_per_step = self.seconds_per_step
        else:
            self.seconds_per_step = per_step_median(self.cpu)
            self.wall_seconds_per_step = per_step_median(self.wall)


class ReadGradients(pl.Callback):
    """Reads every parameter's ``.grad`` before each optimizer step and nothing more: the floor of any
    check over all gradients. Most of it moves rather than adds: the first access to a gradient
    the backward just produced creates its Python object, which the optimizer then finds ready."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.parameters = list(pl_module.parameters())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.present = sum(p.grad is not None for p in self.parameters)  # keeps no gradient alive


class MinimalNanCheck(pl.Callback):
    """The least a per-step NaN/Inf check of the loss and every gradient can do here: one fused pass
    (:class:`~lightning_debug.checks.numerics.NormPlan`) and one read on the host, in the hook where the
    gradients are final; no names, no history, no logging. The floor under the anomaly check's cost."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_debug.checks.numerics import NormPlan

        self.parameters = [p for p in pl_module.parameters() if p.requires_grad]
        self.plan = NormPlan(self.parameters)
        self.zeros = [torch.zeros_like(p) for p in self.parameters]  # for a parameter the step left without gradient
        self.loss: torch.Tensor | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.loss = loss.detach()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in self.parameters]
        if any(map(operator.is_, grads, itertools.repeat(None))):
            grads = [zero if g is None else g for g, zero in zip(grads, self.zeros)]
        squares = self.plan.squares(grads)
        self.finite = math.isfinite(float(squares.sum() + self.loss))


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


class LaunchBound(pl.LightningModule):
    """Eight small layers at batch 8: every step is the per-operation overhead of ~50 tiny kernels."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class ManyTensors(pl.LightningModule):
    """N parameter tensors of 16 elements whose sums enter an MSE loss with a ``Linear(8, 1)``: a
    deliberately cheap forward, so the cost that grows with the number of tensors shows."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.tensors = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.01) for _ in range(tensors))
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        offset = torch.stack([tensor.sum() for tensor in self.tensors]).mean()
        return nn.functional.mse_loss(self.head(x).squeeze(-1) + offset, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TransformersGPT2(pl.LightningModule):
    """``transformers.GPT2LMHeadModel`` from a config (random weights, nothing downloaded)."""

    def __init__(self, vocab: int = 2048, length: int = 64) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=length, n_embd=128, n_layer=12,
                                                n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TransformersLM(pl.LightningModule):
    """A ``transformers`` model from a tiny config, trained as its docs show (``model(**batch).loss``)."""

    def __init__(self, kind: str, vocab: int = 256) -> None:
        super().__init__()
        self.kind = kind
        if kind == "llama24":
            from transformers import LlamaConfig, LlamaForCausalLM

            self.model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=24, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64))
        elif kind == "mixtral":
            from transformers import MixtralConfig, MixtralForCausalLM

            self.model = MixtralForCausalLM(MixtralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, num_local_experts=4,
                                                          num_experts_per_tok=2, max_position_embeddings=64))
        else:
            from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

            sparse = kind == "switch_sparse"
            self.model = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
                vocab_size=vocab, d_model=64 if sparse else 32, d_ff=1024 if sparse else 64, d_kv=16 if sparse else 8,
                num_heads=4, num_layers=2, num_decoder_layers=2, num_experts=32 if sparse else 8, expert_capacity=64,
                num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

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

    quiet = DebugConfig(save_debug_info=False, print_summary=False, save_plots=False)
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
        "anomaly_defaults": lambda: {"callbacks": [AnomalyDetectionCallback(quiet)]},
        "gradients_defaults": lambda: {"callbacks": [GradientHealthCallback(quiet)]},
        "activations_defaults": lambda: {"callbacks": [GradientHealthCallback(quiet, log_activations=True)]},
        "gradients_every_step": lambda: {"callbacks": [GradientHealthCallback(every_step())]},
        "activations_every_step": lambda: {"callbacks": [GradientHealthCallback(every_step(log_activations=True))]},
        "per_parameter": lambda: {"callbacks": [GradientHealthCallback(every_step(log_gradients=True,
                                                                                  log_weights=True))]},
        "all_four_non_check_steps": lambda: {"callbacks": [cls(DebugConfig(
            anomaly_check_frequency=10**9, gradient_checking_frequency=10**9, memory_profiling_frequency=10**9,
            performance_profiling_frequency=10**9, save_debug_info=False, print_summary=False, save_plots=False))
            for cls in (AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback,
                        PerformanceProfilerCallback)]},
        "plugin_defaults": lambda: {"callbacks": debug_callbacks(DebugConfig(print_summary=False))},
        "anchor_detect_anomaly": lambda: {"detect_anomaly": True},
        "anchor_grad_norm_recipe": lambda: {"callbacks": [GradNormRecipe()]},
        "anchor_read_gradients": lambda: {"callbacks": [ReadGradients()]},
        "anchor_minimal_nan_check": lambda: {"callbacks": [MinimalNanCheck()]},
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
    """Main-thread CPU time spent inside lightning-debug's hooks during the clock's timed steps,
    measured within the run itself."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.seconds = 0.0
        self.seconds_in_tail = 0.0

    def wrap(self, callbacks: list[pl.Callback]) -> None:
        for callback in callbacks:
            if not (type(callback).__module__.startswith("lightning_debug") or isinstance(callback, ReadGradients)):
                continue
            for name in dir(type(callback)):
                if name.startswith("on_") or name in ("setup", "teardown", "state_dict"):
                    setattr(callback, name, self._timed(getattr(callback, name)))

    def _timed(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.clock.cpu or self.clock.ended:
                return hook(*args, **kwargs)
            started = time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                self.seconds += spent
                if self.clock.in_tail:
                    self.seconds_in_tail += spent
        return timed


HOOK_TIMES: dict[str, list[tuple[float, float]]] = {}


def make_model(model_name: str, steps: int, tensors: int) -> tuple[pl.LightningModule, DataLoader, dict[str, Any]]:
    """The model, its loader and the trainer's accelerator options."""
    cpu: dict[str, Any] = {"accelerator": "cpu"}
    if model_name == "gpt":
        loader = DataLoader(TokenData(32000, 512, 8 * (steps + 1)), batch_size=8, num_workers=2, pin_memory=True)
        return GPT(), loader, {"accelerator": "gpu", "precision": "bf16-mixed"}
    if model_name in ("llama24", "switch", "mixtral", "switch_sparse"):
        return TransformersLM(model_name), DataLoader(TokenData(256, 31, 4 * (steps + 1)), batch_size=4), cpu
    if model_name == "gpt2":
        return TransformersGPT2(), DataLoader(TokenData(2048, 63, 4 * (steps + 1)), batch_size=4), cpu
    if model_name in ("sweep", "many"):
        data = TensorDataset(torch.randn(8 * (steps + 1), 8), torch.randn(8 * (steps + 1)))
        return ManyTensors(tensors), DataLoader(data, batch_size=8), cpu
    if model_name == "tiny":
        data = TensorDataset(torch.randn(8 * (steps + 1), 32), torch.randn(8 * (steps + 1), 1))
        return LaunchBound(), DataLoader(data, batch_size=8), cpu
    data = TensorDataset(torch.randn(64 * (steps + 1), 64), torch.randn(64 * (steps + 1), 1))
    return MLP(), DataLoader(data, batch_size=64), cpu


def run_once(model_name: str, name: str, steps: int, warmup: int, tensors: int = 0) -> float:
    if name in ACCELERATE_CONFIGURATIONS:
        return run_accelerate_once(name, steps, warmup)
    torch.manual_seed(0)
    model, loader, extra = make_model(model_name, steps, tensors)
    options = configurations()[name]()
    clock = StepClock(warmup)
    hooks = HookTimer(clock)
    hooks.wrap(options.get("callbacks", []))
    from lightning.pytorch.loggers import CSVLogger

    trainer = pl.Trainer(max_steps=steps, devices=1, logger=CSVLogger(os.environ.get("BENCH_DIR", "/tmp/ld-bench")),
                         log_every_n_steps=LOG_EVERY[0], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[clock, *options.pop("callbacks", [])], **options,
                         **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    total_cpu = clock.cpu[-1] - clock.cpu[0] if len(clock.cpu) > 1 else float("nan")
    if hooks.seconds:
        HOOK_TIMES.setdefault(name, []).append((hooks.seconds / len(clock.cpu), total_cpu / max(len(clock.cpu) - 1, 1)))
    MEAN_TIMES.setdefault((name, tensors), []).append(total_cpu / max(len(clock.cpu) - 1, 1))
    # hooks outside the tail + the whole tail: what the checks cost where each part lands, optimizer included
    TAIL_TIMES.setdefault((name, tensors), []).append(
        (hooks.seconds - hooks.seconds_in_tail + clock.tail_seconds) / max(len(clock.cpu) - 1, 1))
    return clock.seconds_per_step


LOG_EVERY = [1]
MEAN_TIMES: dict[tuple[str, int], list[float]] = {}
TAIL_TIMES: dict[tuple[str, int], list[float]] = {}
SWEEP_CONFIGURATIONS = ("plain", "all_four_defaults", "all_four", "per_parameter", "anchor_read_gradients")


def sweep(args: argparse.Namespace) -> None:
    """The many-tensor sweep: each size's configurations interleaved, then the slope fit.

    Reported per step: the mean main-thread CPU time over the timed window (it holds whole check
    periods at the default frequencies when ``--steps - --warmup`` is a multiple of 100, so rare
    checks count at their real rate), and the time spent inside lightning-debug's hooks.
    """
    sizes = [int(n) for n in args.tensors.split(",")]
    names = [n for n in SWEEP_CONFIGURATIONS if not args.only or n in args.only.split(",") or n == "plain"]
    HOOK_TIMES.clear()
    hooks: dict[tuple[str, int], list[float]] = {}
    for size in sizes:
        for round_index in range(args.rounds):
            for name in names:
                run_once("sweep", name, args.steps, args.warmup, size)
                if name in HOOK_TIMES:
                    hooks.setdefault((name, size), []).append(HOOK_TIMES.pop(name)[-1][0])
            print(f"{size} tensors: round {round_index + 1}/{args.rounds} done", flush=True)
    print(f"\nMany-tensor sweep; device: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}; lightning {pl.__version__}; {args.rounds} interleaved rounds of {args.steps} "
          f"steps ({args.warmup} warm-up); mean main-thread CPU ms/step over the window, median over rounds\n")
    print("| tensors | " + " | ".join(names) + " | " + " | ".join(f"{n} hooks ms" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    overhead: dict[tuple[str, int], float] = {}
    for size in sizes:
        plains = MEAN_TIMES[("plain", size)]
        plain = statistics.median(plains)
        cells = [f"{plain * 1e3:.2f}"]
        for name in names[1:]:
            value = statistics.median(MEAN_TIMES[(name, size)])
            # each round's run against the plain run just before it: drift between rounds cancels
            overhead[(name, size)] = statistics.median(
                run - base for run, base in zip(MEAN_TIMES[(name, size)], plains))
            cells.append(f"{value * 1e3:.2f} ({value / plain:.2f}x)")
        cells += [f"{statistics.median(hooks[(name, size)]) * 1e3:.2f}" for name in names[1:]]
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    print("\nThe checks where their cost lands: time inside the hooks outside the step's tail, plus the tail "
          "(on_before_optimizer_step to the batch's end: the checks there and the optimizer's update), ms/step:\n")
    print("| tensors | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for size in sizes:
        print(f"| {size:,} | " + " | ".join(f"{statistics.median(TAIL_TIMES[(name, size)]) * 1e3:.3f}"
                                          for name in names) + " |")
    print("\nOverhead of each round against its plain run, ms/step:\n")
    for size in sizes:
        for name in names[1:]:
            rounds = [run - base for run, base in zip(MEAN_TIMES[(name, size)], MEAN_TIMES[("plain", size)])]
            print(f"- {size:,} tensors, {name}: " + ", ".join(f"{value * 1e3:.2f}" for value in rounds))
    if 100 in sizes and 1000 in sizes:
        print("\nSlope, the cost added per parameter tensor: (overhead at 1,000 tensors - at 100) / 900; the overhead "
              "from step times is the median over rounds of each run minus the plain run of its round\n")
        print("| configuration | from step times, us/tensor | from time in the hooks, us/tensor | from the hooks and "
              "the optimizer's update, us/tensor |")
        print("|---|---|---|---|")

        def tail_overhead(name: str, size: int) -> float:
            return statistics.median(TAIL_TIMES[(name, size)]) - statistics.median(TAIL_TIMES[("plain", size)])

        for name in names[1:]:
            wall = (overhead[(name, 1000)] - overhead[(name, 100)]) / 900 * 1e6
            inside = (statistics.median(hooks[(name, 1000)]) - statistics.median(hooks[(name, 100)])) / 900 * 1e6
            landed = (tail_overhead(name, 1000) - tail_overhead(name, 100)) / 900 * 1e6
            print(f"| {name} | {wall:.2f} | {inside:.2f} | {landed:.2f} |")
        if "anchor_read_gradients" in names:
            def hook_slope(name: str) -> float:
                return (statistics.median(hooks[(name, 1000)]) - statistics.median(hooks[(name, 100)])) / 900 * 1e6

            print("\nIn the hooks, beyond reading every gradient (anchor_read_gradients, whose cost moves from the "
                  "optimizer rather than adds): " + ", ".join(
                      f"{name} {hook_slope(name) - hook_slope('anchor_read_gradients'):.2f} us/tensor"
                      for name in names[1:] if name != "anchor_read_gradients"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["mlp", "tiny", "gpt2", "llama24", "switch", "mixtral", "switch_sparse",
                                            "many", "sweep", "gpt"],
                        default="gpt" if torch.cuda.is_available() else "mlp")
    parser.add_argument("--tensors", default="10,100,1000,2000,5000", help="sweep: numbers of parameter tensors")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1: stabler)")
    parser.add_argument("--prime", action="store_true",
                        help="one untimed plain run first (the process's first run on a GPU pays for its start-up)")
    parser.add_argument("--json", default="", help="also write every run's seconds per step here (JSON)")
    parser.add_argument("--log-every", type=int, default=1,
                        help="the Trainer's log_every_n_steps (default 1: a logging row on every step, the plugin's "
                             "scalars with it; Lightning's own default is 50)")
    args = parser.parse_args()
    LOG_EVERY[0] = args.log_every
    if args.model != "gpt":
        torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.model == "sweep":
        sweep(args)
        return
    every_name = [*configurations(), *(ACCELERATE_CONFIGURATIONS if args.model == "mlp" else {})]
    names = [n for n in every_name if not args.only or n in args.only.split(",")]
    if "plain" not in names:
        names.insert(0, "plain")
    if any(n.startswith("accelerate") for n in names) and "accelerate_plain" not in names:
        names.insert(1, "accelerate_plain")
    times: dict[str, list[float]] = {name: [] for name in names}
    if args.prime:
        run_once(args.model, "plain", min(args.steps, args.warmup + 10), args.warmup)
        for kept in (MEAN_TIMES, TAIL_TIMES, HOOK_TIMES):
            kept.clear()
    for round_index in range(args.rounds):
        for name in names:
            times[name].append(run_once(args.model, name, args.steps, args.warmup,
                                        int(args.tensors.split(",")[0]) if args.model == "many" else 0))
            print(f"round {round_index + 1} {name}: {times[name][-1] * 1e3:.3f} ms/step", flush=True)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    if args.json:
        import json

        with open(args.json, "w") as handle:
            means = {name: MEAN_TIMES.get((name, int(args.tensors.split(",")[0]) if args.model == "many" else 0), [])
                     for name in names}
            json.dump({"model": args.model, "steps": args.steps, "seconds_per_step": times,
                       "mean_seconds_per_step": means}, handle)
    device = torch.cuda.get_device_name() if args.model == "gpt" else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\nModel: {args.model}; device: {device}; torch {torch.__version__}; lightning {pl.__version__}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps ({args.warmup} warm-up); "
          f"{'median step of each run, ' if args.model != 'gpt' else ''}median over runs\n")
    unit = " (main-thread CPU time)" if args.model != "gpt" else ""
    print(f"| configuration | median ms/step{unit} | ratio to its plain loop | spread (min-max ms) |")
    print("|---|---|---|---|")
    for name in names:
        median = statistics.median(times[name])
        baseline = statistics.median(times["accelerate_plain" if name.startswith("accelerate") else "plain"])
        print(f"| {name} | {median * 1e3:.2f} | {median / baseline:.3f}x | "
              f"{min(times[name]) * 1e3:.2f}-{max(times[name]) * 1e3:.2f} |")
    if HOOK_TIMES and args.model != "gpt":
        print("\nWithin-run cost of lightning-debug's hooks (main-thread CPU time; immune to drift between runs):\n")
        print("| configuration | hooks ms/step | rest of the step ms | overhead |")
        print("|---|---|---|---|")
        for name, samples in HOOK_TIMES.items():
            hook_ms = statistics.median(h for h, _ in samples) * 1e3
            step_ms = statistics.median(t for _, t in samples) * 1e3
            print(f"| {name} | {hook_ms:.3f} | {step_ms - hook_ms:.2f} | {step_ms / (step_ms - hook_ms):.3f}x |")


if __name__ == "__main__":
    main()
