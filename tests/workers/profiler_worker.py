"""Fits with the performance profiler's ``profile_steps`` window beside another profiler, one after the other
(started by tests/integration/test_coexistence.py in a process of its own: a segmentation fault is then a failed
test, not a dead test run).

Each of ``--profilers`` is what the user runs beside the plugin:

- ``simple``, ``advanced``, ``pytorch``: ``Trainer(profiler=<that string>)``, Lightning's own profilers;
- ``outer``: the user's ``with torch.profiler.profile():`` around ``trainer.fit``, whose trace the user exports;
- ``pytorch-unseen``: ``Trainer(profiler="pytorch")`` with neither the trainer's profiler nor torch's "is a
  profiler running" query telling the plugin (as on a torch without the query): the plugin learns it only from its
  own ``start()`` failing, and the profiler that failed must be dropped, never stepped, stopped or exported.

Each fit writes under ``<out>/<profiler>``; its output starts with ``=== <profiler>`` and ends with
``=== <profiler> done {"log_dir": ..., "debug_dir": ...}``.

Usage::

    python tests/workers/profiler_worker.py --profilers simple pytorch --out /tmp/x
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_debug import PerformanceProfilerCallback  # noqa: E402
from lightning_debug.monitors.performance import profiler as windows  # noqa: E402
from lightning_debug.callbacks.context import LightningContext  # noqa: E402
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer  # noqa: E402

PROFILERS = ("simple", "advanced", "pytorch", "outer", "pytorch-unseen")


def fit(profiler: str, out: Path) -> dict[str, str]:
    lightning_profiler = None if profiler == "outer" else profiler.removesuffix("-unseen")
    callback = PerformanceProfilerCallback(performance_profiling_frequency=1, profile_steps=(2, 3))
    trainer = make_trainer(out, [callback], max_steps=8, profiler=lightning_profiler)
    outer: contextlib.AbstractContextManager = contextlib.nullcontext()
    if profiler == "outer":
        from torch.profiler import profile

        outer = profile()
    seen = getattr(windows, "torch_profiler_running", None), getattr(LightningContext, "profiler_in_use", None)
    if profiler.endswith("-unseen"):
        windows.torch_profiler_running = lambda: False  # a torch without the query
        LightningContext.profiler_in_use = lambda self: None  # type: ignore[method-assign]
    try:
        with outer as user_profiler:
            trainer.fit(TinyRegressor())
    finally:
        windows.torch_profiler_running, LightningContext.profiler_in_use = seen  # type: ignore[method-assign]
    if user_profiler is not None:
        user_profiler.export_chrome_trace(str(out / "user.pt.trace.json"))
    return {"log_dir": str(trainer.log_dir), "debug_dir": str(debug_dir(trainer))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profilers", nargs="+", required=True, choices=list(PROFILERS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for profiler in args.profilers:  # one after the other: each fit must leave no profiler behind
        print(f"=== {profiler}", flush=True)
        paths = fit(profiler, args.out / profiler)
        print(f"=== {profiler} done {json.dumps(paths)}", flush=True)


if __name__ == "__main__":
    main()
