"""Two checkouts of lightning-debug side by side on the same models, interleaved round by round.

Each round runs, for every model and then every checkout, one ``benchmarks/overhead.py --rounds 1`` process
(this checkout's script, with the checkout's package first on ``PYTHONPATH``) over the plain Trainer and
the configurations asked for; a configuration's ratio in a round is against the plain run of the same
process, and the table gives the median over rounds. So drift (other work on a shared machine) hits both
checkouts alike, and each ratio is paired with its own plain run.

    python benchmarks/side_by_side.py --base /tmp/base-28 --rounds 3 \\
        --models llama24,switch,many,mlp --only plugin_defaults,all_four
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(checkout: Path, model: str, only: str, steps: int, warmup: int, tensors: str,
        log_every: int = 1) -> dict[str, float]:
    """One process: each configuration's median step (``name``) and mean step (``name:mean``), seconds."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, str(HERE / "overhead.py"), "--model", model, "--rounds", "1", "--steps", str(steps),
               "--warmup", str(warmup), "--only", only, "--json", out, "--tensors", tensors,
               "--log-every", str(log_every)]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    measured = json.loads(Path(out).read_text())
    os.unlink(out)
    times = {name: values[0] for name, values in measured["seconds_per_step"].items()}
    times.update({f"{name}:mean": values[0] for name, values in measured["mean_seconds_per_step"].items() if values})
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other checkout's root (its lightning_debug package)")
    parser.add_argument("--new", default=str(HERE.parent), help="this checkout's root (default)")
    parser.add_argument("--models", default="llama24,switch,many,mlp")
    parser.add_argument("--only", default="plugin_defaults,all_four")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tensors", default="100", help="model many: its number of parameter tensors")
    parser.add_argument("--log-every", type=int, default=1, help="the Trainer's log_every_n_steps")
    args = parser.parse_args()
    checkouts = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    models = args.models.split(",")
    names = args.only.split(",")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        for model in models:
            order = list(checkouts.items())
            for label, checkout in order[::-1] if round_index % 2 else order:  # who goes first alternates
                results.setdefault((model, label), []).append(
                    run(checkout, model, args.only, args.steps, args.warmup, args.tensors, args.log_every))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
        table(args, checkouts, models, names, results, round_index + 1)


def table(args: argparse.Namespace, checkouts: dict[str, Path], models: list[str], names: list[str],
          results: dict[tuple[str, str], list[dict[str, float]]], rounds: int) -> None:
    """The table over the rounds done so far (printed after every round: a long run can be stopped)."""
    print(f"\nSide by side after {rounds} round(s); {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; one thread; log_every_n_steps={args.log_every}; interleaved rounds of {args.steps} steps "
          f"({args.warmup} warm-up); median per-step "
          "main-thread CPU time of each run; ratio: to the plain run of the same process, median over rounds\n")
    print("| model | checkout | plain ms (median step) | " + " | ".join(names) + " | "
          + " | ".join(f"{n} (mean step: rare checks counted)" for n in names) + " |")
    print("|---|---|---|" + "---|" * (2 * len(names)))
    for model in models:
        for label in checkouts:
            runs = results[(model, label)]
            plain = statistics.median(r["plain"] for r in runs)
            cells = [f"{statistics.median(r[n] / r['plain'] for r in runs):.3f}x" for n in names]
            cells += [f"{statistics.median(r[n + ':mean'] / r['plain:mean'] for r in runs):.3f}x" for n in names]
            print(f"| {model} | {label} | {plain * 1e3:.2f} | " + " | ".join(cells) + " |")
    print("\nEvery round's ratios:\n")
    for model in models:
        for label in checkouts:
            ratios = [" / ".join(f"{r[n] / r['plain']:.3f}" for n in names) for r in results[(model, label)]]
            print(f"- {model}, {label} ({' / '.join(names)}): " + ", ".join(ratios))
    print(flush=True)


if __name__ == "__main__":
    main()
