"""Invariant 1 of issue 45, in the one place that decides it: a report whose sections measured a non-finite value is
never called clean, whatever the findings (a rule's exemption, an info-level note, no finding at all)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_debug.report.document import build_report, render_markdown
from lightning_debug.report.measured import nothing_found
from lightning_debug.report.summary import plot_worth_drawing, summary_lines

GRADIENTS = {"checks": 20, "check_frequency": 1, "counts": {"exploding_checks": 0, "vanishing_checks": 0,
                                                           "missing_checks": 0, "frozen_checks": 0}}
NONFINITE = {"first_step": 2, "last_step": 19, "steps": 18}


def report(findings: dict[str, Any], nonfinite: dict[str, Any] | None) -> dict[str, Any]:
    section: dict[str, Any] = dict(GRADIENTS, findings=findings)
    if nonfinite is not None:
        section["nonfinite"] = nonfinite
    return build_report(status="finished", step=20, sections={"gradients": section}, config={})


NOTE = {"weight_decay_on_norm": {"episodes": 1, "steps": 1, "first_step": 0, "last_step": 0, "severity": "info",
                                 "first_message": "Weight decay on norms."}}


@pytest.mark.parametrize("findings", [{}, NOTE], ids=["no finding", "an info note"])
@pytest.mark.parametrize("what", ["gradients", "loss", "parameters", "buffers"])
def test_a_non_finite_measurement_is_never_called_clean(findings: dict[str, Any], what: str) -> None:
    built = report(findings, {what: NONFINITE})
    markdown, console = render_markdown(built), " ".join(summary_lines(built, {}))
    assert "No problems found" not in markdown and "nothing wrong found" not in console
    assert "non-finite at steps 2-19 (18 check step(s), measured by the gradients checks)" in markdown
    assert "non-finite at steps 2-19" in console and "non-finite values measured" in console
    assert not nothing_found(built) and plot_worth_drawing(built)


def test_the_gradient_section_states_the_steps_and_the_twin_without_them_is_clean() -> None:
    built = report({}, {"gradients": NONFINITE})
    stated = "**Non-finite gradients** (global norm Inf or NaN) at 18 check step(s), steps 2-19."
    assert stated in render_markdown(built)
    clean = report({}, None)
    assert "No problems found." in render_markdown(clean) and "nothing wrong found" in summary_lines(clean, {})[0]
    assert nothing_found(clean) and not plot_worth_drawing(clean)


def test_with_findings_the_measurement_is_still_stated_under_the_headline() -> None:
    warning = {"exploding_grad": {"episodes": 1, "steps": 1, "first_step": 1, "last_step": 1, "severity": "warning",
                                  "first_message": "Gradients are exploding at step 1."}}
    markdown = render_markdown(report(warning, {"gradients": NONFINITE}))
    assert "Found 1 kind(s) of problem: 1 warning.\n\nNon-finite values were measured: gradients were non-finite " \
           "at steps 2-19" in markdown
