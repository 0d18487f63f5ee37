"""The sweep (issue 24): the project's instrument for false alarms. Every architecture ``transformers``
builds from a small config, plus hand-added cases (peft adapters, Lightning's demos, a frozen backbone,
adaLN-zero, MoE, bf16-mixed, accumulation, checkpointing, ...), each trained ~30 steps on CPU in a real
``lightning.Trainer`` twice: at the defaults (``DebugConfig()``) and with every check every step.

    PYTHONPATH=. python benchmarks/sweep.py --out /tmp/sweep                 # everything (about an hour)
    PYTHONPATH=. python benchmarks/sweep.py --out /tmp/sweep --only convnext lora_llama
    PYTHONPATH=. python benchmarks/sweep.py --out /tmp/sweep --limit 20 --resume

It writes ``results.jsonl`` (one line per case and setting: status trained / skipped / train_failed /
timeout / crashed, reason, steps, seconds, findings of severity warning and above) and ``table.md``.
With ``--resume`` the cases already in results.jsonl are not run again.

The cases run in a worker subprocess (one torch thread, a memory limit, a time limit per case); the
parent restarts it after a crash or a case that ran past the limit and records that case as such.
The models live in ``tests/harness/sweep_models.py`` so the suite's fast subset (tests/integration/test_sweep.py) builds
the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SETTING_NAMES = ("defaults", "every_step")
# After a failed allocation under the memory limit, oneDNN and the allocator may be left broken ("could not
# create a primitive" on every later model): the worker then exits and the parent starts a fresh one.
BROKEN_PROCESS = ("alloc_cpu", "MemoryError", "could not create a primitive", "can't allocate memory")


def read_results(out: Path) -> list[dict[str, Any]]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(out: Path, record: dict[str, Any]) -> None:
    with open(out / "results.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def done_keys(out: Path) -> set[tuple[str, str]]:
    return {(r["name"], r["setting"]) for r in read_results(out)}


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` on the way swallows it."""


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


def worker(out: Path, names: list[str], case_limit: int, memory_gb: float, steps: int) -> None:
    """Run the named cases (both settings) in this process, appending each outcome as it ends."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (int(memory_gb * 2**30), int(memory_gb * 2**30)))
    from tests.harness.quiet import quiet_process
    from tests.harness.sweep_models import case_named, fit_case

    quiet_process()

    signal.signal(signal.SIGALRM, _alarm)
    done = done_keys(out)
    for name in names:
        case = case_named(name)
        for setting in SETTING_NAMES:
            if (name, setting) in done:
                continue
            (out / "current").write_text(json.dumps({"name": name, "setting": setting, "source": case.source,
                                                     "what": case.what, "started": time.time()}))
            record: dict[str, Any] = {"name": name, "setting": setting, "source": case.source, "what": case.what}
            started = time.perf_counter()
            signal.alarm(case_limit)
            try:
                with tempfile.TemporaryDirectory(prefix=f"sweep-{name}-") as root:
                    outcome = fit_case(case, setting, Path(root), steps=steps)
                record.update(status=outcome.status, steps=outcome.steps, seconds=round(outcome.seconds, 2),
                              reason=outcome.reason, findings=outcome.findings, probes=outcome.probes)
            except CaseTimeout:
                record.update(status="timeout", steps=0, seconds=round(time.perf_counter() - started, 2),
                              reason=f"ran past {case_limit} s", findings=[])
            except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
                record.update(status="train_failed", steps=0, seconds=round(time.perf_counter() - started, 2),
                              reason=f"{type(error).__name__}: {str(error)[:200]}", findings=[])
            finally:
                signal.alarm(0)
            append(out, record)
            done.add((name, setting))
            if record["status"] in ("skipped", "timeout"):  # not built, or too slow: the same under both settings
                for other in SETTING_NAMES:
                    if (name, other) not in done:
                        append(out, dict(record, setting=other))
                        done.add((name, other))
            if any(marker in record["reason"] + json.dumps(record["findings"]) for marker in BROKEN_PROCESS):
                (out / "current").unlink(missing_ok=True)
                sys.exit(3)
            if record["status"] in ("skipped", "timeout"):
                break
    (out / "current").unlink(missing_ok=True)


def supervise(out: Path, names: list[str], case_limit: int, memory_gb: float, steps: int) -> None:
    """Run the worker until every named case has both settings recorded, restarting it after a crash."""
    while True:
        done = done_keys(out)
        todo = [n for n in names if any((n, s) not in done for s in SETTING_NAMES)]
        if not todo:
            return
        (out / "current").unlink(missing_ok=True)
        command = [sys.executable, __file__, "--worker", "--out", str(out), "--case-limit", str(case_limit),
                   "--memory-gb", str(memory_gb), "--steps", str(steps), "--only", *todo]
        process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                   stdout=open(out / "worker.log", "a"), stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(2)
            current = _current(out)
            if current and time.time() - current["started"] > case_limit + 60:
                process.kill()
                process.wait()
                break
        current = _current(out)
        if current is None:
            continue
        status = "timeout" if process.returncode in (-signal.SIGKILL,) else "crashed"
        reason = (f"ran past {case_limit} s" if status == "timeout"
                  else f"worker died (exit {process.returncode}): see worker.log")
        record = dict(current, status=status, steps=0, seconds=round(time.time() - current.pop("started"), 2),
                      reason=reason, findings=[])
        record.pop("started", None)
        for setting in SETTING_NAMES:  # a case that crashes the process is not run again under the other setting
            if (record["name"], setting) not in done_keys(out):
                append(out, dict(record, setting=setting))
        print(f"{record['name']}: {status} ({reason})", flush=True)


def _current(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / "current").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# --- the table -----------------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def verdict(record: dict[str, Any] | None) -> str:
    if record is None:
        return "not run"
    if record["status"] != "trained":
        return record["status"]
    if not record["findings"]:
        return "quiet"
    kinds: dict[str, list[str]] = {}
    for finding in record["findings"]:
        steps = kinds.setdefault(str(finding["kind"]), [])
        if str(finding.get("step")) not in steps:
            steps.append(str(finding.get("step")))
    return ", ".join(f"**{kind}**@{','.join(steps[:5])}{',...' if len(steps) > 5 else ''}"
                     for kind, steps in kinds.items())


def write_table(out: Path) -> str:
    """``table.md``: counts, then one row per case (both settings), then the skipped cases with reasons."""
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for record in read_results(out):
        by_case.setdefault(record["name"], {})[record["setting"]] = record
    trained = [n for n, r in by_case.items() if all(r.get(s, {}).get("status") == "trained" for s in SETTING_NAMES)]
    skipped = [n for n, r in by_case.items() if any(x.get("status") == "skipped" for x in r.values())]
    failed = [n for n in by_case if n not in trained and n not in skipped]
    quiet = [n for n in trained if all(not by_case[n][s]["findings"] for s in SETTING_NAMES)]
    hand = [n for n, r in by_case.items() if next(iter(r.values()))["source"] == "hand"]
    lines = [
        f"Cases: {len(by_case)} ({len(by_case) - len(hand)} auto-mapped architectures, {len(hand)} hand-added); "
        f"built and trained under both settings: {len(trained)}; skipped (cannot be built here): {len(skipped)}; "
        f"failed to train or timed out: {len(failed)}; quiet under both settings: {len(quiet)} of {len(trained)}.",
        "",
        "| case | source | model | defaults | every check every step | steps | seconds (both) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, records in by_case.items():
        if name in skipped:
            continue
        first = next(iter(records.values()))
        steps = "/".join(str(records.get(s, {}).get("steps", "")) for s in SETTING_NAMES)
        seconds = sum(r.get("seconds", 0) for r in records.values())
        lines.append(f"| {name} | {first['source']} | {first['what']} | {verdict(records.get('defaults'))} | "
                     f"{verdict(records.get('every_step'))} | {steps} | {seconds:.0f} |")
    if failed:
        lines += ["", "Failed to train or timed out:", ""]
        lines += [f"- `{n}`: " + "; ".join(f"{s}: {_one_line(r.get('reason', ''))[:160]}" for s, r in by_case[n].items()
                                          if r["status"] != "trained") for n in failed]
    if skipped:
        lines += ["", "Skipped (cannot be built from a small config without files here):", ""]
        lines += [f"- `{n}` ({next(iter(by_case[n].values()))['what']}): "
                  f"{_one_line(next(iter(by_case[n].values())).get('reason', ''))[:200]}" for n in skipped]
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def findings_by_kind(out: Path) -> str:
    """The findings of warning and above grouped by kind: case, setting, step, message head."""
    by_kind: dict[str, list[str]] = {}
    for record in read_results(out):
        for finding in record.get("findings", []):
            message = " ".join(str(finding.get("message", "")).split())[:230].replace("|", "/")
            by_kind.setdefault(str(finding["kind"]), []).append(
                f"| {record['name']} | {record['setting']} | {finding.get('step')} | {message} |")
    lines: list[str] = []
    for kind, rows in sorted(by_kind.items(), key=lambda item: -len(item[1])):
        cases = {row.split(" | ")[0][2:] for row in rows}
        lines += [f"### {kind} ({len(rows)} findings, {len(cases)} cases)", "",
                  "| case | setting | step | message |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for results.jsonl and table.md")
    parser.add_argument("--only", nargs="+", help="case names (model_type for the auto-mapped ones)")
    parser.add_argument("--limit", type=int, help="at most this many cases (in order: hand-added, then auto)")
    parser.add_argument("--resume", action="store_true", help="keep results.jsonl and skip the cases it has")
    parser.add_argument("--redo", action="store_true",
                        help="with --resume: run again the cases results.jsonl has as not trained")
    parser.add_argument("--case-limit", type=int, default=120, help="seconds per case and setting")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="memory limit of the worker")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--table-only", action="store_true", help="only rewrite table.md from results.jsonl")
    parser.add_argument("--findings", type=Path, help="also write the findings grouped by kind to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.out, args.only, args.case_limit, args.memory_gb, args.steps)
        return
    if args.table_only:
        print(write_table(args.out))
        if args.findings:
            args.findings.write_text(findings_by_kind(args.out))
        return
    if not args.resume and (args.out / "results.jsonl").exists():
        (args.out / "results.jsonl").unlink()
    if args.resume and args.redo:
        records = read_results(args.out)
        again = {r["name"] for r in records if r["status"] != "trained"}
        kept = [r for r in records if r["name"] not in again]
        (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    names = args.only
    if names is None:
        from tests.harness.sweep_models import all_cases

        names = [case.name for case in all_cases()]
    if args.limit is not None:
        names = names[:args.limit]
    supervise(args.out, names, args.case_limit, args.memory_gb, args.steps)
    print(write_table(args.out))
    if args.findings:
        args.findings.write_text(findings_by_kind(args.out))


if __name__ == "__main__":
    main()
