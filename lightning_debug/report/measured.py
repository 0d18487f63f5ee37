"""What the callbacks measured, stated whatever the rules concluded: the one place that decides whether a
report may say "No problems found" or "nothing wrong found".

A rule may stay quiet on purpose (a step its exemption covers), but a value measured non-finite is not an
opinion: a run with one is never called clean. Each area's section lists it under ``nonfinite``.

Example::

    >>> report = {"findings": {}, "sections": {"gradients": {"nonfinite": {"gradients": {
    ...     "first_step": 2, "last_step": 19, "steps": 18}}}}}
    >>> nonfinite_measured(report)
    ['gradients were non-finite at steps 2-19 (18 check step(s), measured by the gradients checks)']
    >>> nothing_found(report), nothing_found({"findings": {}, "sections": {}})
    (False, True)
"""

from __future__ import annotations

from typing import Any

from lightning_debug.core.kinds import Severity

NONFINITE = "nonfinite"
SUBJECTS = {"gradients": "gradients were", "loss": "the loss was", "parameters": "parameters were",
            "buffers": "buffers were", "inputs": "inputs were"}


def step_span(fact: dict[str, Any]) -> str:
    """``step 3`` or ``steps 3-9``: where a finding or a measurement was."""
    first, last = fact.get("first_step"), fact.get("last_step")
    return f"step {first}" if first == last else f"steps {first}-{last}"


def nonfinite_measured(report: dict[str, Any]) -> list[str]:
    """One sentence per non-finite measurement an area's section states."""
    sentences = []
    for area, section in (report.get("sections") or {}).items():
        facts = section.get(NONFINITE) if isinstance(section, dict) else None
        for what, fact in (facts or {}).items():
            if isinstance(fact, dict) and fact.get("steps"):
                subject = SUBJECTS.get(what, f"{what} were")
                sentences.append(f"{subject} non-finite at {step_span(fact)} ({fact['steps']} check step(s), "
                                 f"measured by the {area} checks)")
    return sentences


def untrained(report: dict[str, Any]) -> bool:
    """Whether the run saw no training batch (an empty training DataLoader, ``drop_last`` with a batch larger than
    the data set, ``limit_train_batches=0``): no check ran, so the report may not say it found nothing::

        >>> untrained({"training_batches": 0}), untrained({"training_batches": 3}), untrained({})
        (True, False, False)
    """
    return report.get("training_batches") == 0


UNTRAINED = ("No training batch ran, so no check ran: the training DataLoader gave no batch (an empty data set, "
             "drop_last=True with a batch_size larger than the data set) or limit_train_batches is 0.")


def nothing_found(report: dict[str, Any], serious_only: bool = False) -> bool:
    """Whether the report may say it found nothing: no finding (``serious_only``: of severity warning or above),
    nothing measured non-finite and at least one training batch checked."""
    if untrained(report):
        return False
    findings = report.get("findings") or {}
    if serious_only:
        findings = {kind: entry for kind, entry in findings.items()
                    if isinstance(entry, dict) and Severity.parse(entry.get("severity")).at_least(Severity.WARNING)}
    return not findings and not nonfinite_measured(report)


def measured_line(report: dict[str, Any]) -> str | None:
    """report.md's line under its headline stating what was measured non-finite, or None.

    Example::

        >>> line = measured_line({"findings": {}, "sections": {"gradients": {"nonfinite": {"gradients": {
        ...     "first_step": 3, "last_step": 3, "steps": 1}}}}})
        >>> print(line.replace(": ", ":\\n"))
        Non-finite values were measured, though no rule raised a finding:
        gradients were non-finite at step 3 (1 check step(s), measured by the gradients checks).
    """
    sentences = nonfinite_measured(report)
    if not sentences:
        return None
    lead = "Non-finite values were measured" + ("" if report.get("findings") else ", though no rule raised a finding")
    return f"{lead}: {'; '.join(sentences)}."


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _watched(report: dict[str, Any]) -> str:
    return _listed(list(report.get("watched") or ["run-wide"]))


def unwatched_sentence(report: dict[str, Any]) -> str | None:
    """report.md's sentence after "No problems found" when some callback areas did not run, or None: a clean
    report of the gradient checks alone says nothing of a loss that oscillated or memory that leaked.

    Example::

        >>> print(unwatched_sentence({"watched": ["anomaly", "gradients"], "unwatched": [
        ...     {"area": "memory", "watches": "memory", "callback": "MemoryProfilerCallback"}]}))
        Only the anomaly and gradients checks ran: memory (`MemoryProfilerCallback`) was not watched.
        >>> unwatched_sentence({"watched": ["anomaly"], "unwatched": []}) is None
        True
    """
    rows = report.get("unwatched") or []
    if not rows:
        return None
    missing = _listed([f"{row['watches']} (`{row['callback']}`)" for row in rows])
    return f"Only the {_watched(report)} checks ran: {missing} {'was' if len(rows) == 1 else 'were'} not watched."


def unwatched_note(report: dict[str, Any]) -> str:
    """The console's short form of :func:`unwatched_sentence`, or an empty string.

        >>> unwatched_note({"watched": ["gradients"], "unwatched": [{"watches": "memory"}, {"watches": "step time"}]})
        ' in gradients (memory and step time not watched)'
    """
    rows = report.get("unwatched") or []
    return f" in {_watched(report)} ({_listed([row['watches'] for row in rows])} not watched)" if rows else ""
