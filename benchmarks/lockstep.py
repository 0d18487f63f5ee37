"""Plain Lightning and lightning-debug in lock step: one process, one thread per configuration, turns of a few steps.

On a shared machine (a VM whose neighbours come and go) the speed of a whole process moves by 10-40% from one
process to the next and within seconds, which buries a 2% overhead in ``overhead.py``'s run-by-run figures. Here
every configuration trains its own copy of the same model (the same weights) in its own thread, and a turnstile
lets one thread train ``--turn`` steps at a time, every thread once per cycle in a fresh random order, so that
configurations that are compared ran within a fraction of a second of each other all through the run, and a slow
spell of the machine hits them alike. Each step is timed with its own thread's CPU time (``time.thread_time``),
which excludes the waits for the turn; the first step of each turn, which finds the caches full of the other
threads' data, is left out. A run with lightning-debug waits for its turn inside the plugin's own time
(``session.own_time``), which its step timing leaves out, so the other threads' turns are not reported as slow
steps. ``plain#2``, a second plain copy, shows the method's own spread.

``--baseline REV`` adds lightning-debug as of git revision ``REV``, imported beside the working copy under another
name, so a change is measured against what it replaces in the same process: ``baseline:all_four`` is ``all_four``
with that revision's callbacks, and the summary adds each such pair's per-cycle ratio (the change alone, with its
95% interval), of the step time and of the thread CPU time spent in the debug callbacks' batch hooks, a figure
that the machine's swings move far less than whole steps (it leaves out the slowdown of the user's own code).

The ratio reported for a configuration is its mean step time over the plain run's, per cycle, median over cycles
(with quartiles and a 95% bootstrap interval of the median: a target is met only when the whole interval is under
it), and the ratio of its mean over all its timed steps to plain's (rare checks count at their
rate). Threads only take turns: at any moment one trains.

    OMP_NUM_THREADS=1 python benchmarks/lockstep.py --model switch --steps 1000 --only plain#2,plugin_defaults,all_four
    python benchmarks/lockstep.py --model llama24 --log-every 50 --json /tmp/llama.json
    python benchmarks/lockstep.py --model mixtral --baseline HEAD --only baseline:plugin_defaults,plugin_defaults
    python benchmarks/lockstep.py --model mlp --only plain#2,plain#3,plugin_defaults,plugin_defaults#2,plugin_defaults#3

Copies of one configuration (``NAME#2``, ``NAME#3``) are also pooled: on a bandwidth-bound model (the MLP) one copy
can run a few percent, once 12%, slower than its siblings for the whole run, with the same time in the hooks. The
pooled ratio dilutes that; the rows of the copies show how far apart they are.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the models and configurations of the other benchmarks)
from lightning_debug.callbacks.base import RUN_ATTRIBUTE  # noqa: E402


class Turnstile:
    """Whose turn it is: each cycle gives every running thread one turn of ``turn`` steps, in a fresh random
    order (a thread's place in the cycle, right after a heavier or a lighter one, must not bias its figures); a
    finished thread leaves the circle."""

    def __init__(self, names: list[str], turn: int, seed: int = 0) -> None:
        self.names = list(names)
        self.turn = turn
        self.random = random.Random(seed)
        self.finished: set[str] = set()
        self.cycle = self._shuffled()
        self.position = 0
        self.condition = threading.Condition()

    def _shuffled(self) -> list[str]:
        running = [name for name in self.names if name not in self.finished]
        self.random.shuffle(running)
        return running

    def wait(self, name: str) -> None:
        with self.condition:
            self.condition.wait_for(lambda: not self.cycle or self.cycle[self.position] == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.condition:
            if finished:
                self.finished.add(name)
            if self.cycle and self.cycle[self.position] == name:
                self.position += 1
            while self.position < len(self.cycle) and self.cycle[self.position] in self.finished:
                self.position += 1
            if self.position >= len(self.cycle):
                self.cycle, self.position = self._shuffled(), 0
            self.condition.notify_all()


class LockstepClock(pl.Callback):
    """Takes its thread's turns and times each step in thread CPU time (first in the callback list)."""

    def __init__(self, name: str, turnstile: Turnstile, warmup: int) -> None:
        self.name = name
        self.turnstile = turnstile
        self.warmup = warmup
        self.steps_in_turn = 0
        self.started_at: float | None = None
        self.first_of_turn = True
        # (turn index, seconds) of each timed step
        self.samples: list[tuple[int, float]] = []
        self.turns = 0
        # thread CPU seconds spent in the debug callbacks' batch hooks: in all, and at the start of the step timed
        self.plugin_seconds = 0.0
        self._plugin_at_start = 0.0
        # (turn index, seconds) of the plugin's hooks in each timed step
        self.plugin_samples: list[tuple[int, float]] = []

    def time_hooks(self, callbacks: list[pl.Callback]) -> None:
        """Count the thread CPU time of ``callbacks``' batch hooks (their own work in each step, without the
        user's code it slows down through the caches), so that a change to the plugin is measured on what it
        changes."""
        for callback in callbacks:
            for hook in HOOKS:
                method = getattr(callback, hook, None)
                if callable(method):
                    setattr(callback, hook, self._timed(method))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.plugin_seconds += time.thread_time() - started
        return timed

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.thread_time()
        if self.started_at is not None:
            if trainer.global_step > self.warmup and not self.first_of_turn:
                self.samples.append((self.turns, now - self.started_at))
                self.plugin_samples.append((self.turns, self.plugin_seconds - self._plugin_at_start))
            self.first_of_turn = False
        if self.steps_in_turn == 0 or self.steps_in_turn >= self.turnstile.turn:
            if self.started_at is not None:
                self.turnstile.pass_on(self.name)
                self.turns += 1
            self.wait(trainer)
            self.steps_in_turn = 0
            self.first_of_turn = True
        self.steps_in_turn += 1
        self.started_at = time.thread_time()
        self._plugin_at_start = self.plugin_seconds

    def wait(self, trainer: pl.Trainer) -> None:
        """Wait for the turn as the plugin's own time, which its step timing leaves out: the other threads' turns
        are not this run's steps, and would otherwise show up as a slow step every turn."""
        run = getattr(trainer, RUN_ATTRIBUTE, None)
        own_time = getattr(getattr(run, "session", None), "own_time", None)
        if own_time is None:
            self.turnstile.wait(self.name)
            return
        with own_time:
            self.turnstile.wait(self.name)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.started_at is not None and not self.first_of_turn:
            self.samples.append((self.turns, time.thread_time() - self.started_at))
            self.plugin_samples.append((self.turns, self.plugin_seconds - self._plugin_at_start))
        self.started_at = None

    def leave(self) -> None:
        self.turnstile.pass_on(self.name, finished=True)


BASELINE = "lightning_debug_baseline"
HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
PLUGIN_NAMES = ("AnomalyDetectionCallback", "DebugConfig", "GradientHealthCallback", "MemoryProfilerCallback",
                "PerformanceProfilerCallback", "debug_callbacks")


def load_baseline(revision: str, root: Path) -> ModuleType:
    """The package as of git ``revision``, imported as :data:`BASELINE` (its own imports renamed to match)."""
    repository = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repository), "archive", revision, "lightning_debug"], check=True,
                             capture_output=True).stdout
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    package = root / BASELINE
    (root / "lightning_debug").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\blightning_debug\b", BASELINE, path.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module(BASELINE)


def options_of(name: str, baseline: ModuleType | None) -> dict[str, Any]:
    """The Trainer options of configuration ``name``; ``baseline:name`` builds it with the baseline's callbacks (the
    configurations find the callbacks among ``overhead``'s globals when they are built, in the main thread)."""
    name = name.split("#")[0]
    if not name.startswith("baseline:"):
        return overhead.configurations()[name]()
    if baseline is None:
        raise SystemExit(f"{name}: give --baseline REV")
    saved = {attribute: getattr(overhead, attribute) for attribute in PLUGIN_NAMES}
    try:
        for attribute in PLUGIN_NAMES:
            setattr(overhead, attribute, getattr(baseline, attribute))
        return overhead.configurations()[name.removeprefix("baseline:")]()
    finally:
        for attribute, value in saved.items():
            setattr(overhead, attribute, value)


def prepare(name: str, model_name: str, steps: int, tensors: int, clock: LockstepClock, log_every: int,
            root: str, baseline: ModuleType | None = None) -> tuple[pl.Trainer, pl.LightningModule, Any]:
    """The trainer, model and loader of one configuration, built in the main thread one after the other, so every
    copy starts from the same weights (the threads share torch's global generator)."""
    torch.manual_seed(0)
    model, loader, extra = overhead.make_model(model_name, steps, tensors)
    options = options_of(name, baseline)
    clock.time_hooks(options.get("callbacks", []))
    trainer = pl.Trainer(max_steps=steps, devices=1, logger=pl.loggers.CSVLogger(root, name=name),
                         log_every_n_steps=log_every, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         callbacks=[clock, *options.pop("callbacks", [])], **options, **extra)
    return trainer, model, loader


def train(name: str, trainer: pl.Trainer, model: pl.LightningModule, loader: Any, clock: LockstepClock,
          errors: dict[str, BaseException]) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, loader)
    except BaseException as error:  # reported by the main thread
        errors[name] = error
    finally:
        clock.leave()


def per_turn(clock: LockstepClock, plugin: bool = False) -> dict[int, list[float]]:
    turns: dict[int, list[float]] = {}
    for turn, seconds in clock.plugin_samples if plugin else clock.samples:
        turns.setdefault(turn, []).append(seconds)
    return turns


def median_interval(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (cycles resampled with replacement, fixed seed): how
    far the reported median could move on another run of the same machine, so that a target is called met
    only when the whole interval is under it."""
    if len(values) < 2:
        return float("nan"), float("nan")
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def paired(clocks: dict[str, LockstepClock], name: str, against: str, plugin: bool = False) -> dict[str, float]:
    """``name``'s mean step (``plugin``: its hooks' time) over ``against``'s, per cycle: median and its 95%
    interval (a change against the revision it replaces, both measured in the same cycles)."""
    mine, theirs = per_turn(clocks[name], plugin), per_turn(clocks[against], plugin)
    ratios = [statistics.fmean(mine[t]) / statistics.fmean(theirs[t]) for t in mine
              if t in theirs and statistics.fmean(theirs[t]) > 0]
    low, high = median_interval(ratios)
    return {"ratio": statistics.median(ratios) if ratios else float("nan"), "low": low, "high": high}


def pooled(clocks: dict[str, LockstepClock]) -> dict[str, dict[str, float]]:
    """Per configuration run in several copies (``NAME``, ``NAME#2``, ...): the mean step over all its copies,
    over the mean over all copies of plain, per cycle (median and its 95% interval). On a bandwidth-bound model
    two copies of the same code can differ by a few percent, once 12%, for the whole run; pooling dilutes that."""
    groups: dict[str, list[str]] = {}
    for name in clocks:
        groups.setdefault(name.split("#")[0], []).append(name)

    def turns_of(names: list[str]) -> dict[int, float]:
        merged: dict[int, list[float]] = {}
        for name in names:
            for turn, seconds in per_turn(clocks[name]).items():
                merged.setdefault(turn, []).append(statistics.fmean(seconds))
        return {turn: statistics.fmean(means) for turn, means in merged.items() if len(means) == len(names)}

    plain = turns_of(groups.get("plain", []))
    result = {}
    for base, names in groups.items():
        if len(names) < 2 or base == "plain":
            continue
        mine = turns_of(names)
        ratios = [mine[t] / plain[t] for t in mine if t in plain]
        low, high = median_interval(ratios)
        result[base] = {"copies": len(names), "plain_copies": len(groups.get("plain", [])),
                        "ratio": statistics.median(ratios) if ratios else float("nan"), "low": low, "high": high}
    return result


def summarize(clocks: dict[str, LockstepClock]) -> dict[str, dict[str, float]]:
    """Per configuration: median step (ms), mean step (ms), and the ratios to plain (per turn, median over turns,
    with quartiles and a 95% interval of the median; and of the means)."""
    plain = per_turn(clocks["plain"])
    plain_mean = statistics.fmean(s for _, s in clocks["plain"].samples)
    result = {}
    for name, clock in clocks.items():
        turns = per_turn(clock)
        ratios = [statistics.fmean(turns[t]) / statistics.fmean(plain[t]) for t in turns if t in plain]
        seconds = [s for _, s in clock.samples]
        result[name] = {
            "median_ms": statistics.median(seconds) * 1e3,
            "mean_ms": statistics.fmean(seconds) * 1e3,
            "ratio_per_turn": statistics.median(ratios) if ratios else float("nan"),
            **dict(zip(("ratio_ci_low", "ratio_ci_high"), median_interval(ratios))),
            "ratio_q1": statistics.quantiles(ratios, n=4)[0] if len(ratios) > 1 else float("nan"),
            "ratio_q3": statistics.quantiles(ratios, n=4)[2] if len(ratios) > 1 else float("nan"),
            "ratio_of_means": statistics.fmean(seconds) / plain_mean,
            "plugin_ms": statistics.fmean(s for _, s in clock.plugin_samples) * 1e3 if clock.plugin_samples else 0.0,
            "turns": len(ratios),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="switch",
                        choices=["mlp", "tiny", "gpt2", "llama24", "switch", "mixtral", "switch_sparse", "many"])
    parser.add_argument("--tensors", type=int, default=100, help="model many: its number of parameter tensors")
    parser.add_argument("--only", default="plugin_defaults,all_four",
                        help="configurations beside plain (name#2: a second copy of one, to see the method's own spread)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--turn", type=int, default=11,
                        help="steps per turn (prime to the check frequencies, so checks land on timed steps)")
    parser.add_argument("--log-every", type=int, default=50, help="the Trainer's log_every_n_steps")
    parser.add_argument("--json", default="", help="also write the summary here")
    parser.add_argument("--baseline", default="",
                        help="a git revision: configurations named baseline:NAME run NAME with its lightning-debug")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["plain", *[n for n in args.only.split(",") if n and n != "plain"]]
    turnstile = Turnstile(names, args.turn)
    clocks = {name: LockstepClock(name, turnstile, args.warmup) for name in names}
    errors: dict[str, BaseException] = {}
    with tempfile.TemporaryDirectory() as root:
        baseline = load_baseline(args.baseline, Path(root) / "baseline") if args.baseline else None
        prepared = {name: prepare(name, args.model, args.steps, args.tensors, clocks[name], args.log_every, root,
                                  baseline) for name in names}
        threads = [threading.Thread(target=train, name=name, daemon=True, args=(name, *prepared[name], clocks[name],
                                                                               errors)) for name in names]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    if errors:
        raise SystemExit(f"failed: {errors}")
    summary = summarize(clocks)
    print(f"\nLock step: model {args.model}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"torch {torch.__version__}; lightning {pl.__version__}; {args.steps} steps ({args.warmup} warm-up), turns of "
          f"{args.turn}; log_every_n_steps={args.log_every}; {wall:.0f} s\n")
    print("| configuration | median step ms | mean step ms | ratio per cycle, median (quartiles) | 95% interval of the "
          "median | ratio of means | plugin hooks ms/step |")
    print("|---|---|---|---|---|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['median_ms']:.2f} | {row['mean_ms']:.2f} | {row['ratio_per_turn']:.3f}x "
              f"({row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}) | {row['ratio_ci_low']:.3f}-{row['ratio_ci_high']:.3f} | "
              f"{row['ratio_of_means']:.3f}x | {row['plugin_ms']:.3f} |")
    pools = pooled(clocks)
    if pools:
        print("\nCopies pooled (per cycle, the mean step over a configuration's copies over the mean over plain's; "
              "median, 95% interval):\n")
        for base, pool in pools.items():
            print(f"- {base} ({pool['copies']} copies, plain {pool['plain_copies']}): {pool['ratio']:.3f}x "
                  f"({pool['low']:.3f}-{pool['high']:.3f})")
    changes = {name: {"step": paired(clocks, name, f"baseline:{name}"),
                      "hooks": paired(clocks, name, f"baseline:{name}", plugin=True)}
               for name in names if f"baseline:{name}" in clocks}
    if changes:
        print("\nAgainst the baseline, in the same cycles (per cycle, over the baseline's: the step time, and the time "
              "in the plugin's hooks; median, 95% interval):\n")
        for name, change in changes.items():
            step, hooks = change["step"], change["hooks"]
            print(f"- {name}: step {step['ratio']:.3f}x ({step['low']:.3f}-{step['high']:.3f}), hooks "
                  f"{hooks['ratio']:.3f}x ({hooks['low']:.3f}-{hooks['high']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "args": vars(args), "summary": summary,
                                               "pooled": pools, "against_baseline": changes}))


if __name__ == "__main__":
    main()
