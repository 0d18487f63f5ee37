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
                 "activations": "activations", "loop": "loop", "repeats": "loop", "errors": "errors"}
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
