"""``missing_grad`` and ``intermittent_grad``: parameters that never receive a gradient, and those that
receive one on some steps only.

A healthy model leaves parameters without a gradient on some steps (MoE experts, LayerDrop, a head sampled per
batch), so the run's history decides: one that had a gradient before is ``intermittent_grad`` (info); one that
never had any is a candidate, watched on every optimizer step and held under the kind's policy (docs/gradients.md,
"Missing")::

    >>> history = MissingHistory()
    >>> seen = history.observe_check(0, None, ["expert.w", "unused.w"], ["expert.w", "unused.w", "head.w"])
    >>> seen.candidates, seen.intermittent
    (['expert.w', 'unused.w'], [])
    >>> history.observe_step(1, with_gradient=["expert.w"], without=["unused.w"])
    []
    >>> history.observe_check(2, None, ["expert.w", "unused.w"], ["expert.w", "unused.w", "head.w"]).intermittent
    ['expert.w']
    >>> history.confirm_the_rest()
    ['unused.w']
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.verdicts import ConfirmedBy, Hold, Suspicion, VerdictEngine, policy_of
from lightning_debug.monitors.gradients.layout import Positions, input_to_output, module_of
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict, quoted

NO_GRAPH = "no_graph"
"""The variant of a candidate whose module ran without building a graph: nothing can reach it, its hold is shorter."""
MISSING_CONFIRM_STEPS = policy_of(Kind.MISSING_GRAD).needed(NO_GRAPH) or 1
UNCALLED_CONFIRM_STEPS = policy_of(Kind.MISSING_GRAD).needed() or 1
REPLICAS_WATCHED = 256
WAIT_FACTOR = 2
"""A candidate whose replicas get gradients on some steps only waits more than this times the run's longest wait."""


@dataclass(frozen=True)
class NoParameterReached:
    """Why no trainable parameter held a gradient at an optimizer step after a backward: ``where`` and ``summary``
    (the console's cause), ``text`` (the message's)."""

    where: str
    summary: str
    text: str


NO_PARAMETER_REACHED = {
    False: NoParameterReached(
        "loss_without_parameters",
        "the loss reaches no parameter (made from a number or from detached outputs): return the loss computed from "
        "the model's output",
        "A backward ran before each of these optimizer steps from a loss whose graph reaches no parameter: a tensor "
        "made from a number (torch.tensor(loss.item(), requires_grad=True)) or from detached outputs, or a loss "
        "computed outside autograd (NumPy). Return the loss computed from the model's output."),
    True: NoParameterReached(
        "gradients_cleared",
        "the gradients are cleared between the backward and the step: call zero_grad(), backward, then step()",
        "A backward ran before each of these optimizer steps, from a loss that reaches the parameters, yet none held "
        "a gradient at the step: the gradients are cleared between the backward and the step (zero_grad() after the "
        "backward, or step() called before it). Call zero_grad(), backward (manual_backward(loss)), then step(), in "
        "that order."),
}
"""By whether the loss reaches a parameter (:func:`~lightning_debug.checks.gradients.loss_reaches`)."""

DDP_NOTE = ("Under DDP an unused parameter makes backward fail unless the strategy finds unused parameters "
            "(Trainer(strategy='ddp_find_unused_parameters_true')), which walks the autograd graph every step; "
            "removing the parameter or freezing it with requires_grad_(False) is cheaper.")


@dataclass(frozen=True)
class Candidate:
    """A candidate as its hold in the verdict engine shows it: ``steps_without`` optimizer steps in a row since
    ``first_step``, ``check_steps`` the check steps among them."""

    first_step: int
    steps_without: int
    check_steps: list[int]

    @classmethod
    def of(cls, hold: Hold) -> "Candidate":
        return cls(hold.first.step, hold.streak, list(hold.steps))


@dataclass
class MissingCheck:
    """What one check step showed: ``candidates`` never had a gradient (``confirmed`` of them: for long enough,
    ``newly_confirmed``: from this check on), ``intermittent`` had one on earlier steps."""

    candidates: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    newly_confirmed: list[str] = field(default_factory=list)
    intermittent: list[str] = field(default_factory=list)


class MissingHistory:
    """Per parameter ever seen without a gradient: on how many check steps, and whether it ever had one (bounded by
    the model's parameters). The candidates are held in ``verdicts``, the monitor's engine, checkpointed with it.
    """

    def __init__(self, verdicts: VerdictEngine | None = None) -> None:
        self.verdicts = verdicts if verdicts is not None else VerdictEngine()
        self._ended: dict[str, Candidate] = {}
        self.called: Mapping[str, bool] = {}  # whether its module ran in the first forward (absent: unknown)
        self.without_graph: set[str] = set()
        self.checks: dict[Any, int] = {}
        self.absent: dict[str, int] = {}
        self.had_gradient: set[str] = set()
        self.longest_wait = 0  # the most steps a candidate went without a gradient before it got one
        self.groups: Mapping[str, Sequence[Hashable]] = {}  # per parameter, its replica groups
        self.members: dict[Hashable, list[str]] = {}
        self._gap_start: dict[str, int] = {}  # watched replicas without a gradient: since which step
        self.conditional: set[Hashable] = set()  # groups with a member seen to get its gradient on some steps only
        self.loss_reaches: bool | None = None
        """Set when a backward ran and no parameter held a gradient at the step after it: whether its loss reaches
        a parameter (:func:`~lightning_debug.checks.gradients.loss_reaches`)."""

    def set_groups(self, groups: Mapping[str, Sequence[Hashable]]) -> None:
        self.groups = groups
        self.members = {}
        for name, keys in groups.items():
            for key in keys:
                self.members.setdefault(key, []).append(name)

    def set_called(self, called: Mapping[str, bool], without_graph: Collection[str] = ()) -> None:
        """What the first forward pass showed (:meth:`ForwardOrder.called`, :meth:`ForwardOrder.without_graph`)."""
        self.called = dict(called)
        self.without_graph = set(without_graph)

    @property
    def candidates(self) -> dict[str, Candidate]:
        """The candidates by name (and, once the run ended, those it confirmed then)."""
        held = {name: Candidate.of(hold) for name, hold in self.verdicts.holds(Kind.MISSING_GRAD).items()}
        return {**self._ended, **held}

    def _suspect(self, name: str, step: int, record: bool) -> Suspicion:
        """A step on which ``name`` (a candidate) had no gradient; a conditional one waits past its replicas."""
        at_least = WAIT_FACTOR * self.longest_wait + 1 if self._conditional(name) else 0
        variant = NO_GRAPH if name in self.without_graph else ""
        return Suspicion(Kind.MISSING_GRAD, name, step, variant=variant, at_least=at_least, record=record)

    def is_candidate(self, name: str) -> bool:
        """Whether ``name`` is held as a candidate (a dictionary look-up: called on steps between checks)."""
        return self.verdicts.hold(Kind.MISSING_GRAD, name) is not None

    def is_confirmed(self, name: str) -> bool:
        hold = self.verdicts.hold(Kind.MISSING_GRAD, name)
        return hold is not None and hold.confirmed

    def replicas_to_watch(self, limit: int = REPLICAS_WATCHED) -> list[str]:
        """The replicas of the candidates still waiting: looked at on every step with them (``.grad is None``),
        so that a replica going without a gradient, and for how long, is seen between check steps."""
        names: dict[str, None] = {}
        for name, hold in self.verdicts.holds(Kind.MISSING_GRAD).items():
            if hold.confirmed:
                continue
            for key in self.groups.get(name, ()):
                names.update(dict.fromkeys(m for m in self.members.get(key, ()) if not self.is_candidate(m)))
                if len(names) >= limit:
                    return list(names)[:limit]
        return list(names)

    def replicas_after_check(self, missing: Collection[str]) -> list[str]:
        """:meth:`replicas_to_watch` on a check step where ``missing`` had no gradient: the others had one there,
        so a gap of theirs that starts after it counts as a wait."""
        replicas = self.replicas_to_watch()
        absent = set(missing)
        self.had_gradient.update(name for name in replicas if name not in absent)
        return replicas

    def _conditional(self, name: str) -> bool:
        return any(group in self.conditional for group in self.groups.get(name, ()))

    def _seen_conditional(self, name: str) -> None:
        self.conditional.update(self.groups.get(name, ()))

    def observe_check(self, step: int, optimizer: Any, missing: Sequence[str], judged: Collection[str]) -> MissingCheck:
        """A check step of ``optimizer`` judged the parameters ``judged``; ``missing`` of them had no gradient."""
        earlier = self.checks.get(optimizer, 0)
        self.checks[optimizer] = earlier + 1
        without = set(missing)
        if self.absent:
            judged_set = judged if isinstance(judged, (set, frozenset)) else set(judged)
            self._had_gradient(name for name in self.absent if name in judged_set and name not in without)
        seen = MissingCheck()
        suspicions = []
        for name in missing:
            held = self.is_candidate(name)
            if not held and name not in self.had_gradient:
                if earlier and name not in self.absent:  # judged on earlier check steps, with a gradient then
                    self.had_gradient.add(name)
                else:
                    held = True
            self.absent[name] = self.absent.get(name, 0) + 1
            if not held:
                seen.intermittent.append(name)
                self._seen_conditional(name)
                continue
            seen.candidates.append(name)
            suspicions.append(self._suspect(name, step, record=True))
        for confirmed in self.verdicts.observe(Kind.MISSING_GRAD, step, suspicions, judged=()):
            (seen.confirmed if confirmed.by is ConfirmedBy.AGAIN else seen.newly_confirmed).append(confirmed.key)
        order = {name: index for index, name in enumerate(missing)}
        seen.confirmed.sort(key=order.__getitem__)
        seen.newly_confirmed.sort(key=order.__getitem__)
        return seen

    def observe_step(self, step: int, with_gradient: Iterable[str], without: Iterable[str]) -> list[str]:
        """Candidates and their watched replicas looked at on an optimizer step; returns the candidates it confirms.
        A replica without a gradient after it had one makes its groups conditional; its gap counts as a wait."""
        with_gradient = list(with_gradient)
        self._had_gradient(with_gradient)
        for name in with_gradient:
            self._gap_start.pop(name, None)
        without = list(without)
        for name in without:
            if not self.is_candidate(name) and name in self.had_gradient:
                start = self._gap_start.setdefault(name, step)
                self.longest_wait = max(self.longest_wait, step - start + 1)
                self._seen_conditional(name)
        suspicions = [self._suspect(name, step, record=False) for name in without if self.is_candidate(name)]
        return [confirmed.key for confirmed in self.verdicts.observe(Kind.MISSING_GRAD, step, suspicions, judged=())
                if confirmed.by is not ConfirmedBy.AGAIN]

    def confirm_the_rest(self) -> list[str]:
        """At the end of a run: candidates still held are confirmed by the kind's policy, except conditional ones
        that waited no more than :data:`WAIT_FACTOR` times the longest wait (an expert no token has reached yet)."""
        held = self.candidates
        rest = [confirmed.key for confirmed in self.verdicts.flush([Kind.MISSING_GRAD])]
        self._ended = {name: held[name] for name in rest}
        return rest

    def received_fraction(self, name: str, optimizer: Any) -> float:
        """The fraction of ``optimizer``'s check steps on which ``name`` had a gradient."""
        checks = max(self.checks.get(optimizer, 1), 1)
        return max(0.0, (checks - self.absent.get(name, 0)) / checks)

    def _had_gradient(self, names: Iterable[str]) -> None:
        ended = []
        for name in names:
            self.had_gradient.add(name)
            hold = self.verdicts.hold(Kind.MISSING_GRAD, name)
            if hold is not None:
                ended.append(name)
                self.longest_wait = max(self.longest_wait, hold.streak)
                self._seen_conditional(name)
        self.verdicts.end(Kind.MISSING_GRAD, ended)  # a candidate that got its gradient is no longer one

    def state_dict(self) -> dict[str, Any]:
        return {"checks": [[optimizer, count] for optimizer, count in self.checks.items()],
                "absent": dict(self.absent), "had_gradient": sorted(self.had_gradient),
                "longest_wait": self.longest_wait, "loss_reaches": self.loss_reaches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = {optimizer: int(count) for optimizer, count in state.get("checks", [])}
        self.absent = {name: int(count) for name, count in state.get("absent", {}).items()}
        self.had_gradient = set(state.get("had_gradient", []))
        self.longest_wait = int(state.get("longest_wait", 0))
        self.loss_reaches = state.get("loss_reaches")


def judge_missing(step: int, names: Sequence[str], trainable: int, positions: Positions,
                  history: MissingHistory, newly: Collection[str] = ()) -> Verdict | None:
    """The ``missing_grad`` finding for the confirmed parameters ``names``; those ``newly`` confirmed are recorded at
    every check step they were seen without a gradient."""
    if not names:
        return None
    candidates = history.candidates
    steps = sorted({s for name in newly if name in candidates for s in candidates[name].check_steps})
    ordered = input_to_output(names, positions)
    first = [candidates[name] for name in ordered if name in candidates]
    since = min((candidate.first_step for candidate in first), default=step)
    observed = max((candidate.steps_without for candidate in first), default=1)
    no_graph = [name for name in ordered if name in history.without_graph]
    cut_off = [name for name in ordered if history.called.get(name) is True and name not in history.without_graph]
    not_called = [name for name in ordered if history.called.get(name) is False]
    unknown = len(ordered) - len(no_graph) - len(cut_off) - len(not_called)

    def whose(group: Sequence[str]) -> str:
        return "Their modules" if len(group) == len(ordered) else f"The modules of {quoted(group, 3)}"

    why = []
    every = len(names) == trainable and history.loss_reaches is not None
    reached = NO_PARAMETER_REACHED[history.loss_reaches] if every else None
    if reached is not None:
        why.append(reached.text)
    elif no_graph:
        why.append(f"{whose(no_graph)} ran in the first forward pass without building a graph (their output needs "
                   "no gradient): under torch.no_grad() or inference_mode(), inside checkpoint(use_reentrant=True) "
                   "on inputs that need no gradient, or with an integer output (indices from argmax or topk) that no "
                   "gradient flows through. Let the gradient through, or call requires_grad_(False).")
    elif cut_off:
        why.append(f"{whose(cut_off)} ran in the first forward pass, yet their output has not reached the loss: "
                   "it is not used (an output the loss ignores, such as a pooler) or the graph is cut after them "
                   "(detach(), .data or .item()), unless the loss uses it on rare batches only (then this is "
                   "expected). Let the gradient through, or call requires_grad_(False).")
    if not_called and reached is None:
        why.append(f"{whose(not_called)} were not called in the first forward pass: a layer no forward uses (remove "
                   "it, or call requires_grad_(False)), or one used on rare batches only (then this is expected).")
    if unknown and reached is None:
        why.append("A layer that is never used in the forward, or a branch cut off by detach(), no_grad(), .data "
                   "or .item(). Use it, remove it, or call requires_grad_(False).")
    return Verdict(Finding(
        Kind.MISSING_GRAD, Severity.WARNING,
        f"{len(names)} of {trainable} trainable parameters received no gradient on any of the {observed} "
        f"optimizer step(s) observed since step {since}: {quoted(ordered)}. {' '.join(why)}"
        f"{'' if reached is not None else ' ' + DDP_NOTE}",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(names),
         "layers": list(dict.fromkeys(module_of(n) or n for n in ordered))[:NAMES_IN_DETAILS],
         "since_step": since, "steps_without_gradient": observed,
         "cut_off": cut_off[:NAMES_IN_DETAILS], "not_called": not_called[:NAMES_IN_DETAILS],
         "no_graph": no_graph[:NAMES_IN_DETAILS],
         **({"ddp": "find_unused_parameters=True is required under DDP while these stay unused"} if reached is None
            else {"cause": {"where": reached.where, "summary": reached.summary}})}),
        list(names), steps=steps)


def judge_intermittent(names: Sequence[str], optimizer: Any, positions: Positions,
                       history: MissingHistory) -> Verdict | None:
    """``intermittent_grad`` (info): parameters without a gradient now that had one on earlier steps."""
    if not names:
        return None
    ordered = input_to_output(names, positions)
    fractions = {name: round(history.received_fraction(name, optimizer), 3) for name in ordered[:NAMES_IN_DETAILS]}
    shown = ", ".join(f"`{name}` {fractions[name]:.0%}" for name in ordered[:3])
    return Verdict(Finding(
        Kind.INTERMITTENT_GRAD, Severity.INFO,
        f"{len(names)} trainable parameter(s) that had gradients on earlier steps got none on this one "
        f"(fraction of check steps with a gradient: {shown}{' ...' if len(names) > 3 else ''}): conditional "
        "computation such as routing to experts, LayerDrop or branches taken on some inputs only. Expected for "
        "such models; under DDP they need find_unused_parameters.",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(names),
         "layers": list(dict.fromkeys(module_of(n) or n for n in ordered))[:NAMES_IN_DETAILS],
         "received_fraction": fractions}),
        list(names))


class CandidateWatch:
    """The candidates, looked at on every step of their optimizer until they get a gradient or are confirmed
    (``.grad is None``: no device work). ``anchors`` had a gradient on the check step: all of them without one
    says no backward ran (a ``training_step`` that returned None)::

        >>> import torch
        >>> used, unused = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> used.grad = torch.ones(1)
        >>> watch = CandidateWatch()
        >>> watch.replace(None, ["unused"], ["used"], ["used", "unused"], [used, unused])
        >>> watch.look(None)
        ([], ['unused'])
        >>> used.grad = None; watch.look(None) is None  # no backward ran on this step: nothing to learn
        True
    """

    def __init__(self) -> None:
        self.watched: list[tuple[str, torch.Tensor, Any]] = []
        self.anchors: dict[Any, list[torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.watched)

    def replace(self, optimizer: Any, names: Sequence[str], anchors: Sequence[str], index_names: Sequence[str],
                params: Sequence[torch.Tensor]) -> None:
        """Watch ``names`` (instead of what was watched) and ``anchors`` on ``optimizer``'s steps; ``index_names``
        and ``params`` say which tensor is which."""
        self.watched = [entry for entry in self.watched if entry[2] != optimizer]
        if not names:
            return
        position = {name: i for i, name in enumerate(index_names)}
        self.watched += [(name, params[position[name]], optimizer) for name in names if name in position]
        self.anchors[optimizer] = [params[position[name]] for name in anchors if name in position]

    def look(self, optimizer: Any) -> tuple[list[str], list[str]] | None:
        """The watched parameters of ``optimizer`` with and without a gradient now (None: none, or no backward)."""
        mine = [(name, param) for name, param, owner in self.watched if owner == optimizer]
        anchors = self.anchors.get(optimizer)
        if not mine or (anchors and all(param.grad is None for param in anchors)):
            return None
        return ([name for name, param in mine if param.grad is not None],
                [name for name, param in mine if param.grad is None])

    def drop(self, names: Iterable[str]) -> None:
        done = set(names)
        if done:
            self.watched = [entry for entry in self.watched if entry[0] not in done]

    def clear(self) -> None:
        self.watched, self.anchors = [], {}
