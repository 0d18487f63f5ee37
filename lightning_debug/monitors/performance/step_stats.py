"""The run-wide distributions of the timed steps, their scalars and their part of the report."""

from __future__ import annotations

from typing import Any

from lightning_debug.checks.timing import PHASES, StepTimes
from lightning_debug.core.stats import DistributionStats

TIMED = ("step", *(phase.value for phase in PHASES))
THROUGHPUT = ("samples_per_sec", "tokens_per_sec")


def step_metrics(times: StepTimes, world_size: int) -> dict[str, float]:
    """The ``debug/perf/*`` scalars of one timed step (throughput counts every process).

    Example::

        >>> from lightning_debug.checks.timing import Phase
        >>> times = StepTimes(3, {Phase.DATA: 1.0, Phase.FORWARD: 2.0, Phase.BACKWARD: 4.0, Phase.OPTIMIZER: 3.0},
        ...                   samples=8)
        >>> metrics = step_metrics(times, world_size=2)
        >>> metrics["debug/perf/step_ms"], metrics["debug/perf/forward_ms"], metrics["debug/perf/samples_per_sec"]
        (10.0, 2.0, 1600.0)
    """
    metrics = {"debug/perf/step_ms": times.step_ms}
    metrics.update({f"debug/perf/{phase.value}_ms": times.phases[phase] for phase in PHASES})
    if times.samples_per_sec is not None:
        metrics["debug/perf/samples_per_sec"] = times.samples_per_sec * world_size
    if times.tokens_per_sec is not None:
        metrics["debug/perf/tokens_per_sec"] = times.tokens_per_sec * world_size
    return metrics


class StepStats:
    """Step and phase times, throughput, the plugin's own time and the CPU waits of every timed step; bounded.

    Example::

        >>> from lightning_debug.checks.timing import Phase
        >>> stats = StepStats()
        >>> stats.add(StepTimes(0, {Phase.DATA: 1.0, Phase.FORWARD: 2.0, Phase.BACKWARD: 4.0,
        ...                         Phase.OPTIMIZER: 3.0}), world_size=1, cpu_waits_read=False)
        >>> stats.summaries()["step_time_ms"]["count"], "samples_per_sec" in stats.summaries()
        (1, False)
    """

    def __init__(self) -> None:
        self.stats = {name: DistributionStats() for name in (*TIMED, *THROUGHPUT)}
        self.own = DistributionStats()  # the plugin's own time inside timed steps, left out of them
        self.cpu_wait = DistributionStats()  # waiting for a CPU another program had: not held against steps

    def add(self, times: StepTimes, world_size: int, cpu_waits_read: bool) -> None:
        for tag, value in step_metrics(times, world_size).items():
            self.stats[tag.removeprefix("debug/perf/").removesuffix("_ms")].add(value)
        self.own.add(times.own_ms)
        if cpu_waits_read:
            self.cpu_wait.add(sum(times.cpu_waits.values()))

    def summaries(self) -> dict[str, Any]:
        """The report's ``stats``: ``<phase>_time_ms`` always, throughput once measured."""
        summaries = {f"{name}_time_ms": self.stats[name].summary() for name in TIMED}
        summaries.update({name: self.stats[name].summary() for name in THROUGHPUT if self.stats[name].count})
        return summaries

    def state_dict(self) -> dict[str, Any]:
        return {name: stats.state_dict() for name, stats in self.stats.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if name in self.stats:
                self.stats[name].load_state_dict(value)
