"""What a gradient rule returns: :class:`~lightning_debug.core.rules.Recorded`, the one shape every area's rules
record (a finding, the names it flags, its episode key, the steps it is recorded at), and the bounds on names shown::

    >>> from lightning_debug.core.kinds import Kind, Severity
    >>> Verdict(Finding(Kind.MISSING_GRAD, Severity.WARNING, "m"), ["a"]).finding.kind
    <Kind.MISSING_GRAD: 'missing_grad'>
"""

from __future__ import annotations

from lightning_debug.core.findings import Finding, quoted
from lightning_debug.core.rules import Recorded as Verdict

NAMES_IN_DETAILS = 20
WORST_SHOWN = 5

__all__ = ["NAMES_IN_DETAILS", "WORST_SHOWN", "Verdict", "quoted"]
