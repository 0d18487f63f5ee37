"""The ``lightning-debug`` command."""

from __future__ import annotations

import argparse
import sys

from lightning_debug._version import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-debug",
        description="Debug PyTorch training while it runs: NaN/Inf with the culprit, gradient health, "
                    "memory and step-time profiling for Lightning and Accelerate.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-debug {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    demo = verbs.add_parser("demo", help="run a short CPU training with a planted NaN and show what is reported")
    demo.add_argument("--output", default="demo_output", help="where logs and reports go (default: demo_output)")
    demo.add_argument("--steps", type=int, default=80, help="optimizer steps to train (default: 80)")
    demo.add_argument("--nan-step", type=int, default=40, help="step from which the loss takes log(0) (default: 40)")
    demo.add_argument("--mode", default="warn", choices=["warn", "raise", "skip", "stop"],
                      help="anomaly_detection_mode (default: warn)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb == "demo":
        from lightning_debug.demo import run_demo

        run_demo(args.output, steps=args.steps, nan_step=args.nan_step, mode=args.mode)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
