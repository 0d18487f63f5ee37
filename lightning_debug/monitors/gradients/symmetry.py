"""``symmetric_units``: a layer whose units are copies of one another, weights and gradient alike.

Initialized with every unit the same (``nn.init.constant_(layer.weight, 0.1)``, one row copied into all), the units of
a layer compute the same output, receive the same gradient and take the same step, so they stay copies for the whole
run: a layer of 32 units works as one, and nothing is NaN, vanishing or exploding. On check steps at least
:data:`SAMPLE_EVERY` apart, :class:`UnitSpread` measures how far the first :data:`ROWS` units (the first dimension of a
parameter of two or more) lie from the first one, in the weights and in the gradient (device work, read back without
a sync). Both must be copies within :data:`COPIES` of their size: a zero-initialized layer (LoRA's ``B``, a
zero-initialized projection or head) has equal rows too, but each unit's gradient differs, and its first step breaks
the tie; random weights whose gradient rows agree (a mean over the units) are not copies either. Held two readings::

    >>> from lightning_debug.core.verdicts import VerdictEngine
    >>> engine = VerdictEngine()
    >>> spreads = {"layers.0.weight": (32, 0.0, 0.1, 0.0, 0.02), "head.weight": (4, 0.3, 0.4, 0.01, 0.02)}
    >>> judge_symmetry(0, spreads, engine), judge_symmetry(50, None, engine)  # held; not read at 50
    (None, None)
    >>> verdict = judge_symmetry(100, spreads, engine)
    >>> verdict.finding.details["parameters"], verdict.finding.details["units"], verdict.steps
    (['layers.0.weight'], [32], [0, 100])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding, quoted
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.readback import Readback
from lightning_debug.core.rules import CheckRead, Moment, rule
from lightning_debug.core.verdicts import Suspicion, VerdictEngine
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict

KEY = "symmetric_units"
SAMPLE_EVERY = 100
"""Optimizer steps at least between two readings (with checks every step, one in 100 is measured)."""
ROWS = 64
COLUMNS = 4096
"""The units read (a parameter's first dimension) and the values of each: enough to tell copies, a bounded cost."""
COPIES = 1e-5
"""How far a unit may lie from the first, as a share of the largest value read, and be its copy (rounding of a
reduction done in another order)."""
SPREAD = ("weight_spread", "weight_size", "grad_spread", "grad_size")

Spreads = Mapping[str, tuple[float, ...]]
"""Per parameter: its units, then :data:`SPREAD`."""


def unit_spread(parameter: torch.Tensor) -> torch.Tensor:
    """:data:`SPREAD` of ``parameter`` and its gradient over their first :data:`ROWS` units, on the device: the largest
    distance of a value from the first unit's, and the largest value::

        >>> weight = torch.full((8, 3), 0.1, requires_grad=True)
        >>> (weight.sum(0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        >>> [round(value, 4) for value in unit_spread(weight).tolist()]
        [0.0, 0.1, 0.0, 3.0]
    """
    read = [t.detach()[:ROWS].reshape(min(ROWS, t.shape[0]), -1)[:, :COLUMNS].float()
            for t in (parameter, parameter.grad)]
    return torch.stack([value for rows in read for value in ((rows - rows[:1]).abs().amax(), rows.abs().amax())])


def judged(parameter: Any) -> bool:
    """Whether a parameter has units to compare: two or more along a first dimension of a tensor of two or more, a
    dense real gradient."""
    grad = parameter.grad
    return (parameter.requires_grad and parameter.dim() >= 2 and parameter.shape[0] >= 2 and parameter.numel() > 0
            and parameter.is_floating_point() and grad is not None and grad.layout is torch.strided
            and grad.shape == parameter.shape)


class UnitSpread:
    """Measures :func:`unit_spread` of every judged parameter on check steps at least :data:`SAMPLE_EVERY` apart;
    ``step``: the last one read (checkpointed, so a resumed run reads at the same steps)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def measure(self, step: int, names: Sequence[str],
                params: Sequence[Any]) -> tuple[Readback, list[tuple[str, int]]] | None:
        """This check step's read-back and the (name, units) of each parameter in it, or None when not due."""
        if self.step is not None and 0 <= step - self.step < SAMPLE_EVERY:
            return None
        chosen = [(name, parameter) for name, parameter in zip(names, params) if judged(parameter)]
        if not chosen:
            return None
        self.step = step
        try:
            with torch.no_grad():
                device = chosen[0][1].device
                values = torch.cat([unit_spread(parameter).to(device, non_blocking=True) for _, parameter in chosen])
        except Exception:  # noqa: BLE001 - a parameter it cannot read (a tensor subclass): this step is not judged
            return None
        return Readback(values, blocking=False), [(name, parameter.shape[0]) for name, parameter in chosen]

    @staticmethod
    def spreads(values: Sequence[float], units: Sequence[tuple[str, int]]) -> dict[str, tuple[float, ...]]:
        """:data:`Spreads` from a read-back and the (name, units) it was taken of."""
        width = len(SPREAD)
        return {name: (count, *(float(v) for v in values[index * width:(index + 1) * width]))
                for index, (name, count) in enumerate(units)}


def copies(weight_spread: float, weight_size: float, grad_spread: float, grad_size: float) -> bool:
    """Whether units are copies: weights within :data:`COPIES` of their size of the first unit's (all 0 counts), and a
    gradient that is not 0 within it too::

        >>> copies(0.0, 0.1, 0.0, 0.02), copies(0.0, 0.0, 1e-3, 0.02), copies(0.3, 0.4, 0.0, 0.02)
        (True, False, False)
    """
    return weight_spread <= COPIES * weight_size and grad_size > 0 and grad_spread <= COPIES * grad_size


def judge_symmetry(step: int, spreads: Spreads | None, verdicts: VerdictEngine) -> Verdict | None:
    """``symmetric_units`` at check step ``step`` from :class:`UnitSpread`'s reading (None: not read this step, which
    neither holds nor ends a suspicion): the verdict once the kind's policy confirms it, at the steps it labels."""
    if spreads is None:
        return None
    found = [(name, int(units)) for name, (units, *spread) in spreads.items() if copies(*spread)]
    suspected = [Suspicion(Kind.SYMMETRIC_UNITS, KEY, step, finding=symmetry_finding(step, found),
                           flagged=[name for name, _ in found])] if found else []
    confirmed = verdicts.observe(Kind.SYMMETRIC_UNITS, step, suspected, judged=[KEY])
    if not confirmed or confirmed[-1].latest.finding is None:
        return None
    latest = confirmed[-1].latest
    return Verdict(latest.finding, list(latest.flagged), key=KEY, steps=list(confirmed[-1].steps))


def symmetry_finding(step: int, found: Sequence[tuple[str, int]]) -> Finding:
    """The finding for the parameters ``found`` (name, units) whose units are copies at ``step``."""
    names = [name for name, _ in found]
    return Finding(
        Kind.SYMMETRIC_UNITS, Severity.WARNING,
        f"The units of {quoted(names)} are copies of one another (every unit's weights and gradient the same, "
        f"read at step {step}): the layer was initialized with every unit alike (a constant init such as "
        "nn.init.constant_(weight, 0.1), or one row copied into all), so each unit computes the same output, gets "
        "the same gradient and takes the same step, and they stay copies: the layer works as one unit. Initialize "
        "the weights with random values (PyTorch's default, nn.init.kaiming_uniform_, nn.init.xavier_uniform_).",
        {"parameters": names[:NAMES_IN_DETAILS], "units": [units for _, units in found][:NAMES_IN_DETAILS],
         "count": len(found)})


@rule(Kind.SYMMETRIC_UNITS, at=Moment.CHECK_READ)
def symmetry_at_check_read(facts: CheckRead) -> Verdict | None:
    """The registered rule, on the check steps :class:`UnitSpread` read."""
    return judge_symmetry(facts.step, facts.units, facts.verdicts)


__all__ = ["UnitSpread", "copies", "judge_symmetry", "symmetry_at_check_read", "symmetry_finding", "unit_spread"]
