"""What a gradient rule returns: a finding it wrote itself, the names it flags and its episode key.

Example::

    >>> from lightning_debug.core.kinds import Kind, Severity
    >>> Verdict(Finding(Kind.MISSING_GRAD, Severity.WARNING, "m"), ["a"]).finding.kind
    <Kind.MISSING_GRAD: 'missing_grad'>
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_debug.core.findings import Finding, quoted

NAMES_IN_DETAILS = 20
WORST_SHOWN = 5


@dataclass
class Verdict:
    """One finding of a rule, the names it counts in ``most_flagged`` and the key of its episode.

    ``steps``: the check steps it is recorded at, in order, when a rule confirms over several check steps
    a condition that began before this one (empty: the step being judged).
    """

    finding: Finding
    flagged: list[str] = field(default_factory=list)
    key: str = ""
    steps: list[int] = field(default_factory=list)


__all__ = ["NAMES_IN_DETAILS", "WORST_SHOWN", "Verdict", "quoted"]
