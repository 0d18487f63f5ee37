"""The one place scalars leave the plugin: logger-safe names, the trainer's logging cadence, one sink call per step
(docs/configuration.md, "Scalars and the trainer's logging cadence")."""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Callable

from lightning_debug.core.guard import Failures

MetricsSink = Callable[[dict[str, float], int], None]

MAX_NAME_LENGTH = 250
LOWEST_IN_WINDOW = frozenset({"debug/loss_finite"})
"""Health flags whose worst value in a logging window is the one worth logging."""
EXPOSED_METRICS = ("debug/loss_finite", "debug/anomaly/count", "debug/grad/global_norm")
"""What ``DebugConfig.expose_callback_metrics`` puts into ``trainer.callback_metrics``."""

_UNSAFE_IN_PART = re.compile(r"[^A-Za-z0-9_.\-]")
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9_.\-/]")


def metric_part(text: object) -> str:
    """One component of a metric name from free text: every character outside ``[A-Za-z0-9_.-]``, ``/`` included,
    becomes ``_``, so a name cannot grow extra levels.

        >>> metric_part("blocks.0.attn/qkv weight"), metric_part(""), metric_part("λ.scale")
        ('blocks.0.attn_qkv_weight', '_', '_.scale')
    """
    return _UNSAFE_IN_PART.sub("_", str(text)) or "_"


@functools.lru_cache(maxsize=65536)
def safe_metric_name(name: str) -> str:
    """``name`` with unsafe characters replaced, no empty levels, at most 250 characters (a long name keeps its start
    and gets a short hash of the whole, so two long names stay distinct).

        >>> safe_metric_name("debug/activation//mean"), safe_metric_name("debug/grad/norm/a[0]")
        ('debug/activation/mean', 'debug/grad/norm/a_0_')
        >>> len(safe_metric_name("debug/" + "x" * 400))
        250
    """
    cleaned = "/".join(part for part in _UNSAFE_IN_NAME.sub("_", name).split("/") if part) or "_"
    if len(cleaned) > MAX_NAME_LENGTH:
        digest = hashlib.sha1(name.encode("utf-8", "replace")).hexdigest()[:10]
        cleaned = cleaned[:MAX_NAME_LENGTH - len(digest) - 1].rstrip("/") + "_" + digest
    return cleaned


@functools.lru_cache(maxsize=65536)
def is_counter(name: str) -> bool:
    """A count or share of what the checks found wrong: 0 all along in a healthy run, so first written once not 0.

        >>> is_counter("debug/anomaly/count"), is_counter("debug/activation/fc/zero_fraction"), is_counter("debug/loss_finite")
        (True, True, False)
    """
    return name.endswith(("_count", "/count", "_fraction"))


PER_OPTIMIZER = frozenset({"debug/grad/global_norm", "debug/weight/update_ratio_global"})
"""Whole-model numbers that mean something else for each optimizer: one series per optimizer when several step."""


def per_optimizer(metrics: dict[str, float], optimizer: int | None) -> dict[str, float]:
    """``metrics`` of a check of optimizer ``optimizer`` (None: one): :data:`PER_OPTIMIZER` names get the suffix
    ``_optimizer_<index>``, so a GAN's generator and discriminator norms are two series, not one that zig-zags.

        >>> per_optimizer({"debug/grad/global_norm": 2.0, "debug/grad/missing_count": 0.0}, 1)
        {'debug/grad/global_norm_optimizer_1': 2.0, 'debug/grad/missing_count': 0.0}
        >>> per_optimizer({"debug/grad/global_norm": 2.0}, None)
        {'debug/grad/global_norm': 2.0}
    """
    if optimizer is None:
        return metrics
    return {f"{name}_optimizer_{optimizer}" if name in PER_OPTIMIZER else name: value
            for name, value in metrics.items()}


class MetricsWriter:
    """Collects ``debug/...`` scalars and writes them to a sink (the loggers) at the logging cadence
    (``log_every_n_steps``: None every check step, 0 nothing), or keeps them for :meth:`take` with ``rows``;
    ``observer`` sees every value before any thinning (the run's timeline).

    A counter is first written once it is not 0, so a healthy run's TensorBoard opens on the charts that move.
    Steps are written in order once the caller says no more values for them will come (:meth:`flush_before`), so
    values read back a step late land at the step they describe.
        >>> written = []
        >>> writer = MetricsWriter(lambda metrics, step: written.append((step, metrics)), Failures(),
        ...                        log_every_n_steps=5)
        >>> for step in range(10):
        ...     writer.add(step, "debug/loss_finite", 0.0 if step == 2 else 1.0)
        ...     writer.add(step, "debug/perf/step_ms", 10.0 + step)
        >>> writer.flush_before(10); written
        [(2, {'debug/loss_finite': 0.0}), (4, {'debug/perf/step_ms': 14.0}), (9, {'debug/loss_finite': 1.0, 'debug/perf/step_ms': 19.0})]
        >>> rows = MetricsWriter(None, Failures(), rows=True)
        >>> for step in range(3):
        ...     rows.add_many(step, {"debug/loss_finite": 0.0 if step == 1 else 1.0, "debug/perf/step_ms": 10.0 + step})
        >>> rows.take(), rows.take()
        ({'debug/loss_finite': 0.0, 'debug/perf/step_ms': 12.0}, {})
    """

    def __init__(self, sink: MetricsSink | None, failures: Failures, log_every_n_steps: int | None = None,
                 observer: MetricsSink | None = None, exposed: Callable[[dict[str, float]], None] | None = None,
                 rows: bool = False) -> None:
        self.rows = rows
        self._row: dict[str, tuple[int, float]] = {}
        self._sink = sink if log_every_n_steps != 0 and not rows else None
        self._failures = failures
        self._window = max(1, log_every_n_steps or 1)
        self._observer = observer
        self._exposed = exposed
        self._pending: dict[int, dict[str, tuple[int, float]]] = {}
        self._counting: set[str] = set()  # the counters that were not 0 once: written from then on

    @property
    def window(self) -> int:
        """Steps per logging row: a value measured at least this often is on every row."""
        return self._window

    def add(self, step: int, name: str, value: float) -> None:
        self.add_many(step, {name: value})

    def add_many(self, step: int, values: dict[str, float]) -> None:
        """Scalars measured at ``step``: non-finite ones are dropped (a NaN is a finding, not a point)."""
        measured = {safe_metric_name(name): float(value) for name, value in values.items()
                    if math.isfinite(float(value))}
        if not measured:
            return
        if self._exposed is not None:
            exposed = {name: value for name, value in measured.items() if name in EXPOSED_METRICS}
            if exposed:
                self._failures.call("exposing debug scalars to callback_metrics", self._exposed, exposed)
        for name in [name for name in measured if is_counter(name) and name not in self._counting]:
            if measured[name] == 0.0:
                del measured[name]
            else:
                self._counting.add(name)
        if not measured:
            return
        if self._observer is not None:
            self._failures.call("observing debug scalars", self._observer, measured, step)
        if self.rows:
            window = self._row
        elif self._sink is None:
            return
        else:
            window = self._pending.setdefault(step // self._window, {})
        for name, value in measured.items():
            kept = window.get(name)
            if kept is None or (value < kept[1] or (value == kept[1] and step >= kept[0])
                                if name in LOWEST_IN_WINDOW else step >= kept[0]):
                window[name] = (step, value)

    def take(self) -> dict[str, float]:
        """The values of a row the framework writes now (``rows=True``), each measured since the last row."""
        row, self._row = self._row, {}
        return {name: value for name, (_, value) in row.items()}

    def flush_before(self, step: int | None = None) -> None:
        """Write every logging window that ends below ``step`` (all of them when ``step`` is None)."""
        if not self._pending:
            return
        complete = sorted(w for w in self._pending if step is None or (w + 1) * self._window <= step)
        for window in complete:
            by_step: dict[int, dict[str, float]] = {}
            for name, (at, value) in self._pending.pop(window).items():
                by_step.setdefault(at, {})[name] = value
            for at in sorted(by_step):
                if self._sink is None:
                    return
                try:
                    self._sink(by_step[at], at)
                except Exception as error:
                    self._sink = None
                    self._pending.clear()
                    self._failures.record("logging debug scalars", error, "debug scalars are no longer logged")
