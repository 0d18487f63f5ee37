"""The one table of kinds: every kind has a spec, a docs row, and the derived views agree with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_debug.core.kinds import (
    ADVICE, CAUSAL_ORDER, COMMON_CAUSES, HINTS, KIND_SPECS, Kind, KindSpec, Severity, advice_for, causal_rank,
    hint_for,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_kind_has_a_spec() -> None:
    assert set(KIND_SPECS) == set(Kind)
    assert all(isinstance(spec, KindSpec) for spec in KIND_SPECS.values())


def test_specs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        KIND_SPECS[Kind.OOM].severity = Severity.INFO  # type: ignore[misc]


def _documented_kinds() -> set[str]:
    rows = set()
    for page in DOCS.glob("*.md"):
        rows |= set(re.findall(r"^\| `([a-z_]+)`", page.read_text(encoding="utf-8"), re.M))
    return rows


@pytest.mark.parametrize("kind", list(Kind), ids=str)
def test_every_kind_has_a_row_in_the_docs(kind: Kind) -> None:
    assert kind.value in _documented_kinds(), f"no docs/*.md table row starts with `{kind.value}`"


def test_views_are_derived_from_the_table() -> None:
    assert ADVICE == {kind: spec.advice for kind, spec in KIND_SPECS.items() if spec.advice}
    assert HINTS == {kind: spec.hint for kind, spec in KIND_SPECS.items() if spec.hint}
    assert COMMON_CAUSES[Kind.NONFINITE_LOSS] in ADVICE[Kind.NONFINITE_LOSS]
    assert set(CAUSAL_ORDER) == {kind for kind, spec in KIND_SPECS.items() if spec.causal_rank is not None}


def test_lookups_by_string() -> None:
    assert causal_rank("nonfinite_input") < causal_rank("nonfinite_loss") < causal_rank("nonfinite_param")
    assert causal_rank("exploding_grad") == causal_rank("not_a_kind") == len(CAUSAL_ORDER)
    assert advice_for("oom") == KIND_SPECS[Kind.OOM].advice and advice_for("not_a_kind") is None
    assert hint_for("requires_grad_false") is None


def test_the_docs_show_every_confirmation_policy_as_the_table_declares_it() -> None:
    from lightning_debug.core.kinds import policy_rows

    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    documented = [line for line in page.splitlines() if re.match(r"^\| `[a-z_]+` \| ", line)]
    assert policy_rows() and documented == policy_rows()


@pytest.mark.parametrize("name", ["AnomalyDetectionCallback", "GradientHealthCallback", "MemoryProfilerCallback",
                                  "PerformanceProfilerCallback"])
def test_each_callback_says_every_kind_its_areas_report(name: str) -> None:
    import lightning_debug
    from lightning_debug.monitors.areas import AREA_SPECS

    callback = getattr(lightning_debug, name)
    areas = {area for area, spec in AREA_SPECS.items() if spec.callback == name} | {
        companion for area, spec in AREA_SPECS.items() if spec.callback == name for companion in spec.companions}
    kinds = [kind.value for kind, spec in KIND_SPECS.items() if spec.area in areas]
    assert kinds and [kind for kind in kinds if f"``{kind}``" not in (callback.__doc__ or "")] == []


MONITOR_AREAS = {"anomaly": "anomaly", "gradients": "gradients", "memory": "memory", "performance": "performance",
                 "activations": "activations", "mixing": "activations", "loop": "loop", "repeats": "loop",
                 "errors": "errors"}
NOT_A_MONITOR = {"__init__", "areas"}


def test_every_module_of_monitors_belongs_to_an_area() -> None:
    """A new module in ``monitors/`` names its area here, so the two tests below read its kinds."""
    monitors = Path(__file__).resolve().parents[2] / "lightning_debug" / "monitors"
    tops = {path.relative_to(monitors).parts[0].removesuffix(".py") for path in monitors.rglob("*.py")}
    assert sorted(tops - set(MONITOR_AREAS) - NOT_A_MONITOR) == []


def test_every_monitor_writes_only_the_kinds_its_row_of_the_table_gives_its_area() -> None:
    """A kind belongs to one area (its ``KindSpec.area``): a finding or suspicion of it is made in that area's
    monitor package only, so the table says which callback reports it."""
    monitors = Path(__file__).resolve().parents[2] / "lightning_debug" / "monitors"
    wrong = []
    for path in sorted(monitors.rglob("*.py")):
        area = MONITOR_AREAS.get(path.relative_to(monitors).parts[0].removesuffix(".py"))
        if area is None:
            continue
        for name in re.findall(r"(?:Finding|Suspicion)\(\s*Kind\.([A-Z_]+)", path.read_text(encoding="utf-8")):
            if KIND_SPECS[Kind[name]].area.value != area:
                wrong.append((path.name, name, KIND_SPECS[Kind[name]].area.value))
    assert wrong == []


def test_every_kind_is_made_in_its_areas_monitor_package_and_each_monitor_closes_only_its_areas_kinds() -> None:
    """Adding a check: a kind added to the table with no rule making it, or a monitor's ``kinds`` (the episodes it
    closes) naming a kind of another area, fails here (docs/architecture.md, "Adding a check")."""
    from lightning_debug.monitors.areas import AREA_SPECS

    monitors = Path(__file__).resolve().parents[2] / "lightning_debug" / "monitors"
    made: set[str] = set()
    for path in monitors.rglob("*.py"):
        if MONITOR_AREAS.get(path.relative_to(monitors).parts[0].removesuffix(".py")) is not None:
            made.update(re.findall(r"(?:Finding|Suspicion)\(\s*Kind\.([A-Z_]+)", path.read_text(encoding="utf-8")))
    assert [kind.name for kind in KIND_SPECS if kind.name not in made] == []
    wrong = {area.value: sorted(kind.value for kind in spec.monitor.kinds if KIND_SPECS[kind].area is not area)
             for area, spec in AREA_SPECS.items()}
    assert {area: kinds for area, kinds in wrong.items() if kinds} == {}


DIRECT = {
    Kind.NONFINITE_LOSS: "the anomaly check: one decision per check step for every rank (skip, stop, raise)",
    Kind.NONFINITE_GRAD: "the anomaly check",
    Kind.NONFINITE_PARAM: "the anomaly check",
    Kind.NONFINITE_ACTIVATION: "the anomaly check's replay",
    Kind.NONFINITE_BUFFER: "the anomaly check, after a skipped step",
    Kind.AMP_OVERFLOW_SKIPPED: "the anomaly check",
    Kind.NONFINITE_INPUT: "the anomaly check of a batch",
    Kind.LOSS_SPIKE: "LossJudge: baselines of the run's losses across checks",
    Kind.LOSS_OUTLIER: "LossJudge",
    Kind.LOSS_DIVERGENCE: "LossJudge",
    Kind.EXPLODING_GRAD: "follow-up norms measured on the steps after a jump (Explosions)",
    Kind.VANISHING_GRAD: "per-layer positions and the first check's norms, kept by the plumbing",
    Kind.MISSING_GRAD: "candidates watched between check steps (CandidateWatch)",
    Kind.INTERMITTENT_GRAD: "missing_grad's history",
    Kind.FROZEN_PARAM: "the optimizer's groups at fit start and the update measured after the step",
    Kind.OUTSIDE_TRAINING: "parameters watched from fit start on",
    Kind.UPDATE_RATIO_HIGH: "the update measured after the optimizer step",
    Kind.MEMORY_GROWTH: "the trend's windows, censuses and allocation history across readings",
    Kind.SLOW_STEP: "the run of slow steps and its level",
    Kind.DATALOADER_BOTTLENECK: "the data wait's history and the loader",
    Kind.STRAGGLER_RANK: "per-rank times gathered by a collective",
    Kind.DEAD_ACTIVATION: "forward hooks of one check step",
    Kind.SATURATED_ACTIVATION: "forward hooks of one check step",
    Kind.GRAD_NOT_ZEROED: "backward hooks and the norms read back",
    Kind.REPEATED_BATCH: "the window of batches of a check step",
    Kind.REPLICAS_DIVERGED: "every rank's replica norms, carried by the check step's one all-reduce",
    Kind.SINGLE_CLASS_BATCHES: "the labels read by the activation monitor's hook on the output's gradient",
    Kind.STEPS_NOT_COUNTED: "every training batch's step counter and the optimizers' step hooks (Unstepped)",
}
"""Kinds whose rules the plumbing still calls directly, and the state that keeps them there
(docs/architecture.md, "Adding a check"); a new kind is made by a registered rule or is listed here."""


def test_every_kind_is_made_by_a_registered_rule_a_one_off_path_or_a_rule_listed_as_called_directly() -> None:
    import lightning_debug.monitors  # noqa: F401  (registers every area's rules)
    from lightning_debug.core.rules import all_rules

    registered = {kind for known in all_rules() for kind in known.kinds}
    one_off = {kind for kind, spec in KIND_SPECS.items() if spec.one_off}
    assert {Kind.WEIGHT_DECAY_ON_NORM, Kind.LEARNING_STALLED, Kind.MEMORY_HIGH, Kind.EVAL_MODE_IN_TRAINING} <= registered
    assert sorted(set(Kind) - registered - one_off - set(DIRECT)) == []
    assert sorted(registered & set(DIRECT)) == []  # a kind moved to a registered rule leaves the list


def test_a_rule_makes_kinds_of_one_area_and_runs_in_that_area() -> None:
    from lightning_debug.core.rules import Moment, all_rules, rule

    import lightning_debug.monitors  # noqa: F401
    assert all(KIND_SPECS[kind].area is known.area for known in all_rules() for kind in known.kinds)
    with pytest.raises(ValueError, match="one area"):
        rule(Kind.MEMORY_HIGH, Kind.SLOW_STEP, at=Moment.CHECK_READ)


def test_each_monitors_kinds_are_its_areas_rows_of_the_table_less_the_one_off_kinds() -> None:
    """No monitor keeps a list of its kinds: ``Monitor.kinds`` is made from ``KindSpec.area`` and ``one_off``."""
    import ast

    from lightning_debug.core.kinds import kinds_of
    from lightning_debug.monitors.areas import AREA_SPECS

    for area, spec in AREA_SPECS.items():
        assert spec.monitor.kinds == kinds_of(area) == {
            kind for kind, row in KIND_SPECS.items() if row.area is area and not row.one_off}
    monitors = Path(__file__).resolve().parents[2] / "lightning_debug" / "monitors"
    assigned = [path.name for path in monitors.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ClassDef) for item in node.body
                if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == "kinds" for t in item.targets)]
    assert assigned == []


def test_no_monitor_imports_a_registered_rules_judges_by_hand() -> None:
    """The plumbing runs registered rules through ``Monitor.run_rules``: a monitor module that imports a judge of
    a module that registers rules calls it by hand (a second path, and an edit per new rule)."""
    import ast
    import sys

    import lightning_debug.monitors  # noqa: F401
    from lightning_debug.core.rules import all_rules

    judges: dict[str, set[str]] = {}  # per registering module: its rules and the functions of its own they call
    for known in all_rules():
        module = known.judge.__module__
        own = {name for name, value in vars(sys.modules[module]).items()
               if callable(value) and getattr(value, "__module__", None) == module}
        judges.setdefault(module, set()).update({known.judge.__name__} | (own & set(known.judge.__code__.co_names)))
    monitors = Path(__file__).resolve().parents[2] / "lightning_debug" / "monitors"
    by_hand = [(path.name, node.module, alias.name)
               for path in monitors.rglob("*.py") if path.stem in ("monitor", "loop", "errors", "activations")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               for alias in node.names if node.module in judges and alias.name in judges[node.module]]
    assert judges and by_hand == []


def test_each_callback_lists_its_kinds_as_the_table_words_them() -> None:
    import lightning_debug
    from lightning_debug.core.kinds import kind_lines
    from lightning_debug.monitors.areas import AREA_SPECS

    for area, spec in AREA_SPECS.items():
        if spec.callback is None:
            continue
        doc = getattr(lightning_debug, spec.callback).__doc__
        assert "\n".join(kind_lines((area, *spec.companions))) in doc
