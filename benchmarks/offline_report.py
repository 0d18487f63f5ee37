"""``lightning-debug report`` on a very long events.jsonl: time and peak memory of the rebuild.

    python benchmarks/offline_report.py                 # 1,000,000 lines
    python benchmarks/offline_report.py --lines 200000

It writes an events.jsonl of the given number of lines (episodes of a few kinds starting and ending,
one-off events, a few malformed lines), runs the rebuild in a fresh process and prints the wall
time and the peak resident memory of that process, against the file's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("slow_step", "exploding_grad", "dataloader_bottleneck", "memory_high", "nonfinite_loss")
REBUILD = """
import resource, sys, time
from pathlib import Path
from lightning_debug.report.offline import rebuild
started = time.perf_counter()
result = rebuild(Path(sys.argv[1]), plots=False)
print(result.events, result.bad_lines, len(result.report["findings"]), time.perf_counter() - started,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""
BASELINE = """
import resource
import lightning_debug.report.offline
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def write_events(path: Path, lines: int) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for number in range(lines):
            step = number // 2
            kind = KINDS[number % len(KINDS)]
            if number % 1000 == 999:
                handle.write('{"step": "not a number", "kind": 7}\n')
                continue
            record = {"step": step, "epoch": step // 1000, "batch": step % 1000, "kind": kind,
                      "severity": "warning", "callback": "PerformanceProfilerCallback", "run": "bench",
                      "message": f"{kind} at step {step}: a message of typical length for one finding, with advice.",
                      "details": {"first_step": step, "last_step": step + 1, "steps": 2}}
            record["episode"] = "end" if number % 2 else "start"
            handle.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        run = Path(directory)
        started = time.perf_counter()
        write_events(run / "events.jsonl", args.lines)
        size_mb = (run / "events.jsonl").stat().st_size / 2**20
        print(f"wrote {args.lines} lines ({size_mb:.0f} MB) in {time.perf_counter() - started:.1f} s")
        baseline = float(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True,
                                        check=True).stdout)
        out = subprocess.run([sys.executable, "-c", REBUILD, str(run)], capture_output=True, text=True, check=True)
        events, bad, kinds, seconds, peak_mb = out.stdout.split()
        print(f"rebuilt from {events} events ({bad} malformed lines skipped, {kinds} kinds) in {float(seconds):.1f} s; "
              f"peak RSS {float(peak_mb):.0f} MB (the same process after importing the reader: {baseline:.0f} MB)")


if __name__ == "__main__":
    main()
