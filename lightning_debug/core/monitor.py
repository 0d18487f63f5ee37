"""The framework-free base of every area's checks (anomaly, gradients, memory, performance).

A monitor holds its area's state and turns measurements into findings, scalars and a report
section. The Lightning callbacks and the Accelerate debugger are thin adapters that call monitors
from their hooks, so each check has one implementation.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from lightning_debug.config import DebugConfig
from lightning_debug.core.findings import Episodes, Finding, Tally
from lightning_debug.core.session import DebugSession

Where = dict[str, int]


class Monitor:
    """Findings with episodes and tallies, rate-limited warnings, scalars, resume state.

    Subclasses add their measurements and extend :meth:`state_dict` / :meth:`report_section`.
    """

    report_name: ClassVar[str] = "debug"
    max_warnings: ClassVar[int] = 10
    episode_grace: ClassVar[int] = 3
    max_episode_events: ClassVar[int] = 25

    def __init__(self, config: DebugConfig, source: str) -> None:
        self.config = config
        self.source = source
        self.tally = Tally()
        self.episodes = Episodes(grace=self.episode_grace)
        self._silenced_episodes: set[tuple[str, str]] = set()
        self._seen_this_check: set[tuple[str, str]] = set()
        self._warnings_left = self.max_warnings
        self._session: DebugSession | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _session=None)

    @property
    def session(self) -> DebugSession:
        if self._session is None:
            raise RuntimeError(f"{self.source} is not attached to a running training loop")
        return self._session

    @property
    def attached(self) -> bool:
        return self._session is not None

    def attach(self, session: DebugSession) -> None:
        self._session = session
        session.join(self)

    def detach(self) -> None:
        self._session = None

    def record(self, finding: Finding, step: int, where: Where, key: str = "", warn: bool = True) -> bool:
        """Count a finding; write an event (and a warning) when it starts a new episode.

        An episode ends after ``episode_grace`` check steps without the finding. Past
        ``max_episode_events`` episodes of one kind, further episodes are counted in the report but
        not written to events.jsonl, so a condition that keeps coming back cannot flood the file.
        Returns True for a new episode.
        """
        episode_key = (finding.kind, key)
        self._seen_this_check.add(episode_key)
        new = self.episodes.observe(episode_key, step) == "start"
        self.tally.record(step, finding, new)
        if new:
            episodes = self.tally.kinds[finding.kind]["episodes"]
            if episodes > self.max_episode_events:
                self._silenced_episodes.add(episode_key)
                return new
            if episodes == self.max_episode_events:
                finding = Finding(finding.kind, finding.severity, finding.message + (
                    f" (episode {episodes} of {finding.kind}: later ones are counted in report.json, not written "
                    "here)"), finding.details)
            self.session.emit(finding, step=step, callback=self.source, episode="start", **where)
            if warn and finding.severity in ("warning", "error", "critical"):
                self.warn(f"[step {step}] {finding.message}")
        return new

    def close_episodes(self, step: int, where: Where, kinds: set[str], final: bool = False) -> None:
        """End the episodes of ``kinds`` not observed for a while (all of them when ``final``)."""
        for (kind, key), episode in self.episodes.close_missing(self._seen_this_check, step, kinds, final):
            if (kind, key) in self._silenced_episodes:
                self._silenced_episodes.discard((kind, key))
                continue
            subject = f" ({key})" if key else ""
            message = (f"{kind}{subject} ended: seen on {episode['steps']} check step(s), "
                       f"steps {episode['first_step']}-{episode['last_step']}")
            self.session.emit(Finding(kind, "info", message, dict(episode, key=key)),
                              step=max(step, episode["last_step"]),
                              callback=self.source, episode="end", **where)
        self._seen_this_check = {key for key in self._seen_this_check if key[0] not in kinds}

    def warn(self, message: str) -> None:
        """A rate-limited user warning on the global-zero process; events.jsonl keeps everything."""
        if not self.attached or not self.session.is_global_zero or self._warnings_left <= 0:
            return
        self._warnings_left -= 1
        suffix = "" if self._warnings_left else f" (further warnings from {self.source} are silenced; see events.jsonl)"
        warnings.warn(f"lightning-debug: {message}{suffix}", UserWarning, stacklevel=3)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.session.metrics.add_many(step, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"tally": self.tally.state_dict(), "episodes": self.episodes.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tally.load_state_dict(state_dict.get("tally", {}))
        self.episodes.load_state_dict(state_dict.get("episodes", {}))

    def report_section(self) -> dict[str, Any]:
        return {"findings": self.tally.state_dict()}
