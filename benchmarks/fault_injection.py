"""Inject a failure on rank 1 into every method the plugin runs during a step, under DDP (issue 43).

Two CPU processes (gloo), all four callbacks with every check on every step. For each mode (warn, skip), one
fit of ``--steps`` steps in which, from step 0 on, one method raises once on rank 1 at each step: every method
of the Run and of every monitor found by introspection and called during a step, once at a NaN step and once
at a healthy one (``tests/workers/ddp_worker.py --sweep``). Each fit runs under a timeout that kills every
rank, so a hang is counted, never waited for. Per mode it prints the methods called during a step, per kind of
step (healthy, NaN) how many of those called at such a step were injected there, which were never called at
such a step (not applicable: derived from the steps each method was called at), those applicable but never
injected (not reached), hangs, what the two ranks disagree on (steps, decisions, weights, the gate's
collectives, the failed checks in rank 0's report) and the time. Later fits per mode (``--second-steps``,
at most ``--max-fits`` in all, while one injects something) inject only the pairs the earlier ones left: not
reached, or never called at that kind of step (an earlier injection can keep a method from running again on
that rank), armed at the steps the earlier fits called them at; all fits' calls and injections are counted
together.

    python benchmarks/fault_injection.py --steps 240 --out /tmp/fault_injection
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness.injection import candidate_methods, coverage, event_entries, leftovers, problems  # noqa: E402
from tests.integration.test_distributed import run_two_ranks  # noqa: E402


def fit(where: Path, mode: str, steps: int, timeout_s: float, *extra: str) -> tuple[list[dict] | None, str]:
    where.mkdir(parents=True, exist_ok=True)
    for stale in where.glob("result_*.json"):  # a hung fit writes none: never read an earlier run's
        stale.unlink()
    try:
        return run_two_ranks(where, mode, 1, 3, "ddp", True, "basic", "--sweep", "--max-steps", str(steps), *extra,
                             timeout_s=timeout_s), ""
    except AssertionError as error:  # a rank did not write its result: it hung (killed) or crashed
        return None, str(error)[-2000:]


def sweep(out: Path, mode: str, steps: int, timeout_s: float, second_steps: int, max_fits: int) -> dict:
    """The first fit, then fits that inject only what the earlier ones left (not reached, or never called again
    at that kind of step once an earlier injection had kept it from running), while one reaches something new."""
    started = time.perf_counter()
    runs: list[tuple[list[dict], int]] = []
    left: list = []
    while True:
        fit_steps = steps if not runs else second_steps
        where = out / (mode if not runs else f"{mode}_{len(runs) + 1}")
        extra: tuple[str, ...] = ()
        if runs:
            targets = out / f"{mode}_{len(runs) + 1}_targets.json"
            targets.write_text(json.dumps(left))
            extra = ("--sweep-targets", str(targets.resolve()))
        results, error = fit(where, mode, fit_steps, timeout_s, *extra)
        if results is None:
            return {"mode": mode, "hangs": 1, "error": error, "seconds": round(time.perf_counter() - started, 1)}
        runs.append((results, fit_steps))
        passes = [(one["calls"], [tuple(f) for f in one["fired"]], set(one["nan_steps"])) for (_, one), _ in runs]
        covered = coverage(passes)
        left = leftovers(covered, passes)
        if not left or not second_steps or len(runs) >= max_fits or (len(runs) > 1 and not results[1]["fired"]):
            break
    return {"mode": mode, "hangs": 0, "fits": [n for _, n in runs], "seconds": round(time.perf_counter() - started, 1),
            "coverage": covered, "fired": sum(len(one["fired"]) for (_, one), _ in runs),
            "fired_per_fit": [len(one["fired"]) for (_, one), _ in runs],
            "problems": [p for results, n in runs for p in problems(results, n)],
            "methods": sorted({name for (_, one), _ in runs for name in one["calls"]})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--modes", nargs="+", default=["warn", "skip"])
    parser.add_argument("--second-steps", type=int, default=90,
                        help="steps of each later fit (0: none), which injects only what the earlier ones left")
    parser.add_argument("--max-fits", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fault_injection"))
    args = parser.parse_args()
    print(f"candidate methods (Run and monitors, introspection): {len(candidate_methods())}; "
          f"Run event entries left out (the gate): {', '.join(event_entries())}")
    rows = []
    for mode in args.modes:
        row = sweep(args.out, mode, args.steps, args.timeout, args.second_steps, args.max_fits)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "methods"}, indent=1))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    called = sorted({name for row in rows if not row["hangs"] for name in row["methods"]})
    print(f"\nmethods called during a step, both modes together: {len(called)}")
    print("\n| mode | fits (steps) | methods called during a step | injected at a healthy step / applicable | "
          "injected at a NaN step / applicable | not applicable (never called at that kind of step) | injections | "
          "hangs | disagreements | time (s) |\n|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["hangs"]:
            print(f"| {row['mode']} | - | - | - | - | - | - | 1 | {row['error'][:80]} | {row['seconds']} |")
            continue
        cov = row["coverage"]
        healthy, nan = cov["healthy"], cov["nan"]
        missing = [f"{name} (healthy)" for name in healthy["not_reached"]] + [f"{name} (NaN)" for name in
                                                                             nan["not_reached"]]
        na = [f"{name} (healthy)" for name in healthy["not_applicable"]] + [f"{name} (NaN)" for name in
                                                                           nan["not_applicable"]]
        fits = " + ".join(str(n) for n in row["fits"])
        print(f"| {row['mode']} | {len(row['fits'])} ({fits}) | {cov['methods']} | "
              f"{healthy['injected']} / {healthy['applicable']} | "
              f"{nan['injected']} / {nan['applicable']} | {len(na)}: {', '.join(na) or '-'} | {row['fired']} | 0 | "
              f"{len(row['problems'])} | {row['seconds']} |")
        if missing:
            print(f"  not reached in {row['mode']}: {', '.join(missing)}")


if __name__ == "__main__":
    main()
