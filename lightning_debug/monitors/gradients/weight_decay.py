"""``weight_decay_on_norm``: weight decay on biases, normalisation gains and embedding tables.

Decay on those fights the model (a LayerNorm gain pulled to 0). Judged from structure only (at most one dimension,
or 2-D in a module that looks rows up), on parameters a param group holds by identity (never FSDP1's flat copies).
A recipe may decay biases on purpose: info, once::

    >>> import torch
    >>> layer, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    >>> named = [("layer.weight", layer.weight, layer), ("layer.bias", layer.bias, layer),
    ...          ("norm.weight", norm.weight, norm)]
    >>> finding = judge_weight_decay(named, [{"params": [layer.weight, layer.bias, norm.weight],
    ...                                        "weight_decay": 0.01}])
    >>> finding.kind.value, finding.details["parameters"], finding.details["roles"]
    ('weight_decay_on_norm', ['layer.bias', 'norm.weight'], {'bias or normalization': 2})
    >>> judge_weight_decay(named, [{"params": [layer.weight], "weight_decay": 0.01},
    ...                            {"params": [layer.bias, norm.weight], "weight_decay": 0.0}]) is None
    True
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.rules import FitStart, Moment, rule
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, quoted

LOOKUP_MODULES = (nn.Embedding, nn.EmbeddingBag)


class ParameterRole(enum.Enum):
    """Why a parameter is usually kept out of weight decay."""

    BIAS_OR_NORM = "bias or normalization"
    EMBEDDING = "embedding"


STRONG_DECAY = 1e-2
"""A share of every weight that weight decay alone takes per step at or above which decay holds the weights near 0
(they halve in 70 steps unless the gradients push back): SGD at 0.1 with 5e-4 and momentum 0.9 takes 5e-4, AdamW at
1e-3 with 0.1 takes 1e-4."""


def decay_per_step(param_groups: Sequence[Mapping[str, Any]]) -> float:
    """The largest share of a weight that weight decay takes per step in a group that trains something:
    ``lr * weight_decay``, over ``1 - momentum`` where the group has a momentum (its heavy ball's steady state); 0
    where no group decays, or its numbers are tensors (reading them would sync)::

        >>> decay_per_step([{"params": [1], "lr": 0.05, "weight_decay": 0.5, "momentum": 0.9}])
        0.25
        >>> decay_per_step([{"params": [1], "lr": 1e-3, "weight_decay": 0.1},
        ...                 {"params": [], "lr": 1, "weight_decay": 1}])  # a group that trains nothing
        0.0001
    """
    shares = [0.0]
    for group in param_groups:
        lr, decay, momentum = (group.get(key, 0.0) for key in ("lr", "weight_decay", "momentum"))
        if group.get("params") and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       for v in (lr, decay, momentum)) and 0 <= momentum < 1:
            shares.append(round(lr * decay / (1 - momentum), 12))
    return max(shares)


def decay_advice(decay: float) -> str:
    """The sentence a finding leads its advice with when weight decay is :data:`STRONG_DECAY` or more (else "")::

        >>> decay_advice(0.25).startswith("Weight decay takes 0.25 of every weight each step"), decay_advice(5e-4)
        (True, '')
    """
    return (f"Weight decay takes {decay:.3g} of every weight each step (lr x weight_decay, over 1 - momentum), which "
            "holds the weights near 0 whatever the data: lower it first (5e-4 is usual with SGD, 0.01-0.1 with "
            "AdamW)." if decay >= STRONG_DECAY else "")


def role_of(parameter: torch.Tensor, owner: nn.Module | None) -> ParameterRole | None:
    """The role that makes decaying ``parameter`` a mistake, or None for an ordinary weight."""
    if isinstance(owner, LOOKUP_MODULES) and parameter.dim() == 2:
        return ParameterRole.EMBEDDING
    if parameter.dim() <= 1:
        return ParameterRole.BIAS_OR_NORM
    return None


def judge_weight_decay(named: Iterable[tuple[str, torch.Tensor, nn.Module | None]],
                       param_groups: Sequence[Mapping[str, Any]]) -> Finding | None:
    """The ``weight_decay_on_norm`` finding for ``named`` (name, parameter, owning module), or None."""
    decay: dict[int, float] = {}
    for group in param_groups:
        rate = group.get("weight_decay", 0.0)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            decay.update((id(parameter), float(rate)) for parameter in group.get("params", []))
    found: list[tuple[str, ParameterRole, float]] = []
    for name, parameter, owner in named:
        rate = decay.get(id(parameter))
        role = role_of(parameter, owner) if rate is not None and parameter.requires_grad else None
        if role is not None and rate is not None:
            found.append((name, role, rate))
    if not found:
        return None
    names = [name for name, _, _ in found]
    roles = Counter(role.value for _, role, _ in found)
    rates = sorted({rate for _, _, rate in found})
    return Finding(
        Kind.WEIGHT_DECAY_ON_NORM, Severity.INFO,
        f"{len(found)} parameter(s) that are biases, normalization weights or embeddings are in a param group "
        f"with weight_decay {', '.join(f'{rate:g}' for rate in rates)}: {quoted(names)}. Decay pulls them toward "
        "0; the usual recipe gives them a param group with weight_decay=0.0.",
        {"parameters": names[:NAMES_IN_DETAILS], "count": len(found), "roles": dict(roles),
         "weight_decay": rates})


@rule(Kind.WEIGHT_DECAY_ON_NORM, at=Moment.FIT_START)
def weight_decay_at_fit_start(facts: FitStart) -> Finding | None:
    """Judged once, at a fit that starts at step 0, when the loop can reach the module (owners tell embeddings)."""
    if facts.step != 0 or facts.module is None:
        return None
    return judge_weight_decay(facts.parameters, facts.param_groups)
