"""What the gradient area keeps across check steps (bounded, in the monitor's ``state_dict``)::

    >>> history = GradientHistory(["exploding_grad"])
    >>> history.norms_for(None).add(2.0); history.counts["exploding"] += 1
    >>> restored = GradientHistory(["exploding_grad"]); restored.load_state_dict(history.state_dict())
    >>> list(restored.recent_norms.values), restored.counts["exploding"]
    ([2.0], 1)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from lightning_debug.checks.trends import NormHistory
from lightning_debug.core.stats import RunningStats, Window
from lightning_debug.core.verdicts import VerdictEngine
from lightning_debug.monitors.gradients.missing import MissingHistory
from lightning_debug.monitors.gradients.vanishing import VanishingHistory

HEALTHY_NORMS_KEPT = 256
FLAGGED_KEPT = 200


class FlagCounter:
    """How often each parameter was flagged, bounded: past ``limit`` names the rarest are dropped::

        >>> counter = FlagCounter(limit=4)
        >>> counter.add(["a", "b"]); counter.add(["a"]); counter.top(1)
        [['a', 2]]
    """

    def __init__(self, limit: int = FLAGGED_KEPT) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def add(self, names: Iterable[str]) -> None:
        for name in names:
            self.counts[name] = self.counts.get(name, 0) + 1
        if len(self.counts) > self.limit:
            kept = sorted(self.counts.items(), key=lambda item: -item[1])[:self.limit // 2]
            self.counts = dict(kept)

    def top(self, count: int) -> list[list[Any]]:
        ordered = sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))
        return [[name, hits] for name, hits in ordered[:count]]


@dataclass
class MeasuredSteps:
    """The check steps on which something non-finite was measured: first, last, how many (what report.md states,
    whatever the rules concluded; :mod:`lightning_debug.report.measured`)::

        >>> steps = MeasuredSteps()
        >>> for step in (2, 3, 4): steps.add(step)
        >>> steps.fact()
        {'first_step': 2, 'last_step': 4, 'steps': 3}
    """

    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0

    def add(self, step: int) -> None:
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.steps += 1

    def fact(self) -> dict[str, Any] | None:
        return asdict(self) if self.steps else None

    def load(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.first_step, self.last_step = state.get("first_step"), state.get("last_step")
        self.steps = int(state.get("steps", 0))


class GradientHistory:
    """The gradient area's own history, for the rules and the report."""

    def __init__(self, kinds: Iterable[str], verdicts: VerdictEngine | None = None) -> None:
        self.counts = {"exploding": 0, "vanishing": 0, "missing": 0, "frozen": 0}
        self.checks = 0
        self.steps_without_gradients = 0
        self.global_norms = RunningStats()
        self.update_ratios = RunningStats()
        self.healthy_norms = Window(HEALTHY_NORMS_KEPT)
        self.recent_norms = NormHistory()
        # With several optimizers each one's gradients have their own scale (a GAN's D and G): one history each.
        self._norm_histories: dict[Any, NormHistory] = {None: self.recent_norms}
        self.parameter_norms: dict[str, RunningStats] = {}
        self.parameter_update_ratios: dict[str, RunningStats] = {}
        self.flagged = {kind: FlagCounter() for kind in sorted(kinds)}
        self.clip_suggestion: dict[str, Any] | None = None
        self.vanishing = VanishingHistory()
        self.missing = MissingHistory(verdicts)
        self.nonfinite: dict[str, MeasuredSteps] = {}  # what ("gradients", "loss", "parameters") -> where
        self.scaler_overflows = 0

    def norms_for(self, optimizer: Any) -> NormHistory:
        """The recent global norms of ``optimizer``'s check steps (None with one optimizer), made current."""
        self.recent_norms = self._norm_histories.setdefault(optimizer, NormHistory())
        return self.recent_norms

    def state_dict(self) -> dict[str, Any]:
        return dict(
            counts=dict(self.counts), checks=self.checks, steps_without_gradients=self.steps_without_gradients,
            global_norms=self.global_norms.state_dict(), update_ratios=self.update_ratios.state_dict(),
            healthy_norms=list(self.healthy_norms.values), recent_norms=list(self.recent_norms.values),
            start_losses=list(self.recent_norms.start_losses), recent_losses=list(self.recent_norms.losses),
            parameter_norms={name: stats.state_dict() for name, stats in self.parameter_norms.items()},
            parameter_update_ratios={name: stats.state_dict() for name, stats in self.parameter_update_ratios.items()},
            flagged={kind: dict(counter.counts) for kind, counter in self.flagged.items()},
            clip_suggestion=self.clip_suggestion, vanishing=self.vanishing.state_dict(),
            missing=self.missing.state_dict(), scaler_overflows=self.scaler_overflows,
            nonfinite={what: steps.fact() for what, steps in self.nonfinite.items()},
            last_norm=last if math.isfinite(last := self.recent_norms.last) else str(last),  # JSON-safe
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts.update({k: int(v) for k, v in state_dict.get("counts", {}).items()})
        self.checks = int(state_dict.get("checks", 0))
        self.steps_without_gradients = int(state_dict.get("steps_without_gradients", 0))
        if "global_norms" in state_dict:
            self.global_norms.load_state_dict(state_dict["global_norms"])
        if "update_ratios" in state_dict:
            self.update_ratios.load_state_dict(state_dict["update_ratios"])
        self.healthy_norms = Window(HEALTHY_NORMS_KEPT)
        for value in state_dict.get("healthy_norms", []):
            self.healthy_norms.add(float(value))
        self.recent_norms.load(state_dict.get("recent_norms", []), state_dict.get("start_losses", []),
                               state_dict.get("recent_losses", []))
        self.recent_norms.last = float(state_dict.get("last_norm", self.recent_norms.last))
        self.nonfinite = {}
        for what, steps in (state_dict.get("nonfinite") or {}).items():
            self.nonfinite.setdefault(what, MeasuredSteps()).load(steps)
        self.scaler_overflows = int(state_dict.get("scaler_overflows", 0))
        for target, key in ((self.parameter_norms, "parameter_norms"),
                            (self.parameter_update_ratios, "parameter_update_ratios")):
            target.clear()
            for name, stats_state in state_dict.get(key, {}).items():
                target[name] = RunningStats()
                target[name].load_state_dict(stats_state)
        for kind, counts in state_dict.get("flagged", {}).items():
            self.flagged.setdefault(kind, FlagCounter()).counts = {name: int(c) for name, c in counts.items()}
        self.clip_suggestion = state_dict.get("clip_suggestion")
        self.vanishing.load_state_dict(state_dict.get("vanishing", {}))
        self.missing.load_state_dict(state_dict.get("missing", {}))

    def report_section(self, trainability: dict[str, Any], order: str, parameter_norms: bool) -> dict[str, Any]:
        """The gradients section of report.json after the base monitor's (findings, check frequency)."""
        stats: dict[str, Any] = {"gradient_norm": self.global_norms.summary()}
        if self.update_ratios.count:
            stats["update_ratio"] = self.update_ratios.summary()
        section: dict[str, Any] = dict(
            stats=stats, checks=self.checks, steps_without_gradients=self.steps_without_gradients,
            counts={f"{kind}_checks": count for kind, count in self.counts.items()},
            most_flagged={kind: counter.top(10) for kind, counter in self.flagged.items() if counter.counts},
            trainability=trainability, clip_suggestion=self.clip_suggestion, order=order,
        )
        if self.nonfinite:  # stated by report.md whatever the findings (see lightning_debug.report.measured)
            section["nonfinite"] = {what: steps.fact() for what, steps in self.nonfinite.items()}
        if self.scaler_overflows:
            section["scaler_overflows"] = self.scaler_overflows
        if parameter_norms:
            section["parameter_norms"] = {name: s.summary() for name, s in self.parameter_norms.items()}
        if self.parameter_update_ratios:
            section["parameter_update_ratios"] = {name: s.summary() for name, s in self.parameter_update_ratios.items()}
        return section
