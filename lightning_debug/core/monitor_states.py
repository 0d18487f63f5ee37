"""The one checkpoint format of monitors, which both adapters save and give back on resume."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_debug.core.monitor import Monitor


def monitor_states(monitors: Iterable[Monitor]) -> dict[str, Any]:
    """The one checkpoint format of monitors: each one's ``state_dict`` under its area's name.

    Both adapters save it (Lightning under each callback's key, Accelerate through
    ``register_for_checkpointing``) and give it back to :func:`load_monitor_states` on resume.

    Example::

        >>> from lightning_debug import DebugConfig
        >>> from lightning_debug.monitors import monitors_for
        >>> monitors = monitors_for(DebugConfig(mode="memory_profiling"), "loop")
        >>> sorted(monitor_states(monitors))
        ['errors', 'loop', 'memory']
    """
    return {monitor.area.value: monitor.state_dict() for monitor in monitors}


def load_monitor_states(monitors: Iterable[Monitor], states: dict[str, Any]) -> None:
    """Give each of ``monitors`` its part of ``states`` (made by :func:`monitor_states`); an area the
    checkpoint lacks (a callback added since) starts fresh."""
    for monitor in monitors:
        if monitor.area.value in states:
            monitor.load_state_dict(states[monitor.area.value])
