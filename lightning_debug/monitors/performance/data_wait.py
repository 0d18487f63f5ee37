"""The data-wait rule: the training loop waits for its DataLoader a sustained share of each step."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_debug.checks.robust import median
from lightning_debug.checks.timing import Phase, StepTimes
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.performance.loader import loader_advice
from lightning_debug.monitors.performance.settings import PerformanceSettings

# The loop's own overhead between batches is a millisecond or two, more on a loaded machine: MIN_DATA_WAIT_MS.
DATA_WINDOW = 10
MIN_DATA_HISTORY = 6
MIN_DATA_WAIT_MS = 5.0
DATA_MIN_SHARE_OF_STEPS = 0.7


@dataclass(frozen=True)
class DataWait:
    """A sustained data wait: medians over the window, and how many of its steps were above the share."""

    data_ms: float
    step_ms: float
    share: float
    window_check_steps: int
    threshold_share: float
    steps_above_share: int
    epoch_starts: int = 0  # how many of the steps above the share were the first batch of an epoch

    def finding(self, loader: Mapping[str, Any] | None, uses_cuda: bool, cpus: int) -> Finding:
        """The finding, quoting the loader's settings (None: unknown) and what to change."""
        restarts = self.epoch_starts >= DATA_MIN_SHARE_OF_STEPS * self.steps_above_share
        advice = loader_advice(loader, uses_cuda, cpus, restarts)
        settings = loader or {}
        return Finding(
            Kind.DATALOADER_BOTTLENECK, Severity.WARNING,
            f"The training loop waits for data {100 * self.share:.0f}% of the step time (medians over the last "
            f"{self.window_check_steps} check steps: {self.data_ms:.1f} ms of {self.step_ms:.1f} ms per step). "
            + " ".join(advice),
            {"data_ms": self.data_ms, "step_ms": self.step_ms, "share": self.share,
             "window_check_steps": self.window_check_steps, "threshold_share": self.threshold_share,
             "steps_above_share": self.steps_above_share, "epoch_starts": self.epoch_starts,
             "min_data_ms": MIN_DATA_WAIT_MS,
             "num_workers": settings.get("num_workers"), "pin_memory": settings.get("pin_memory"),
             "persistent_workers": settings.get("persistent_workers"),
             "prefetch_factor": settings.get("prefetch_factor"), "cpus": cpus, "advice": advice})


class DataWaitRule:
    """Whether the loop waits for data over ``dataloader_bottleneck_share`` of the step, over the last timed steps.

    A slow batch, time outside training steps and a tiny model's loop overhead are ruled out by the median share
    over ``DATA_WINDOW`` timed steps, most of them above it, and a median wait of ``MIN_DATA_WAIT_MS``.

    Example::

        >>> def times(step, data):
        ...     return StepTimes(step, {Phase.DATA: data, Phase.FORWARD: 10.0, Phase.BACKWARD: 10.0,
        ...                             Phase.OPTIMIZER: 2.0})
        >>> rule, settings = DataWaitRule(), PerformanceSettings()
        >>> [rule.judge(times(step, 40.0), settings) is None for step in range(6)]
        [True, True, True, True, True, False]
        >>> round(rule.judge(times(6, 40.0), settings).share, 3)
        0.645
    """

    def __init__(self) -> None:
        self.window: deque[tuple[float, float, bool]] = deque(maxlen=DATA_WINDOW)

    def judge(self, times: StepTimes, settings: PerformanceSettings, epoch_start: bool = False) -> DataWait | None:
        """``epoch_start``: the step is the first batch of an epoch (see :func:`.loader_advice`)."""
        self.window.append((times.judged(Phase.DATA), times.judged_step_ms, epoch_start))
        if len(self.window) < MIN_DATA_HISTORY:
            return None
        data_median = median(d for d, _, _ in self.window)
        shares = [d / s if s > 0 else 0.0 for d, s, _ in self.window]
        share = median(shares)
        limit = settings.dataloader_bottleneck_share
        above = sum(value >= limit for value in shares)
        if share < limit or data_median < MIN_DATA_WAIT_MS or above < DATA_MIN_SHARE_OF_STEPS * len(shares):
            return None
        starts = sum(1 for value, (_, _, first) in zip(shares, self.window) if value >= limit and first)
        return DataWait(data_median, median(s for _, s, _ in self.window), share, len(self.window), limit, above,
                        starts)
