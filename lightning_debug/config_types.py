"""The constrained number types of :class:`~lightning_debug.DebugConfig` fields and the callbacks' overrides.

LightningCLI (jsonargparse) checks a value against its annotation while it parses the YAML file or the
command line, so a frequency of 0 or a share of 1.5 is a usage error (exit code 2, the field named, no
traceback) instead of a ``ValueError`` raised from ``__post_init__`` after parsing. Python does not check
annotations: the dataclass still validates every value at construction, with the same bounds, so
``DebugConfig(anomaly_check_frequency=0)`` keeps raising a ``ValueError`` naming the field. Without
jsonargparse (it comes with ``lightning-debug[cli]``) the names are plain ``int`` and ``float``.

Example::

    >>> PositiveInt(3) == 3, UnitFraction(0.5) == 0.5
    (True, True)
"""

from __future__ import annotations

import math
from typing import Any

MAX_PROFILE_STEPS = 50
"""The longest torch.profiler window: the profiler keeps every recorded operator event in memory until
the window ends and writes them all to one trace (measured: 145 MB of trace and +100 MB RSS over 1,500
steps of a small model), so a window of a few steps is what a trace is for."""

PositiveInt: Any
NonNegativeInt: Any
FiniteNonNegativeFloat: Any
UnitFraction: Any
AboveOne: Any
ProfileLength: Any
NotEmptyStr: Any

try:
    from jsonargparse.typing import NonNegativeInt, NotEmptyStr, PositiveInt, restricted_number_type
except ImportError:  # no LightningCLI without it: plain types, the dataclass still validates
    PositiveInt = NonNegativeInt = ProfileLength = int
    NotEmptyStr = str
    FiniteNonNegativeFloat = UnitFraction = AboveOne = float
else:
    FiniteNonNegativeFloat = restricted_number_type("FiniteNonNegativeFloat", float,
                                                    [(">=", 0), ("<", math.inf)], join="and")
    UnitFraction = restricted_number_type("UnitFraction", float, [(">", 0), ("<=", 1)], join="and")
    AboveOne = restricted_number_type("AboveOne", float, [(">", 1), ("<", math.inf)], join="and")
    ProfileLength = restricted_number_type("ProfileLength", int, [(">=", 0), ("<=", MAX_PROFILE_STEPS)], join="and")

ALLOWED = {
    "PositiveInt": "an integer >= 1", "NonNegativeInt": "an integer >= 0", "NotEmptyStr": "a string that is not blank",
    "FiniteNonNegativeFloat": "a finite number >= 0", "UnitFraction": "a number in (0, 1]",
    "AboveOne": "a finite number > 1", "ProfileLength": f"an integer in [0, {MAX_PROFILE_STEPS}]",
}
"""Each type's bounds in words, by the type's name (how a parse error names it): what a short error says is allowed."""

__all__ = ["ALLOWED", "AboveOne", "FiniteNonNegativeFloat", "MAX_PROFILE_STEPS", "NonNegativeInt", "NotEmptyStr",
           "PositiveInt", "ProfileLength", "UnitFraction"]
