"""The training loop's silent killers: modules left in eval mode, gradients never zeroed.

``train_mode_in_eval`` watches the first evaluation batch of the fit for dropout that still drops and BatchNorm that
still updates its statistics (:mod:`lightning_debug.checks.stochastic`). ``grad_not_zeroed`` hooks only parameters
still holding a gradient after an optimizer step (a healthy ``zero_grad()`` leaves none); micro-batch accumulation
happens between optimizer steps, and with several optimizers only the stepping one's parameters count (a GAN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_debug.checks.numerics import compiled_wrapper, fused_norms
from lightning_debug.checks.stochastic import RandomCall, RandomInEvaluation
from lightning_debug.config import Area, DebugConfig
from lightning_debug.core.findings import Finding, quoted
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.monitor import Event, Monitor
from lightning_debug.core.readback import Readback
from lightning_debug.core.rules import ModuleWalk, Moment, Recorded, rule
from lightning_debug.core.session import Where
from lightning_debug.monitors.repeats import BatchWindow, judge_repeats

NAMES_SHOWN = 5
NAMES_IN_DETAILS = 20
PROBES_PER_GROUP = 16
FROZEN_STATISTICS = "normalization statistics"  # the episode key of frozen_statistics_finding
MODE_DEPENDENT = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _mode_matters(module: nn.Module) -> bool:
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.track_running_stats
    return isinstance(module, MODE_DEPENDENT)


def modules_left_in_eval(root: nn.Module) -> list[tuple[str, list[str]]]:
    """The outermost trained modules in eval mode inside a training ``root``, with the Dropout/BatchNorm layers
    that changes (a frozen backbone is left alone)::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
        >>> _ = model[1].eval()
        >>> modules_left_in_eval(model)
        [('1', ['1.1'])]
        >>> _ = model[1].requires_grad_(False)
        >>> modules_left_in_eval(model)
        []
    """
    if not root.training:
        return []
    found: list[tuple[str, list[str]]] = []

    def visit(prefix: str, module: nn.Module, parent_trains: bool) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if child.training:
                visit(path, child, parent_trains)
                continue
            own = list(child.parameters())
            trained = any(p.requires_grad for p in own) if own else parent_trains
            affected = [f"{path}.{sub}" if sub else path for sub, m in child.named_modules() if _mode_matters(m)]
            if trained and affected:
                found.append((path, affected))

    visit("", root, any(p.requires_grad for p in root.parameters()))
    return found


def keeps_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is itself a normalization layer with running statistics (eval mode only freezes them)::

        >>> keeps_statistics(nn.BatchNorm2d(4)), keeps_statistics(nn.Dropout()), keeps_statistics(nn.InstanceNorm1d(2))
        (True, False, False)
    """
    return isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)) and \
        bool(module.track_running_stats)


def frozen_statistics_finding(step: int, layers: list[str]) -> Finding:
    """``eval_mode_in_training`` (info) for normalization layers put in eval one by one while their parents train:
    the frozen-statistics recipe of small-batch fine-tuning (``norm_eval``), not a forgotten ``.train()``::

        >>> finding = frozen_statistics_finding(0, ["net.1", "net.4"])
        >>> finding.severity.value, finding.details["count"]
        ('info', 2)
    """
    return Finding(
        Kind.EVAL_MODE_IN_TRAINING, Severity.INFO,
        f"{len(layers)} normalization layer(s) {quoted(layers, NAMES_SHOWN)} run in eval mode while the model trains "
        f"(step {step}): their running statistics stay frozen and their affine parameters train, the frozen-statistics "
        "recipe of small-batch fine-tuning (norm_eval). If that is not intended, call `.train()` on them.",
        {"modules": layers[:NAMES_IN_DETAILS], "affected": layers[:NAMES_IN_DETAILS], "count": len(layers),
         "frozen_statistics": True})


def eval_mode_finding(step: int, name: str, affected: list[str]) -> Finding:
    """``eval_mode_in_training`` for module ``name`` ("" for the whole model)::

        >>> finding = eval_mode_finding(4, "encoder", ["encoder.drop"])
        >>> finding.kind.value, finding.details
        ('eval_mode_in_training', {'modules': ['encoder'], 'affected': ['encoder.drop'], 'count': 1})
    """
    subject = f"`{name}`" if name else "The whole model"
    layers = quoted(affected, NAMES_SHOWN)
    return Finding(
        Kind.EVAL_MODE_IN_TRAINING, Severity.WARNING,
        f"{subject} is in eval mode while the model trains (step {step}): its Dropout/BatchNorm layers "
        f"{layers} behave as in inference (no dropout, running statistics frozen) although it has "
        "trainable parameters. Call `.train()` on it (or on the model after evaluating); if frozen statistics "
        "are intended, freeze its parameters too.",
        {"modules": [name], "affected": affected[:NAMES_IN_DETAILS], "count": len(affected)})


def random_in_evaluation_finding(step: int, calls: Sequence[RandomCall]) -> Finding:
    """``train_mode_in_eval``: the calls that drew randomness during the first evaluation batch::

        >>> call = RandomCall("torch.nn.functional.dropout", {"file": "model.py", "line": 9, "code": "F.dropout(h)"}, 3)
        >>> finding = random_in_evaluation_finding(0, [call])
        >>> finding.kind.value, finding.details["calls"][0]["count"]
        ('train_mode_in_eval', 3)
    """
    shown = "; ".join(f"{call.where()} x{call.count}" for call in calls[:NAMES_SHOWN])
    return Finding(
        Kind.TRAIN_MODE_IN_EVAL, Severity.WARNING,
        f"While the model was evaluated (first evaluation batch, step {step}), {len(calls)} call(s) still drew "
        f"randomness as in training: {shown}. Every evaluation runs a random sub-network: pass "
        "training=self.training to functional dropout (its default is True) and do not put submodules back in train "
        "mode inside forward.",
        {"calls": [{"operation": call.operation, "source": call.source, "count": call.count}
                   for call in calls[:NAMES_IN_DETAILS]]})


def held_gradients(named: Iterable[tuple[str, torch.nn.Parameter]], stepped: set[int],
                   fresh: set[int]) -> tuple[list[tuple[str, torch.nn.Parameter]], set[int]]:
    """The parameters a backward is about to add to while they hold an older gradient, and the ids of those that
    hold none. Only ``stepped`` ids count (empty: all); one in ``fresh`` got this step's gradient from an earlier
    backward (two losses): adding to it is no accumulation across steps::

        >>> a, b, c = (torch.nn.Parameter(torch.ones(1)) for _ in range(3))
        >>> a.grad, b.grad = torch.ones(1), torch.ones(1)
        >>> held, empty = held_gradients([("a", a), ("b", b), ("c", c)], stepped=set(), fresh={id(b)})
        >>> [name for name, _ in held], empty == {id(c)}
        (['a'], True)
    """
    held: list[tuple[str, torch.nn.Parameter]] = []
    empty: set[int] = set()
    for name, parameter in named:
        if stepped and id(parameter) not in stepped:
            continue
        if parameter.grad is None:
            empty.add(id(parameter))
        elif id(parameter) not in fresh:
            held.append((name, parameter))
    return held, empty


def stale_gradients(names: Sequence[str], old_norms: Iterable[float]) -> list[str]:
    """The parameters holding a non-zero earlier gradient (``zero_grad(set_to_none=False)`` leaves zeros)::

        >>> stale_gradients(["a", "b", "c"], [0.0, 2.5, 0.0])
        ['b']
    """
    return [name for name, norm in zip(names, old_norms) if norm > 0]


def grad_not_zeroed_finding(step: int, stale: list[str], reached: int) -> Finding:
    """``grad_not_zeroed``: ``stale`` of the ``reached`` parameters held the previous step's gradient::

        >>> grad_not_zeroed_finding(3, ["w"], 2).message[:60]
        'Gradients are not zeroed between optimizer steps: at step 3 '
    """
    shown = quoted(stale, NAMES_SHOWN)
    return Finding(
        Kind.GRAD_NOT_ZEROED, Severity.ERROR,
        f"Gradients are not zeroed between optimizer steps: at step {step} the backward added to {len(stale)} "
        f"of {reached} parameters that still held the previous step's gradient ({shown}), so every "
        "update uses the sum of all past gradients and the effective step size keeps growing. Call "
        "`optimizer.zero_grad()` after `optimizer.step()` (or before the backward).",
        {"parameters": stale[:NAMES_IN_DETAILS], "count": len(stale)})


@rule(Kind.EVAL_MODE_IN_TRAINING, at=Moment.MODULE_WALK)
def modules_in_eval(facts: ModuleWalk) -> list[Recorded]:
    """The registered rule: one episode per module left in eval, one info for norms put in eval one by one::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train()
        >>> _ = model[1].eval()
        >>> [(found.key, found.finding.severity.value) for found in modules_in_eval(ModuleWalk(3, model))]
        [('1', 'warning')]
    """
    found: list[Recorded] = []
    frozen: list[str] = []
    for name, affected in modules_left_in_eval(facts.module):
        if affected == [name] and keeps_statistics(facts.module.get_submodule(name)):
            frozen.append(name)
        else:
            found.append(Recorded(eval_mode_finding(facts.step, name, affected), key=name))
    if frozen:
        found.append(Recorded(frozen_statistics_finding(facts.step, frozen), key=FROZEN_STATISTICS))
    return found


@dataclass
class Window:
    """The parameters hooked during one backward, with the norms of the gradients they held before it."""

    step: int
    where: Where
    names: list[str]
    ids: list[int]
    norms: torch.Tensor
    handles: list[Any] = field(default_factory=list)
    touched: set[int] = field(default_factory=set)
    owned: set[int] | None = None  # with several optimizers: the parameters of the one that steps next

    def judged(self) -> list[int]:
        """The positions the backward reached, of the optimizer that steps next when known::

            >>> window = Window(0, {}, ["a", "b", "c"], [10, 11, 12], torch.zeros(3), touched={2, 0}, owned={12})
            >>> window.judged()
            [2]
        """
        if self.owned is None:
            return sorted(self.touched)
        return sorted(i for i in self.touched if self.ids[i] in self.owned)


class LoopMonitor(Monitor):
    """See the module docstring; one per run, on gradient check steps (``gradient_checking_frequency``)."""

    area = Area.LOOP
    events = frozenset({Event.START, Event.EPOCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP,
                        Event.AFTER_OPTIMIZER_STEP, Event.BATCH_END, Event.EVALUATION, Event.EXCEPTION})

    def __init__(self, config: DebugConfig, source: str = "lightning-debug") -> None:
        super().__init__(config, source)
        self.mode_checks = 0
        self.eval_modules: dict[str, list[str]] = {}
        self.frozen_statistics: list[str] = []
        self.accumulating: list[str] = []
        self._steps_done = 0
        self._armed = False
        self._checked_backward = False
        self._fresh: set[int] = set()  # parameters whose gradient is this step's own
        self._all_fresh = False  # every one of them: the step's first backward found no gradient at all
        self._probe_layout: tuple[Any, tuple[int, ...]] | None = None
        self._probe_params: list[torch.nn.Parameter] = []
        self._walked_epoch: int | None = None
        self._window: Window | None = None
        self._pending: list[tuple[int, Where, list[str], Readback]] = []
        self._batches = BatchWindow()
        self.repeated_batches = 0
        self.evaluation_watched = False  # the first evaluation batch of the fit was watched for randomness
        self._evaluation_watch: tuple[RandomInEvaluation, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(super().__getstate__(), _window=None, _pending=[], _batches=BatchWindow(), _evaluation_watch=None)

    def start(self, step: int) -> None:
        self._steps_done = step
        self._check_modes(step)

    def epoch_start(self, step: int) -> None:
        self._check_modes(step)

    def _check_modes(self, step: int) -> None:
        model = self.context.module()
        if model is None:
            return
        where = self.context.where()
        self._walked_epoch = where.get("epoch")
        self.mode_checks += 1
        self.run_rules(Moment.MODULE_WALK, ModuleWalk(step, model), step, where)
        self.close_episodes(step, where, {Kind.EVAL_MODE_IN_TRAINING})

    def record_verdict(self, verdict: Any, step: int, where: Where | None = None) -> None:
        """Recorded as every verdict is, keeping the modules report.json lists."""
        details = verdict.finding.details
        if verdict.finding.kind is Kind.EVAL_MODE_IN_TRAINING:
            if details.get("frozen_statistics"):
                self.frozen_statistics = list(details["modules"])
            else:
                self.eval_modules[details["modules"][0]] = list(details["affected"])
        super().record_verdict(verdict, step, where)

    def after_optimizer_step(self, steps_done: int) -> None:
        if steps_done > self._steps_done:
            self._close_window()  # the step's backwards are over
            self._steps_done = steps_done
            self._armed = self.due(steps_done) and not self.context.grads_sharded
            self._checked_backward = False
            self._fresh = set()
            self._all_fresh = False

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        self._close_window()
        if not self.due(step):
            return
        model = self.context.module()
        if model is not None and not model.training:
            self.record_verdict(Recorded(eval_mode_finding(step, "", [
                name or "(the model)" for name, m in model.named_modules() if _mode_matters(m)]), key=""),
                step, self.context.where())
        elif self.context.where().get("epoch") != self._walked_epoch:
            self._check_modes(step)
        if not self._armed:
            return
        self._checked_backward = True
        if self._all_fresh:
            return
        if all(p.grad is None for p in self._probes()):  # zero_grad() cleared them: the gradients are this step's own
            self._all_fresh = True
            return
        parameters = self.numerics.index(self.context.named_parameters)
        stepped = {id(p) for group in self.context.param_groups() for p in group.get("params", [])}
        held, empty = held_gradients(zip(parameters.names, parameters.params), stepped, self._fresh)
        self._fresh.update(empty)
        if not held:
            return
        window = self._window = Window(step, self.context.where(), [name for name, _ in held],
                                       [id(p) for _, p in held],
                                       fused_norms([p.grad for _, p in held]))  # type: ignore[misc]
        for index, (_, parameter) in enumerate(held):
            window.handles.append(parameter.register_hook(lambda grad, index=index: window.touched.add(index)))

    def _probes(self) -> list[torch.nn.Parameter]:
        """A few trainable parameters of every param group: ``zero_grad()`` clears a whole optimizer, so when these
        hold no gradient no other parameter need be touched (half a microsecond each)."""
        groups = self.context.param_groups()
        layout = (self.numerics.index(self.context.named_parameters), tuple(len(g.get("params", [])) for g in groups))
        if self._probe_layout is None or self._probe_layout[0] is not layout[0] or self._probe_layout[1] != layout[1]:
            lists = [list(g.get("params", [])) for g in groups] or [layout[0].params]
            picked = [p for ps in lists for p in ps[::max(1, len(ps) // PROBES_PER_GROUP)] + ps[-1:]]
            self._probe_layout, self._probe_params = layout, [p for p in picked if p.requires_grad]
        return self._probe_params

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: Any) -> None:
        """With several optimizers, the open window is judged on the parameters of the one stepping now."""
        window = self._window
        if window is not None and self.numerics.several_optimizers and optimizer is not None:
            window.owned = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def batch_end(self, step: int, batch: Any) -> None:
        self._close_window()
        if self._checked_backward:
            self._armed = self._checked_backward = False
        if self._batches.collecting or self.due(step):  # the batches of each check step's window (:mod:`.repeats`)
            where = self.context.where()
            self._batches.add(step, self.due(step), where.get("epoch"), batch, where)

    def exception(self, step: int, error: BaseException, batch: Any) -> None:
        self._close_window(evaluate=False)
        self._end_evaluation_watch(judge=False)

    # --- randomness in evaluation ----------------------------------------------------------------
    def evaluation(self, step: int, started: bool) -> None:
        """The first evaluation batch of the fit runs under :class:`RandomInEvaluation` (Python-level function
        interception for that one batch; a compiled model is not watched)."""
        if not started:
            self._end_evaluation_watch()
            return
        if self.evaluation_watched or self._evaluation_watch is not None:
            return
        self.evaluation_watched = True
        model = self.context.module()
        if model is None or any(compiled_wrapper(module) for module in model.modules()):
            return
        watch = RandomInEvaluation()
        watch.__enter__()
        self._evaluation_watch = (watch, step)

    def _end_evaluation_watch(self, judge: bool = True) -> None:
        held, self._evaluation_watch = self._evaluation_watch, None
        if held is None:
            return
        watch, step = held
        watch.__exit__(None, None, None)
        if judge and watch.calls:
            self.emit(random_in_evaluation_finding(step, list(watch.calls.values())), step, self.context.where())

    def _close_window(self, evaluate: bool = True) -> None:
        """The backward is over: drop the hooks; the old norms of the parameters it reached are read later."""
        window, self._window = self._window, None
        if window is None:
            return
        for handle in window.handles:
            handle.remove()
        self._fresh.update(window.ids[i] for i in window.touched)
        touched = window.judged()
        if evaluate and touched:
            norms = window.norms[torch.tensor(touched, device=window.norms.device)]
            self._pending.append((window.step, window.where, [window.names[i] for i in touched],
                                  Readback(norms, blocking=False)))

    def poll(self, final: bool = False) -> None:
        window = self._batches.take(final)
        while window is not None:
            step, repeats, judged, where = window
            finding = judge_repeats(step, repeats, judged, self.verdicts)
            if finding is not None:
                self.repeated_batches = repeats
                self.record(finding, step, where, key=finding.kind.value)
            self.close_episodes(step, where, {Kind.REPEATED_BATCH})
            window = self._batches.take(final)
        while self._pending and (final or self._pending[0][3].ready()):
            step, where, names, readback = self._pending.pop(0)
            stale = stale_gradients(names, readback.values())
            if stale:
                self.accumulating = stale[:NAMES_IN_DETAILS]
                self.record(grad_not_zeroed_finding(step, stale, len(names)), step, where)
            self.close_episodes(step, where, {Kind.GRAD_NOT_ZEROED})

    def finalize(self, step: int) -> None:
        self._end_evaluation_watch()
        self._close_window()
        self.poll(final=True)
        super().finalize(step)

    def restore(self) -> None:
        self._end_evaluation_watch(judge=False)
        self._close_window(evaluate=False)
        self._batches.clear()

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), mode_checks=self.mode_checks, evaluation_watched=self.evaluation_watched,
                    eval_modules=dict(self.eval_modules),
                    frozen_statistics=list(self.frozen_statistics),
                    accumulating=list(self.accumulating), repeated_batches=self.repeated_batches)
