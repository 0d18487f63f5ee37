"""The package logs through Lightning's public API only: no name of its private result collection or logger connector.

Lightning moves these between versions (``trainer._results``, ``_logger_connector.should_update_logs``,
``_ResultMetric.has_reset``), and a write into them that a new version no longer reads fails silently: the debug
scalars vanish from the user's rows. Read from the syntax tree, so a local variable that happens to be called
``update_metrics`` is not an access to Lightning's method, while ``getattr(trainer, "_results")`` is.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_debug"
PRIVATE_LOGGING = frozenset({
    "_results", "_logger_connector", "_ResultCollection", "_ResultMetric", "update_metrics", "has_reset",
    "should_reset_tensors", "should_update_logs", "valid_items", "_batches_that_stepped", "_should_accumulate",
    "_first_loop_iter", "_current_fx_name", "_logged_metrics", "_callback_metrics",
})


def private_logging_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every attribute access, imported name or string constant in ``source`` that is one of
    :data:`PRIVATE_LOGGING`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if name in PRIVATE_LOGGING:
            found.append((getattr(node, "lineno", 0), name))
    return found


def test_the_check_sees_an_access_and_not_a_local_name() -> None:
    source = 'results = getattr(trainer, "_results")\nresults.update_metrics(k, v, 1)\nupdate_metrics = 3\n'
    assert private_logging_names(source) == [(1, "_results"), (2, "update_metrics")]


def test_no_private_lightning_logging_names_in_the_package() -> None:
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for line, name in private_logging_names(path.read_text(encoding="utf-8"))]
    assert not offenders, "private Lightning logging internals used:\n" + "\n".join(offenders)
