"""Where lightning-debug's cost goes on a GPU step: the question ``overhead.py``'s ratios leave open.

``overhead.py --model gpt`` on an H200 (docs/performance.md, "GPU") measured the plugin's defaults at a median 1.14x
the plain step, with the plain step itself moving from 25 to 35 ms from run to run. Each configuration here trains
the same GPT-134M in bf16 (``overhead.GPT``) once and reports, from inside the run:

- the per-step wall time (median and mean of the steps after ``--warmup``) and the main thread's CPU time per step;
- the wall time inside lightning-debug's hooks, per hook (which check costs the time);
- every host-device synchronization after ``--warmup``: the implicit ones through
  ``torch.cuda.set_sync_debug_mode("warn")`` (``.item()``, ``.tolist()``, ``nonzero``...), each with the innermost
  lightning-debug line that caused it, and the explicit waits that really waited (an ``Event.synchronize()`` on an
  event not yet complete, ``torch.cuda.synchronize()``);
- CUDA memory allocated at the first and last timed step (does anything the plugin keeps grow?).

Nothing is held between configurations (each run's trainer and model are dropped before the next). Without CUDA it
runs a small GPT on the CPU, which only checks that the script works.

    python benchmarks/gpu_probe.py                                  # plain, plugin_defaults, all_four
    python benchmarks/gpu_probe.py --only plugin_defaults --steps 200
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

CUDA = torch.cuda.is_available()
PACKAGE = "lightning_debug"


def allocated() -> int:
    return torch.cuda.memory_allocated() if CUDA else 0


def own_line(stack: list[traceback.FrameSummary]) -> str:
    """The innermost lightning-debug frame of ``stack`` as ``path:line (function)``, else the innermost frame."""
    mine = [frame for frame in stack if PACKAGE in frame.filename] or stack[-1:]
    frame = mine[-1]
    return f"{frame.filename.split(PACKAGE)[-1].lstrip('/') or frame.filename}:{frame.lineno} ({frame.name})"


class Probe(pl.Callback):
    """Step times, hook times, syncs and allocated memory of one run, from ``warmup`` on."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.step = -1
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self.hooks: dict[str, float] = collections.defaultdict(float)
        self.syncs: collections.Counter[str] = collections.Counter()
        self.sync_steps: set[int] = set()
        self.memory: list[tuple[int, int]] = []
        self._last: tuple[float, float] | None = None

    @property
    def timing(self) -> bool:
        return self.step >= self.warmup

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.global_step
        now = (time.perf_counter(), time.thread_time())
        if self._last is not None and self.step > self.warmup:
            self.walls.append(now[0] - self._last[0])
            self.cpus.append(now[1] - self._last[1])
        self._last = now
        if self.step == self.warmup:
            self.memory.append((self.step, allocated()))
            if CUDA:
                torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.memory.append((trainer.global_step, allocated()))
        if CUDA:
            torch.cuda.set_sync_debug_mode(0)

    def timed(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def timed_hook(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return hook(*args, **kwargs)
            started = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.hooks[name] += time.perf_counter() - started
        return timed_hook

    def synced(self, what: str) -> None:
        if self.timing:
            self.syncs[f"{what} at {own_line(traceback.extract_stack()[:-2])}"] += 1
            self.sync_steps.add(self.step)


@contextmanager
def watching(probe: Probe) -> Iterator[None]:
    """Count implicit syncs (warnings of the sync debug mode) and explicit waits that waited."""
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            probe.synced("implicit sync")

    real_event_sync, real_sync = torch.cuda.Event.synchronize, torch.cuda.synchronize

    def event_synchronize(event: torch.cuda.Event) -> None:
        if not event.query():
            probe.synced("Event.synchronize() that waited")
        real_event_sync(event)

    def synchronize(*args: Any, **kwargs: Any) -> None:
        probe.synced("torch.cuda.synchronize()")
        real_sync(*args, **kwargs)

    torch.cuda.Event.synchronize, torch.cuda.synchronize = event_synchronize, synchronize  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():  # puts the filters and showwarning back on exit
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield
    finally:
        torch.cuda.Event.synchronize, torch.cuda.synchronize = real_event_sync, real_sync  # type: ignore[method-assign]


def probe_run(name: str, steps: int, warmup: int) -> Probe:
    torch.manual_seed(0)
    model, loader, extra = overhead.make_model("gpt", steps, 0)
    if not CUDA:
        model, extra = overhead.GPT(width=64, depth=2, heads=4), {"accelerator": "cpu"}
    options = overhead.configurations()[name]()
    callbacks = options.pop("callbacks", [])
    probe = Probe(warmup)
    for callback in callbacks:
        if type(callback).__module__.startswith(PACKAGE):
            for hook in dir(type(callback)):
                if hook.startswith("on_"):
                    setattr(callback, hook, probe.timed(f"{type(callback).__name__}.{hook}", getattr(callback, hook)))
    trainer = pl.Trainer(max_steps=steps, devices=1, logger=False, default_root_dir=os.environ["BENCH_DIR"],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[probe, *callbacks], **options, **extra)
    with watching(probe):
        trainer.fit(model, loader)
    del trainer, model, loader, callbacks
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return probe


def report(name: str, probe: Probe) -> None:
    timed = max(len(probe.walls), 1)
    (first_step, first), (last_step, last) = probe.memory[0], probe.memory[-1]
    print(f"\n## {name}\n")
    print(f"- step wall time: median {statistics.median(probe.walls) * 1e3:.2f} ms, mean "
          f"{statistics.mean(probe.walls) * 1e3:.2f} ms; main-thread CPU {statistics.median(probe.cpus) * 1e3:.2f} ms "
          f"({len(probe.walls)} steps)")
    print(f"- CUDA allocated: {first / 2**20:.1f} MB at step {first_step}, {last / 2**20:.1f} MB at step {last_step}")
    hooks = sorted(probe.hooks.items(), key=lambda item: -item[1])
    print(f"- time in the hooks: {sum(probe.hooks.values()) / timed * 1e3:.3f} ms/step; "
          + ", ".join(f"{hook} {seconds / timed * 1e3:.3f}" for hook, seconds in hooks[:6]))
    print(f"- syncs: {sum(probe.syncs.values())} on {len(probe.sync_steps)} steps")
    for site, count in probe.syncs.most_common(10):
        print(f"  - {count} x {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="plain,plugin_defaults,all_four", help="overhead.py configuration names")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    device = torch.cuda.get_device_name() if CUDA else "CPU (a small GPT: checks the script only)"
    print(f"# gpu_probe: {device}, torch {torch.__version__}, lightning {pl.__version__}, "
          f"{args.steps} steps ({args.warmup} warm-up)")
    for name in args.only.split(","):
        report(name, probe_run(name, args.steps, args.warmup))


if __name__ == "__main__":
    os.environ.setdefault("BENCH_DIR", "/tmp/ld-probe")
    main()
