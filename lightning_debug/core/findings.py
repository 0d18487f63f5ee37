"""What the checks report: findings, episodes of a persisting condition, and per-kind tallies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_debug.core.kinds import Kind, Severity, causal_rank, severity_rank
from lightning_debug.core.strenum import StrEnum


@dataclass
class Finding:
    """One thing a check found at one step; becomes a line of events.jsonl."""

    kind: Kind
    severity: Severity
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def quoted(names: Sequence[str], shown: int = 5) -> str:
    """The first ``shown`` names in backquotes, and how many more: how every finding lists names.

    Example::

        >>> quoted(["a", "b", "c"], shown=2)
        '`a`, `b` and 1 more'
    """
    text = ", ".join(f"`{name}`" for name in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


class EpisodePhase(StrEnum):
    """Where an observation stands in its episode (the ``episode`` field of an event)."""

    START = "start"
    CONTINUE = "continue"
    END = "end"
    SUMMARY = "summary"  # a kind's totals, for the episodes past the ones written one by one


class Tally:
    """Per kind: episodes, check steps, first and last step, first message, and ``consequence_of`` (the report lists
    it after that kind). Kept in each monitor's ``state_dict`` so counts continue across a resume."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict[str, Any]] = {}

    def record(self, step: int, finding: Finding, new_episode: bool) -> None:
        entry = self.kinds.setdefault(finding.kind.value, {
            "episodes": 0, "steps": 0, "first_step": step, "last_step": step,
            "severity": finding.severity.value, "first_message": finding.message,
        })
        if not entry["steps"] and finding.details.get("consequence_of"):
            entry["consequence_of"] = str(finding.details["consequence_of"])
        entry["episodes"] += int(new_episode)
        entry["steps"] += 1
        entry["last_step"] = step
        if finding.severity.rank < severity_rank(entry["severity"]):
            entry["severity"] = finding.severity.value

    def state_dict(self) -> dict[str, Any]:
        return {kind: dict(entry) for kind, entry in self.kinds.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kinds = {kind: dict(entry) for kind, entry in state.items()}


class Episodes:
    """Turns a condition observed on successive check steps into start and end events: :meth:`close_missing` ends an
    episode only after ``grace`` check steps without it, so a value hovering at a threshold does not flap.

        >>> episodes = Episodes()
        >>> [str(episodes.observe(("nonfinite_loss", ""), step=s)) for s in (5, 6)]
        ['start', 'continue']
        >>> episodes.close_missing(seen=set(), step=7)
        [(('nonfinite_loss', ''), {'first_step': 5, 'last_step': 6, 'steps': 2})]
    """

    def __init__(self, grace: int = 1) -> None:
        self.grace = grace
        self.open: dict[tuple[str, str], dict[str, Any]] = {}

    def observe(self, key: tuple[str, str], step: int) -> EpisodePhase:
        episode = self.open.get(key)
        if episode is None:
            self.open[key] = {"first_step": step, "last_step": step, "steps": 1, "missed": 0}
            return EpisodePhase.START
        episode["last_step"] = step
        episode["steps"] += 1
        episode["missed"] = 0
        return EpisodePhase.CONTINUE

    def close_missing(self, seen: set[tuple[str, str]], step: int, kinds: set[str] | None = None,
                      final: bool = False) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        """End the episodes of ``kinds`` absent for ``grace`` check steps (all of them when ``final``)."""
        closed = []
        for key in list(self.open):
            if (key in seen and not final) or (kinds is not None and key[0] not in kinds):
                continue
            episode = self.open[key]
            episode["missed"] = episode.get("missed", 0) + 1
            if final or episode["missed"] >= self.grace:
                del self.open[key]
                closed.append((key, {name: episode[name] for name in ("first_step", "last_step", "steps")}))
        return closed

    def state_dict(self) -> dict[str, Any]:
        return {"open": [[list(key), dict(value)] for key, value in self.open.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.open = {tuple(key): dict(value) for key, value in state.get("open", [])}  # type: ignore[misc]


def _causes(kind: str, findings: Mapping[str, dict[str, Any]]) -> list[str]:
    """``kind``, then each finding it follows from up its ``consequence_of`` chain (a cycle ends it)."""
    chain = [kind]
    while (cause := findings.get(chain[-1], {}).get("consequence_of")) and cause in findings and cause not in chain:
        chain.append(cause)
    return chain


def root_of(kind: str, findings: Mapping[str, dict[str, Any]]) -> str:
    """The finding ``kind`` follows from, through its ``consequence_of`` chain (itself when it is a root)."""
    return _causes(kind, findings)[-1]


def order_findings(findings: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Root causes first (most severe, then first step, then causal order within a step); a consequence comes right
    after the finding it follows from, whatever its own severity or step.

        >>> list(order_findings({"nonfinite_grad": {"severity": "error", "first_step": 3},
        ...                     "nonfinite_loss": {"severity": "error", "first_step": 3,
        ...                                        "consequence_of": "nonfinite_param"},
        ...                     "nonfinite_param": {"severity": "critical", "first_step": 4,
        ...                                         "consequence_of": "nonfinite_grad"}}))
        ['nonfinite_grad', 'nonfinite_param', 'nonfinite_loss']
    """
    def key(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
        path = _causes(item[0], findings)[::-1]  # from the root down to the kind
        root, anchor = path[0], findings[path[0]]
        # within a root's group a consequence sorts by its whole chain of causes, so each follows its own cause
        return (severity_rank(anchor.get("severity")), anchor.get("first_step", 0), causal_rank(root), root,
                tuple((findings[link].get("first_step", 0), causal_rank(link), link) for link in path[1:]))

    return dict(sorted(findings.items(), key=key))
