"""The plant matrix (issue 25): the bugs users make, planted in several architectures, and how often the
plugin names each at its step with the right cause.

Each plant is run in every model it fits (the zoo's stock models: transformers BERT, GPT-2, ResNet, T5,
Lightning's demo transformer and BoringModel, a 24-layer MLP, PyTorch's LSTM language model), at the
default level and at ``level="advanced"``. A run *recalls* the plant when a finding of the expected kind
starts at the expected step (or within the plant's window); its *cause is right* when that finding (or the
report) names what the plant did, judged by the plant's own predicate. Healthy runs of the same models
are in the matrix too: any finding of severity warning or above there counts against the plugin.

    PYTHONPATH=. python benchmarks/plants.py --out /tmp/plants               # everything (10-20 min, 2 cores)
    PYTHONPATH=. python benchmarks/plants.py --out /tmp/plants --only log_zero lr_zero --models gpt2

It writes ``results.jsonl`` (one line per plant, model and level) and ``table.md`` (recall and cause
accuracy per level, then one row per run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LEVELS = ("default", "advanced")
DIVERGENCE_KINDS = ("loss_spike", "loss_divergence", "update_ratio_high")


@dataclasses.dataclass(frozen=True)
class PlantCase:
    """One bug: how to plant it (``plant`` keywords of the zoo's ``Plant``), how long to train, the
    settings a user checking for it would run, what must be found and how its cause is judged."""

    name: str
    plant: dict[str, Any]
    models: tuple[str, ...]
    steps: int
    kinds: tuple[str, ...]
    steps_ok: Callable[[int], bool]
    cause: Callable[[dict[str, Any], Any, str, str], bool]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    what: str = ""


def _names_log(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    message = event["message"]
    if level == "advanced":
        return bool(re.search(r"Cause: `torch\.log`", message))
    return "parameters are already non-finite" not in message and result.findings_order()[0] in (
        "nonfinite_loss", "nonfinite_grad")


def _names_sample(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return event["details"].get("samples") == [1] and result.findings_order()[0] == "nonfinite_input"


def _names_lr(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return bool(re.search(r"learning rate|\blr\b", event["message"], re.I))


def _names_unused(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return set(event["details"].get("parameters", [])) == {"unused_layer.weight", "unused_layer.bias"}


def _names_workers(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return event["details"].get("num_workers") == 0 and "num_workers" in event["message"]


def _names_schedule(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return "LambdaLR" in event["message"] and event["details"].get("since_step") == 10


def _names_inplace(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    if level == "advanced":
        return bool(re.search(r"Cause: `[^`]*(div_|/=|__itruediv__)", event["message"]))
    return result.findings_order()[0] == "nonfinite_loss"


def _names_masked_softmax(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    if level == "advanced":
        return bool(re.search(r"Cause: `[^`]*softmax", event["message"])) and "-inf" in event["message"]
    return result.findings_order()[0] == "nonfinite_loss"


def _names_sqrt(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    """The gradient comes first and every consequence after what it follows from (grad, param, loss)."""
    findings = result.report.get("findings", {})
    order = list(findings)
    follows = all(order.index(entry["consequence_of"]) < order.index(kind) for kind, entry in findings.items()
                  if entry.get("consequence_of") in order)
    chain = [kind for kind in order if kind.startswith("nonfinite_")]
    if not (follows and chain[:1] == ["nonfinite_grad"]):
        return False
    return level != "advanced" or "backward of `sqrt`" in event["message"]


def _names_period(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    return bool(re.search(r"every 5(th)? (optimizer )?step", event["message"]))


LABEL_CLASSES = {"bert": 2, "resnet": 4, "gpt2": 128, "t5": 128}
"""The number of classes of each model's loss: the planted label equals it (the first value out of range)."""


def _names_label(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    classes = LABEL_CLASSES.get(model)
    message = event["message"]
    numbers = re.findall(r"\d+", message)
    return bool(re.search(r"label|target", message, re.I)) and classes is not None \
        and str(classes) in numbers and "classes" in message


def _names_graph(event: dict[str, Any], result: Any, level: str, model: str) -> bool:
    from tests.harness.zoo import LOSS_GRAD_FN

    tensors = event["details"].get("tensors") or [{}]
    return tensors[0].get("grad_fn") == LOSS_GRAD_FN.get(model) and event["severity"] == "warning"


ALL = ("mlp24", "bert", "gpt2", "resnet", "t5", "demo_transformer", "boring", "lstm")
PLANTS: tuple[PlantCase, ...] = (
    PlantCase("log_zero", {"log_zero_at": 5}, ALL, 7, ("nonfinite_loss",), lambda step: step == 5, _names_log,
              what="`loss + log(0 * loss)` at step 5"),
    PlantCase("nan_input", {"nan_input_at": 3, "nan_sample": 1}, ("mlp24", "resnet", "boring"), 5,
              ("nonfinite_input",), lambda step: step == 3, _names_sample, what="NaN in sample 1 of step 3's batch"),
    PlantCase("lr_10", {"lr": 10.0}, ("mlp24", "bert", "gpt2", "resnet"), 6, DIVERGENCE_KINDS,
              lambda step: step <= 3, _names_lr, what="AdamW lr=10"),
    PlantCase("unused_layer", {"unused_layer": True}, ("mlp24", "bert", "lstm", "gpt2", "resnet"), 3,
              ("missing_grad",), lambda step: step == 0, _names_unused, what="a layer forward never calls"),
    PlantCase("kept_graph", {"keep_graph": True}, ("mlp24", "gpt2", "bert", "demo_transformer", "boring", "lstm"),
              96,
              ("memory_growth",), lambda step: step <= 95, _names_graph,
              overrides={"memory_profiling_frequency": 8, "performance_profiling_frequency": 1},
              what="`losses.append(loss)` every step: a leak through the loss's graph"),
    PlantCase("slow_data", {"data_sleep_s": 0.004}, ("resnet", "gpt2", "mlp24", "bert", "boring"), 12,
              ("dataloader_bottleneck",), lambda step: step <= 11, _names_workers,
              overrides={"performance_profiling_frequency": 1}, what="4 ms per sample in __getitem__"),
    PlantCase("lr_zero", {"lr_zero_after": 10}, ("mlp24", "bert", "gpt2", "resnet", "boring"), 40,
              ("learning_stalled",), lambda step: 10 <= step <= 16, _names_schedule,
              overrides={"gradient_checking_frequency": 2},
              what="a LambdaLR that sets the learning rate to 0 after step 10 of 40"),
    PlantCase("inplace_nan", {"inplace_nan_at": 5}, ALL, 7, ("nonfinite_loss",), lambda step: step == 5,
              _names_inplace, what="`z /= z.std()` of a constant vector at step 5 (an in-place 0/0)"),
    PlantCase("masked_softmax", {"masked_softmax_at": 5}, ALL, 7, ("nonfinite_loss",), lambda step: step == 5,
              _names_masked_softmax, what="softmax over a row masked_fill(-inf) entirely, at step 5"),
    PlantCase("sqrt_zero", {"sqrt_zero_at": 5}, ALL, 7, ("nonfinite_grad",), lambda step: step == 5, _names_sqrt,
              what="sqrt of a zero squared distance at step 5 (NaN only in the backward)"),
    PlantCase("periodic_sleep", {"sleep_every": 5}, ("mlp24", "bert", "gpt2", "resnet", "boring"), 30,
              ("slow_step",), lambda step: step <= 29, _names_period,
              overrides={"performance_profiling_frequency": 1}, what="time.sleep(0.2) on every 5th step"),
    PlantCase("bad_label", {"bad_label_at": 3}, ("bert", "gpt2", "resnet", "t5"), 5, ("exception",),
              lambda step: step == 3, _names_label, what="a label out of range passed to the model's own loss"),
)


def _fit(model: str, plant: Any, config: Any, root: Path, steps: int) -> Any:
    """The zoo's fit, keeping what the run wrote when the planted bug raises (a bad label stops training)."""
    from lightning_debug import debug_callbacks
    from tests.harness.toolkit import debug_dir, make_trainer, read_events, read_report
    from tests.harness.zoo import TRAINER_OPTIONS, Result, build

    module = build(model, plant)
    trainer = make_trainer(root, debug_callbacks(config), max_steps=steps,
                           **dict(TRAINER_OPTIONS.get(model, {}), limit_val_batches=0))
    started = time.perf_counter()
    try:
        trainer.fit(module)
    except Exception:  # noqa: BLE001 - the user's error; the plugin's findings are what is judged
        pass
    directory = debug_dir(trainer)
    return Result(read_events(directory), read_report(directory), time.perf_counter() - started, module)


def run_one(case: PlantCase, model: str, level: str, root: Path) -> dict[str, Any]:
    from tests.harness.zoo import Plant, defaults

    config = defaults(**dict(case.overrides, **({"level": "advanced"} if level == "advanced" else {})))
    started = time.perf_counter()
    result = _fit(model, Plant(**case.plant), config, root, case.steps)
    found = [e for e in result.serious() if e["kind"] in case.kinds]
    hits = [e for e in found if e.get("step") is not None and case.steps_ok(int(e["step"]))]
    first = min(hits, key=lambda e: e["step"]) if hits else None
    cause = bool(first is not None and case.cause(first, result, level, model))
    others = sorted({f"{e['kind']}@{e.get('step')}" for e in result.serious() if e["kind"] not in case.kinds})
    return {"plant": case.name, "model": model, "level": level, "recalled": first is not None, "cause": cause,
            "kind": first["kind"] if first else None, "step": first["step"] if first else None,
            "found": sorted({f"{e['kind']}@{e.get('step')}" for e in found}), "others": others,
            "message": (first or {}).get("message", "")[:300], "seconds": round(time.perf_counter() - started, 1)}


def write_table(out: Path, rows: list[dict[str, Any]]) -> str:
    lines = ["| level | runs | recalled | cause right (of recalled) | recall | cause accuracy |", "|---|---|---|---|---|---|"]
    for level in LEVELS:
        mine = [r for r in rows if r["level"] == level and "error" not in r]
        if not mine:
            continue
        recalled = [r for r in mine if r["recalled"]]
        right = [r for r in recalled if r["cause"]]
        lines.append(f"| {level} | {len(mine)} | {len(recalled)} | {len(right)} | {len(recalled) / len(mine):.0%} "
                     f"| {len(right) / max(1, len(recalled)):.0%} |")
    lines += ["", "| plant | model | level | named at its step | cause right | other findings (warning+) |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['plant']} | {r['model']} | {r['level']} | run failed: {r['error'][:120]} | | |")
            continue
        named = f"{r['kind']}@{r['step']}" if r["recalled"] else f"**missed** ({', '.join(r['found']) or 'nothing'})"
        lines.append(f"| {r['plant']} | {r['model']} | {r['level']} | {named} | {'yes' if r['cause'] else '**no**'} "
                     f"| {', '.join(r['others']) or '-'} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="plant names")
    parser.add_argument("--models", nargs="*", help="model names")
    parser.add_argument("--levels", nargs="*", default=list(LEVELS), choices=LEVELS)
    args = parser.parse_args()
    from tests.harness.quiet import quiet_process

    quiet_process()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for case in PLANTS:
        if args.only and case.name not in args.only:
            continue
        for model in case.models:
            if args.models and model not in args.models:
                continue
            for level in args.levels:
                with tempfile.TemporaryDirectory(prefix=f"plant-{case.name}-{model}-") as root:
                    try:
                        row = run_one(case, model, level, Path(root))
                    except Exception as error:  # noqa: BLE001 - recorded, the matrix goes on
                        row = {"plant": case.name, "model": model, "level": level,
                               "error": f"{type(error).__name__}: {error}"}
                rows.append(row)
                with open(args.out / "results.jsonl", "a") as handle:
                    handle.write(json.dumps(row) + "\n")
                print(json.dumps({k: row.get(k) for k in ("plant", "model", "level", "recalled", "cause", "error")}),
                      flush=True)
    sys.stdout.write(write_table(args.out, rows))


if __name__ == "__main__":
    main()
