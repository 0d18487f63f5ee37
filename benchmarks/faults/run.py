"""Train every case of the fault benchmark and its twin with lightning-debug, and measure what it names.

Each buggy program and its fixed twin is trained with a real ``lightning.Trainer`` (CPU, a few dozen
steps, no logger) once per configuration: each callback alone whose area owns one of the case's
ground-truth kinds, and all four (``debug_callbacks()``), at the defaults and at ``level="ADVANCED"``.
events.jsonl is read back and judged:

- **recall**: a finding of an expected kind, severity warning or above, starting inside the case's step window;
- **cause accuracy**: of the recalled cases whose ground truth names a place (module, parameter,
  operation, sample), the share whose finding names it (its message or details match the case's ``where``);
- **false alarms**: twins with any finding of warning or above.

    PYTHONPATH=. python benchmarks/faults/run.py --json /tmp/faults.json          # everything (~15 min, 2 cores)
    PYTHONPATH=. python benchmarks/faults/run.py --subset                          # one case per class
    PYTHONPATH=. python benchmarks/faults/run.py --only numerical --levels default

Runs go to a pool of 2 processes at ``nice 10``. The markdown table goes to stdout, everything to --json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.faults.cases import SUBSET, Case, all_cases  # noqa: E402
from lightning_debug.config import Area  # noqa: E402
from lightning_debug.core.kinds import KIND_SPECS  # noqa: E402

LEVELS = ("default", "advanced", "every_step")
"""``every_step``: the defaults with ``gradient_checking_frequency=1``, to tell a rule that cannot see a bug
from a schedule that did not look (the gradient checks run every 100 steps by default)."""
SERIOUS = ("warning", "error", "critical")
CALLBACKS = ("anomaly", "gradients", "memory", "performance")
OWNER = {kind.value: ((spec.area.value,) if spec.area.value in CALLBACKS
                      else ("gradients",) if spec.area is Area.ACTIVATIONS else ("anomaly", "gradients"))
         for kind, spec in KIND_SPECS.items()}
"""The callback whose area writes each kind (``KindSpec.area``; activations come with the gradients callback, the
loop and error areas with any callback)."""


JUDGED_FROM = {"update_ratio_high": "advanced"}
"""Kinds a callback judges only from a level on (``update_ratio_high``: with ``log_weights`` or from ADVANCED, the
weights copied before the update; its KindSpec summary says so)."""


def owners(case: Case, level: str | None = None) -> list[str]:
    """The callbacks that, alone, should name ``case`` (at ``level``: on the kinds they judge there)."""
    kinds = [kind for kind in case.kinds if level is None or JUDGED_FROM.get(kind, level) == level]
    return [name for name in CALLBACKS if any(name in OWNER.get(kind, ()) for kind in kinds)]


def configs(case: Case) -> list[str]:
    return [*owners(case), "all"]


# --- one run ------------------------------------------------------------------------------------------
def _init_worker() -> None:
    """Quiet, one torch thread, and the platform's own start method for the programs' data-loader workers (a
    spawned pool worker inherits "spawn", which makes each of them import torch again: 30 s a fit)."""
    import logging
    import warnings

    import torch

    if sys.platform == "linux":
        multiprocessing.set_start_method("fork", force=True)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)


def _callbacks(config: str, level: str) -> list[Any]:
    from lightning_debug import (AnomalyDetectionCallback, DebugConfig, GradientHealthCallback,
                                 MemoryProfilerCallback, PerformanceProfilerCallback, debug_callbacks)

    extra = {"advanced": {"level": "ADVANCED"}, "every_step": {"gradient_checking_frequency": 1}}.get(level, {})
    settings = DebugConfig(print_summary=False, save_plots=False, **extra)
    alone = {"anomaly": AnomalyDetectionCallback, "gradients": GradientHealthCallback,
             "memory": MemoryProfilerCallback, "performance": PerformanceProfilerCallback}
    return debug_callbacks(settings) if config == "all" else [alone[config](settings)]


def _loss_recorder(losses: list[float]) -> Any:
    """A callback keeping each step's training loss (to show the buggy program is broken and its twin is not)."""
    import lightning.pytorch as pl

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                losses.append(float(loss))

    return Losses()


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` from the process's own symbols (no library search, which runs ``ldconfig``), or None."""
    import ctypes

    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def _release_heap() -> None:
    """Hand the C heap the fits before this one freed back to the system (glibc's ``malloc_trim``): DataLoader workers
    forked from a process holding hundreds of MB of free heap read growth of their own unlike a fresh process's
    (``mem-worker-cache`` after ``mem-hooks-per-step`` in one process was missed)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def fit(case: Case, variant: str, config: str, level: str) -> dict[str, Any]:
    """Train ``case``'s buggy program or twin with ``config``'s callbacks; the events it wrote."""
    import gc
    import math

    import lightning.pytorch as pl

    from benchmarks.faults.programs import build

    program = case.buggy if variant == "buggy" else case.twin
    gc.collect()  # the fits before this one in the process: their garbage is not freed during this one's memory trend
    _release_heap()
    started = time.perf_counter()
    error = None
    losses: list[float] = []
    with tempfile.TemporaryDirectory(prefix="fault-") as root:
        pl.seed_everything(program.seed, verbose=False)
        trainer = pl.Trainer(default_root_dir=root, max_steps=program.steps, max_epochs=program.epochs,
                             accelerator="cpu", devices=1,
                             logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, num_sanity_val_steps=0,
                             limit_val_batches=2 if program.val else 0, val_check_interval=10 if program.val else None,
                             gradient_clip_val=clip_of(program), callbacks=[*_callbacks(config, level),
                                                                            _loss_recorder(losses)])
        try:
            trainer.fit(build(program))
        except Exception as raised:  # noqa: BLE001 - the user's own error (a wrong loss raises); findings judged
            error = f"{type(raised).__name__}: {str(raised)[:160]}"
        events = [json.loads(line) for path in Path(root).rglob("events.jsonl")
                  for line in path.read_text().splitlines() if line.strip()]
    finite = [value for value in losses if math.isfinite(value)]
    curve = {"first": losses[0] if losses else None, "last": losses[-1] if losses else None,
             "min": min(finite, default=None), "max": max(finite, default=None),
             "nonfinite_steps": len(losses) - len(finite)}
    return {"case": case.name, "variant": variant, "config": config, "level": level, "events": events,
            "error": error, "loss": curve, "steps_done": trainer.global_step,
            "seconds": round(time.perf_counter() - started, 2)}


def clip_of(program: Any) -> float | None:
    """The program's ``Trainer(gradient_clip_val=...)``: its own where it has one, 1.0 for its twin."""
    return None if program.gradient_clip is None else 1.0 if program.fixed else program.gradient_clip


def judge(case: Case, run: dict[str, Any]) -> dict[str, Any]:
    """Recall, cause and false alarm of one run, and what else it found."""
    serious = [e for e in run.pop("events") if e.get("severity") in SERIOUS and e.get("episode") != "end"]
    found = sorted({f"{e['kind']}@{e.get('step')}" for e in serious})
    row = dict(run, klass=case.klass, found=found)
    if run["variant"] == "twin":
        return dict(row, false_alarm=bool(serious))
    low, high = case.window
    hits = [e for e in serious
            if e["kind"] in case.kinds and e.get("step") is not None and low <= int(e["step"]) <= high]
    cause = None
    if hits and case.where is not None:
        cause = any(re.search(case.where, e.get("message", "") + " " + json.dumps(e.get("details", {}), sort_keys=True))
                    for e in hits)
    first = min(hits, key=lambda e: e["step"]) if hits else None
    return dict(row, recalled=bool(hits), cause=cause, named=f"{first['kind']}@{first['step']}" if first else None,
                message=(first or {}).get("message", "")[:240])


def run_case(case_name: str, variant: str, levels: tuple[str, ...],
             only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every configuration (of ``only`` when given) and level of one case's buggy program or twin (one pool task)."""
    case = {c.name: c for c in all_cases()}[case_name]
    try:
        return [judge(case, fit(case, variant, config, level)) for config in configs(case)
                if not only or config in only for level in levels]
    except Exception as error:  # noqa: BLE001 - recorded, the benchmark goes on
        return [{"case": case.name, "klass": case.klass, "variant": variant, "config": "?", "level": "?",
                 "crash": f"{type(error).__name__}: {error}"}]


# --- the tables ---------------------------------------------------------------------------------------
def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / whole:.0%})" if whole else "-"


def summarise(rows: list[dict[str, Any]], cases: list[Case]) -> dict[str, Any]:
    """Recall, cause accuracy and false alarms per (callback configuration, level) and per (class, level)."""
    good = [r for r in rows if "crash" not in r]

    def score(selected: list[dict[str, Any]]) -> dict[str, Any]:
        buggy = [r for r in selected if r["variant"] == "buggy"]
        twins = [r for r in selected if r["variant"] == "twin"]
        recalled = [r for r in buggy if r["recalled"]]
        placed = [r for r in recalled if r["cause"] is not None]
        return {"buggy": len(buggy), "recalled": len(recalled), "placed": len(placed),
                "cause_right": sum(1 for r in placed if r["cause"]), "twins": len(twins),
                "false_alarms": sum(1 for r in twins if r["false_alarm"])}

    per_config = {f"{config}|{level}": score([r for r in good if r["config"] == config and r["level"] == level])
                  for config in (*CALLBACKS, "all") for level in LEVELS}
    by_name = {c.name: c for c in cases}
    judged = {f"{config}|{level}": score([r for r in good if r["config"] == config and r["level"] == level
                                          and config in owners(by_name[r["case"]], level)])
              for config in CALLBACKS for level in LEVELS}
    per_class = {f"{klass}|{level}": score([r for r in good if r["config"] == "all" and r["level"] == level
                                            and r["klass"] == klass])
                 for klass in dict.fromkeys(c.klass for c in cases) for level in LEVELS}
    per_class_alone = {f"{klass}|{config}|{level}": score([r for r in good if r["config"] == config
                                                          and r["level"] == level and r["klass"] == klass])
                       for klass in dict.fromkeys(c.klass for c in cases) for config in CALLBACKS for level in LEVELS}
    return {"per_config": per_config, "per_config_judged": judged, "per_class": per_class,
            "per_class_alone": per_class_alone}


def markdown(summary: dict[str, Any], rows: list[dict[str, Any]], cases: list[Case]) -> str:
    lines = ["| callbacks | level | recall | cause accuracy | false alarms (twins) |", "|---|---|---|---|---|"]
    for key, s in summary["per_config"].items():
        if s["buggy"] or s["twins"]:
            config, level = key.split("|")
            label = "all four" if config == "all" else f"{config} alone"
            lines.append(f"| {label} | {level} | {_share(s['recalled'], s['buggy'])} | "
                         f"{_share(s['cause_right'], s['placed'])} | {_share(s['false_alarms'], s['twins'])} |")
    lines += ["", "| callback alone, on the kinds it judges at the level | level | recall | cause accuracy |",
              "|---|---|---|---|"]
    for key, s in summary.get("per_config_judged", {}).items():
        if s["buggy"]:
            config, level = key.split("|")
            lines.append(f"| {config} alone | {level} | {_share(s['recalled'], s['buggy'])} | "
                         f"{_share(s['cause_right'], s['placed'])} |")
    lines += ["", "| class (all four) | level | recall | cause accuracy | false alarms (twins) |",
              "|---|---|---|---|---|"]
    for key, s in summary["per_class"].items():
        if s["buggy"]:
            klass, level = key.split("|")
            lines.append(f"| {klass} | {level} | {_share(s['recalled'], s['buggy'])} | "
                         f"{_share(s['cause_right'], s['placed'])} | {_share(s['false_alarms'], s['twins'])} |")
    lines += ["", "| class | callback alone | recall, default | recall, ADVANCED | recall, gradients every step |",
              "|---|---|---|---|---|"]
    for klass in dict.fromkeys(c.klass for c in cases):
        for config in CALLBACKS:
            scores = [summary["per_class_alone"].get(f"{klass}|{config}|{level}", {}) for level in LEVELS]
            if any(s.get("buggy") for s in scores):
                lines.append(f"| {klass} | {config} | " + " | ".join(_share(s.get("recalled", 0), s.get("buggy", 0))
                                                                   for s in scores) + " |")
    lines += ["", "| case | expected | default (all four) | ADVANCED (all four) | gradients every step (all four) "
              "| alone, default | twin alarms |", "|---|---|---|---|---|---|---|"]
    index = {(r["case"], r["variant"], r["config"], r["level"]): r for r in rows if "crash" not in r}
    for case in cases:
        cells = []
        for level in LEVELS:
            r = index.get((case.name, "buggy", "all", level))
            if r is None:
                cells.append("not run")
            elif r["recalled"]:
                cells.append(f"{r['named']}" + ("" if r["cause"] in (None, True) else " (cause not named)"))
            else:
                cells.append("**missed**" + (f" ({', '.join(r['found'][:3])})" if r["found"] else ""))
        alone = [f"{c}: {'yes' if index[(case.name, 'buggy', c, 'default')]['recalled'] else 'no'}"
                 for c in owners(case) if (case.name, "buggy", c, "default") in index]
        twin = sorted({f for r in rows if r.get("case") == case.name and r.get("variant") == "twin"
                       for f in r.get("found", [])})
        expected = ", ".join(case.kinds[:3]) + ("..." if len(case.kinds) > 3 else "") or f"none ({case.needs})"
        lines.append(f"| {case.name} | {expected} @{case.window[0]}-{case.window[1]} | {' | '.join(cells)} | "
                     f"{'; '.join(alone) or '-'} | {', '.join(twin[:4]) or '-'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subset", action="store_true", help="one case per class (the suite's subset)")
    parser.add_argument("--only", nargs="*", help="problem classes (vanishing_gradient, numerical, ...)")
    parser.add_argument("--cases", nargs="*", help="case names")
    parser.add_argument("--levels", nargs="*", default=list(LEVELS), choices=LEVELS)
    parser.add_argument("--configs", nargs="*", default=[], choices=(*CALLBACKS, "all"),
                        help="only these configurations (a callback alone, or all four)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "fault_benchmark.json")
    parser.add_argument("--render", type=Path, help="print the tables of an earlier --json file instead of running")
    args = parser.parse_args()
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        names = {entry["name"] for entry in saved["cases"]}
        chosen = [c for c in all_cases() if c.name in names]
        sys.stdout.write(markdown(summarise(saved["rows"], chosen), saved["rows"], chosen))
        return
    os.nice(10)
    cases = [c for c in all_cases() if (not args.subset or c.name in SUBSET) and (not args.only or c.klass in args.only)
             and (not args.cases or c.name in args.cases)]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=_init_worker) as pool:
        jobs = {pool.submit(run_case, c.name, v, tuple(args.levels), tuple(args.configs)): (c.name, v)
                for c in cases for v in ("buggy", "twin")}
        for done in concurrent.futures.as_completed(jobs):
            for row in done.result():
                rows.append(row)
                print(json.dumps({k: row.get(k) for k in ("case", "variant", "config", "level", "recalled", "cause",
                                                          "false_alarm", "found", "error", "crash", "seconds")}),
                      file=sys.stderr, flush=True)
    summary = summarise(rows, cases)
    table = markdown(summary, rows, cases)
    import platform

    import lightning
    import torch

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(time.perf_counter() - started),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "torch": torch.__version__, "lightning": lightning.__version__, "cases": len(cases)}
    args.json.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows,
                                     "cases": [{"name": c.name, "class": c.klass, "source": c.source, "kinds": c.kinds,
                                                "window": c.window, "where": c.where, "what": c.what, "needs": c.needs}
                                               for c in cases]}, indent=1, default=str))
    sys.stdout.write(table + f"\n{len(cases)} cases, {meta['seconds']} s; everything in {args.json}\n")


if __name__ == "__main__":
    main()
