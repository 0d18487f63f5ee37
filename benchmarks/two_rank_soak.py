"""Run every two-process test of the suite N times beside a busy process, and count what passed (issue 27).

A collective that is skipped, doubled or reordered on one rank shows as a hang, and a hang in one run of
many is what a CI machine under load meets. This repeats the two-rank tests (DDP, FSDP2, ``accelerate``
with ``torchrun``, the faults injected on one rank, the straggler) in rounds, each round one pytest
process, while a busy loop takes one core of the two; every test keeps its own timeout, so a hang is a
failure within it, never a stuck soak. The result is one Markdown table: per test, passed/runs and the
slowest run.

    python benchmarks/two_rank_soak.py --rounds 20 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TWO_RANK = [
    "tests/integration/test_distributed.py",
    "tests/integration/test_distributed_faults.py",
    "tests/integration/test_fault_injection.py",
    "tests/integration/test_sharded.py",
    "tests/integration/test_straggler.py",
    # in test_accelerate.py only the tests that launch two processes (torchrun)
    "tests/integration/test_accelerate.py::test_two_processes_take_the_same_decision_at_the_same_step",
    "tests/integration/test_accelerate.py::test_two_processes_with_a_model_sharded_by_fully_shard_before_prepare",
]
BUSY = "import time\nwhile True:\n    sum(i * i for i in range(10000))\n"


def one_round(out: Path, index: int, tests: list[str] = TWO_RANK) -> dict[str, tuple[str, float]]:
    """Run the two-rank tests once; per test id, its outcome and seconds."""
    report = out / f"round-{index:02d}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *tests]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(out / f"round-{index:02d}.log", "w") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    results: dict[str, tuple[str, float]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        results[name] = (outcome, float(case.get("time", 0.0)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("/tmp/two-rank-soak"))
    parser.add_argument("--no-busy", action="store_true", help="leave out the busy process")
    parser.add_argument("--tests", nargs="+", default=TWO_RANK, help="these test files or ids only")
    parser.add_argument("--table-only", nargs="*", type=Path, metavar="DIR",
                        help="print the table of the outcomes.json in these directories (soaks run side by side)")
    args = parser.parse_args()
    if args.table_only is not None:
        merged: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for directory in args.table_only or [args.out]:
            for name, results in json.loads((directory / "outcomes.json").read_text()).items():
                merged[name] += [tuple(result) for result in results]
        table(merged)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    busy = None if args.no_busy else subprocess.Popen([sys.executable, "-c", BUSY])
    outcomes: dict[str, list[tuple[str, float]]] = defaultdict(list)
    started = time.time()
    try:
        for index in range(args.rounds):
            for name, result in one_round(args.out, index, args.tests).items():
                outcomes[name].append(result)
            failed = sum(result[0] == "failed" for results in outcomes.values() for result in results[-1:])
            print(f"round {index + 1}/{args.rounds}: {failed} failed, {time.time() - started:.0f} s", flush=True)
            (args.out / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    finally:
        if busy is not None:
            busy.kill()
    print(f"\n{args.rounds} rounds, {'with' if busy else 'without'} a busy process, {time.time() - started:.0f} s\n")
    table(outcomes)


def table(outcomes: dict[str, list[tuple[str, float]]]) -> None:
    print("| test | passed / runs | skipped | slowest run (s) |\n|---|---|---|---|")
    for name, results in sorted(outcomes.items()):
        passed = sum(outcome == "passed" for outcome, _ in results)
        skipped = sum(outcome == "skipped" for outcome, _ in results)
        print(f"| `{name}` | {passed} / {len(results) - skipped} | {skipped} | {max(t for _, t in results):.1f} |")


if __name__ == "__main__":
    main()
