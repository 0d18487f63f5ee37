"""The layering of the package, checked from every module's imports (function-level ones included).

checks (pure tensor functions) < core (framework-free machinery) < monitors (the four areas)
< report (what people read) < run (the one orchestrator) < adapters (callbacks, accelerate), entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_debug"
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate")
ADAPTERS_AND_ENTRY_POINTS = ("callbacks", "accelerate", "presets", "cli", "demo", "__main__")

# layer -> the lightning_debug modules (first component after the package) it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "checks": ("core", "config", "errors", "monitors", "report", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "core": ("monitors", "report", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "monitors": ("report", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "report": ("monitors", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "run": ADAPTERS_AND_ENTRY_POINTS,
    "accelerate": ("callbacks", "presets", "cli", "demo"),
    "config": ("checks", "core", "monitors", "report", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "errors": ("checks", "core", "config", "monitors", "report", "run", *ADAPTERS_AND_ENTRY_POINTS),
    "config_types": ("checks", "core", "config", "errors", "monitors", "report", "run", *ADAPTERS_AND_ENTRY_POINTS),
}
FRAMEWORK_FREE = ("checks", "core", "monitors", "report", "run", "config", "config_types", "errors")


def imported_modules(source: str) -> set[str]:
    """Every absolute module name an ``import`` / ``from ... import`` statement in ``source`` names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            if node.module == "lightning_debug":  # ``from lightning_debug import x`` reaches the package root
                names.add("lightning_debug.__init__")
    return names


def violations(layer: str, source: str) -> list[str]:
    """The imports of a module of ``layer`` that run the wrong way or reach a training framework."""
    found = []
    for name in sorted(imported_modules(source)):
        parts = name.split(".")
        if parts[0] == "lightning_debug":
            target = parts[1] if len(parts) > 1 else "__init__"
            if target in FORBIDDEN.get(layer, ()) or (target == "__init__" and layer in FORBIDDEN):
                found.append(name)
        elif layer in FRAMEWORK_FREE and parts[0] in FRAMEWORKS:
            found.append(name)
    return found


def layer_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


MODULES = sorted(path for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" or path.parent != PACKAGE)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_imports_run_down_the_layers(path: Path) -> None:
    assert violations(layer_of(path), path.read_text(encoding="utf-8")) == []


def test_the_check_catches_an_upward_import_even_inside_a_function() -> None:
    source = "import torch\n\ndef late():\n    from lightning_debug.monitors.anomaly import AnomalyMonitor\n"
    assert violations("core", source) == ["lightning_debug.monitors.anomaly"]
    assert "lightning_debug" in violations("checks", "from lightning_debug import DebugConfig\n")
    assert violations("run", "import lightning.pytorch as pl\n") == ["lightning.pytorch"]
    assert violations("callbacks", "import lightning.pytorch as pl\nfrom lightning_debug.run import Run\n") == []


def test_every_module_is_in_a_known_layer() -> None:
    known = {*FORBIDDEN, *FRAMEWORK_FREE, *ADAPTERS_AND_ENTRY_POINTS, "_version", "__init__"}
    assert {layer_of(path) for path in MODULES} <= known


MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> set[str]:
    """The package modules ``path`` imports (``from pkg import module`` counted as the module), leaving out
    imports under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    known = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known and name.startswith("lightning_debug")}


def test_no_import_circle() -> None:
    """Within a layer too: a circle makes import order matter and hides which module depends on which."""
    graph = {module_name(path): package_imports(path) - {module_name(path)} for path in PACKAGE.rglob("*.py")}
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                circles.append(trail[trail.index(target):] + [target] if target in trail else [name, target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_modules_and_classes_stay_small(path: Path) -> None:
    """A loose bound that catches real outliers only (modules are cut by concern, not by count): a module over 800
    lines or a class over 600 is several concerns glued together: split it."""
    source = path.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    big = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert big == []
