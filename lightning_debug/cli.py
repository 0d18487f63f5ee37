"""The ``lightning-debug`` command: ``demo`` (a planted NaN, on CPU) and ``report DIR`` (rebuild a run's report).

Exit codes: 0 done, 2 unusable input with one line on stderr per run that failed (docs/reliability.md).
Everything printed from a run's files is escaped; a reader that goes away (``| head``) ends the printing quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from lightning_debug._version import __version__
from lightning_debug.config import AnomalyMode

PROG = "lightning-debug"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Debug PyTorch training while it runs: NaN/Inf with the "
                                     "culprit, gradient health, memory and step-time profiling for Lightning and "
                                     "Accelerate.")
    parser.add_argument("--version", action="version", version=f"lightning-debug {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    demo = verbs.add_parser("demo", help="run a short CPU training with a planted NaN and show what is reported")
    demo.add_argument("--output", default="demo_output", help="where logs and reports go (default: demo_output)")
    demo.add_argument("--steps", type=int, default=80, help="optimizer steps to train (default: 80)")
    demo.add_argument("--nan-step", type=int, default=40, help="step from which the loss takes log(0) (default: 40)")
    demo.add_argument("--mode", default="warn", choices=[mode.value for mode in AnomalyMode],
                      help="anomaly_detection_mode (default: warn)")
    report = verbs.add_parser(
        "report", help="rebuild report.json, report.md and debug_analysis.png from a run's files",
        description="Rebuild report.json, report.md and debug_analysis.png offline from events.jsonl and the "
                    "TensorBoard event files. DIR is a run's debug_outputs directory, its log directory, or any "
                    "directory above: every run found under it is rebuilt.")
    report.add_argument("directory", metavar="DIR", type=Path, help="a run's debug_outputs or log directory")
    report.add_argument("--no-plots", action="store_true", help="do not draw debug_analysis.png")
    report.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return parser


def _write(stream_name: str, line: str) -> None:
    """One escaped line; a closed pipe (``| head`` read enough) goes to /dev/null: no traceback at exit."""
    from lightning_debug.report.events_file import printable

    stream = getattr(sys, stream_name)
    try:
        stream.write(printable(line) + "\n")
        stream.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _say(line: str) -> None:
    _write("stdout", line)


def _fail(message: str) -> int:
    one_line = " ".join(str(message).split())
    _write("stderr", f"{PROG}: error: {one_line[:2000]}")
    return 2


def _progress(message: str) -> None:
    _write("stderr", f"{PROG}: {message}")


def run_report(directory: Path, plots: bool = True, quiet: bool = False) -> int:
    """The ``report`` verb; returns the exit code."""
    from lightning_debug.report.offline import RunDirectoryError, find_run_directories, rebuild
    from lightning_debug.report.summary import summary_lines

    try:
        runs = find_run_directories(directory)
    except RunDirectoryError as error:
        return _fail(str(error))
    if len(runs) > 1 and not quiet:
        _progress(f"{len(runs)} runs under {directory}")
    failures = 0
    for number, run in enumerate(runs, start=1):
        started = time.monotonic()
        try:
            result = rebuild(run, plots=plots, progress=None if quiet else _progress)
        except Exception as error:  # input this version did not foresee too: one line, exit 2
            failures += 1
            _fail(str(error) if isinstance(error, RunDirectoryError)
                  else f"cannot write the report in {run}: {error.strerror or error}" if isinstance(error, OSError)
                  else f"cannot rebuild the report of {run} ({type(error).__name__}: {error})")
            continue
        if quiet:
            continue
        prefix = f"[{number}/{len(runs)}] " if len(runs) > 1 else ""
        _say(f"{prefix}rebuilt {run} in {time.monotonic() - started:.1f} s from {result.events} event(s) and "
             f"{len(result.tensorboard)} TensorBoard file(s)")
        if result.truncated_last_line:
            _say("  note: the last line of events.jsonl was cut off (the run probably stopped while writing it); "
                 "it was skipped")
        for note in result.notes:
            _say(f"  note: {note}")
        files = {"wrote": ", ".join(str(path) for path in result.written)}
        for line in "\n".join(summary_lines(result.report, files)).splitlines():
            _say(line)
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb == "demo":
        from lightning_debug.demo import run_demo

        run_demo(args.output, steps=args.steps, nan_step=args.nan_step, mode=args.mode)
        return 0
    if args.verb == "report":
        return run_report(args.directory, plots=not args.no_plots, quiet=args.quiet)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
