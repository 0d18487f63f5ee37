"""The one checkpoint format of monitors, which both adapters save and give back on resume."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_debug.core.monitor import Monitor


def monitor_states(monitors: Iterable[Monitor]) -> dict[str, Any]:
    """Each monitor's ``state_dict`` under its area's name (Lightning: under each callback's key; Accelerate:
    ``register_for_checkpointing``).

        >>> from lightning_debug import DebugConfig
        >>> from lightning_debug.monitors import monitors_for
        >>> monitors = monitors_for(DebugConfig(mode="memory_profiling"), "loop")
        >>> sorted(monitor_states(monitors))
        ['errors', 'loop', 'memory']
    """
    return {monitor.area.value: monitor.state_dict() for monitor in monitors}


def load_monitor_states(monitors: Iterable[Monitor], states: dict[str, Any]) -> None:
    """Give each of ``monitors`` its part of ``states``; an area the checkpoint lacks starts fresh."""
    for monitor in monitors:
        if monitor.area.value in states:
            monitor.load_state_dict(states[monitor.area.value])
