"""Inject a failure on rank 1 into every method the plugin runs during a step, under DDP (issue 43).

Two CPU processes (gloo), all four callbacks with every check on every step. For each mode (warn, skip), one
fit of ``--steps`` steps in which, from step 2 on, one method raises once on rank 1 at each step: every method
of the Run and of every monitor found by introspection and called during a step, once at a NaN step and once
at a healthy one (``tests/workers/ddp_worker.py --sweep``). Each fit runs under a timeout that kills every
rank, so a hang is counted, never waited for. Per mode it prints the methods seen, the injections that fired,
those never reached (a method not called again on rank 1 within its tries), hangs, what the two ranks
disagree on (steps, decisions, weights, the gate's collectives, the failed checks in rank 0's report) and
the time.

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

from tests.harness.injection import candidate_methods, event_entries, problems  # noqa: E402
from tests.integration.test_distributed import run_two_ranks  # noqa: E402


def sweep(out: Path, mode: str, steps: int, timeout_s: float) -> dict:
    where = out / mode
    where.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        results = run_two_ranks(where, mode, 1, 3, "ddp", True, "basic", "--sweep", "--max-steps", str(steps),
                                timeout_s=timeout_s)
    except AssertionError as error:  # a rank did not write its result: it hung (killed) or crashed
        return {"mode": mode, "hang_or_crash": True, "error": str(error)[-2000:],
                "seconds": round(time.perf_counter() - started, 1)}
    one = results[1]
    return {"mode": mode, "hang_or_crash": False, "seconds": round(time.perf_counter() - started, 1),
            "seen": len(one["seen"]), "fired": len(one["fired"]),
            "fired_at_nan_steps": sum(1 for _, step in one["fired"] if step in _nan_steps(results[0], mode)),
            "methods_fired": len({name for name, _ in one["fired"]}), "not_reached": one["not_reached"],
            "problems": problems(results, steps), "methods": one["seen"]}


def _nan_steps(zero: dict, mode: str) -> set[int]:
    return {step for step, decision in zero["decisions"] if decision != "step"} if mode == "skip" else set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--modes", nargs="+", default=["warn", "skip"])
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fault_injection"))
    args = parser.parse_args()
    print(f"candidate methods (Run and monitors, introspection): {len(candidate_methods())}; "
          f"Run event entries left out (the gate): {', '.join(event_entries())}")
    rows = []
    for mode in args.modes:
        row = sweep(args.out, mode, args.steps, args.timeout)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "methods"}, indent=1))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print("\n| mode | methods seen during a step | injections fired | methods fired | not reached | hangs | "
          "problems | seconds |\n|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["hang_or_crash"]:
            print(f"| {row['mode']} | - | - | - | - | 1 | {row['error'][:80]} | {row['seconds']} |")
        else:
            print(f"| {row['mode']} | {row['seen']} | {row['fired']} | {row['methods_fired']} | "
                  f"{len(row['not_reached'])} | 0 | {len(row['problems'])} | {row['seconds']} |")


if __name__ == "__main__":
    main()
