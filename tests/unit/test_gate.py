"""The gate's bookkeeping on one process (the two-process behaviour is tests/integration/test_fault_injection.py)."""

from __future__ import annotations

import torch

from lightning_debug.core.gate import Gate, Planned, Shape
from lightning_debug.core.guard import Failures


def test_a_collective_asked_out_of_order_makes_the_planned_ones_before_it_and_close_makes_the_rest() -> None:
    gate = Gate(Failures())
    gate.open(7, [Planned("replay", Shape.OBJECTS), Planned("rows", Shape.OBJECTS), Planned("scan", Shape.SUM, 3),
                  Planned("stragglers", Shape.ROWS, 2)])
    total, empty = gate.sum("scan", lambda: torch.tensor([0.0, 1.0, 0.0]), 3)
    assert total.tolist() == [0.0, 1.0, 0.0] and empty == 0
    assert [name for _, name in gate.log] == ["replay", "rows", "scan"], "the skipped ones first, in plan order"
    gate.close()
    assert [name for _, name in gate.log] == ["replay", "rows", "scan", "stragglers"] and not gate.due("stragglers")


def test_a_contribution_that_raises_is_an_empty_one_flagged_and_a_failed_check() -> None:
    failures = Failures()
    gate = Gate(failures)
    gate.open(2, [Planned("scan", Shape.SUM, 2)])
    total, empty = gate.sum("scan", lambda: 1 / 0, 2)
    assert total.tolist() == [0.0, 0.0] and empty == 1
    assert "contributing to the scan collective" in failures.summary()
    assert gate.gather("rows", lambda: [][1]) == [None]
    assert torch.isnan(gate.rows("stragglers", None, 3)).all()


def test_a_rank_whose_deciding_check_failed_sends_no_decision_of_its_own() -> None:
    gate = Gate(Failures())
    assert gate.agree(2, failed=False).decision == 2
    agreement = gate.agree(1, failed=True)
    assert agreement.decision == 0 and agreement.failed_ranks == [0] and not agreement.raised
    assert gate.agree(0, failed=False, raised=True).raised
