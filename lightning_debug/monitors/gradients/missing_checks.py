"""Missing gradients, judged on check steps with the candidates watched on every step, and the parameters that
gradients do not train on purpose (:class:`.OutsideTraining`): the part of the gradient monitor that says which
parameters are left out of training, mixed into :class:`.GradientMonitor`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_debug.checks.numerics import user_name
from lightning_debug.core.findings import Finding
from lightning_debug.core.numerics import HostNumerics
from lightning_debug.core.session import Where
from lightning_debug.monitors.gradients.history import GradientHistory
from lightning_debug.monitors.gradients.missing import check_verdicts, judge_missing
from lightning_debug.monitors.gradients.pending import PendingCheck
from lightning_debug.monitors.gradients.trainability import (FrozenCause, OutsideTraining, frozen_by_optimizer,
                                                             static_frozen_verdicts)
from lightning_debug.monitors.gradients.verdict import Verdict
from lightning_debug.monitors.gradients.watch import CandidateWatch


class MissingChecks:
    """The missing-gradient and outside-training judgement; the monitor provides the state and the recording."""

    history: GradientHistory
    context: Any
    static_frozen: dict[FrozenCause, list[str]]
    _outside: OutsideTraining
    _watch: CandidateWatch
    _positions: dict[str, tuple[int, int]]
    _trainable: int
    _static_recorded_step: int
    _audited: dict[Any, Any]
    _param_groups: Any

    if TYPE_CHECKING:  # the monitor's own
        def _record(self, verdict: Verdict | None, step: int, where: Where, count: str | None = None) -> bool: ...

        def emit(self, finding: Finding, step: int, where: Where | None = None) -> None: ...

    def _judge_missing(self, pending: PendingCheck, host: HostNumerics, optimizer: Any) -> None:
        """Parameters that gradients do not train on purpose are not judged here (see :class:`.OutsideTraining`)."""
        missing = self.history.missing
        without, judged = host.missing, host.param_names
        if self._outside.names:
            outside = self._outside.names
            without, judged = [n for n in without if n not in outside], [n for n in judged if n not in outside]
        seen = missing.observe_check(pending.step, optimizer, without, judged)
        self._trainable = len(judged)
        if seen.confirmed or seen.newly_confirmed:  # a confirmed candidate changed by other code is left out now
            self._left_out(seen.confirmed + seen.newly_confirmed, pending.step, pending.where)
            seen.confirmed = [n for n in seen.confirmed if n not in self._outside.names]
            seen.newly_confirmed = [n for n in seen.newly_confirmed if n not in self._outside.names]
        if seen.candidates:
            self.history.counts["missing"] += 1
        for verdict in check_verdicts(pending.step, seen, optimizer, self._trainable, self._positions, missing):
            self._record(verdict, pending.step, pending.where)
        if pending.judged is not None:
            waiting = [n for n in seen.candidates if not missing.candidates[n].confirmed]
            replicas = missing.replicas_after_check(without) if waiting else []
            self._watch.replace(optimizer, waiting + replicas, host.grad_names, pending.judged.names,
                                pending.judged.params)

    def _audit_trainable(self, optimizer: Any, index: Any) -> None:
        """Parameters made trainable during the run (``requires_grad_(True)`` on a frozen backbone, which a loop must
        also hand to its optimizer) are looked up in the param groups as at fit start. Done when ``optimizer``'s
        index of the trainable parameters was built again (rare: it is valid by the parameters' identity)."""
        audited = self._audited.get(optimizer)
        if index is audited:
            return
        self._audited[optimizer] = index
        if audited is None:
            return
        self._param_groups = self.context.param_groups()
        named = [(user_name(name), p) for name, p in self.context.named_parameters() if p.requires_grad]
        frozen, _ = frozen_by_optimizer(named, self._param_groups)
        self._outside.extend(named, frozen.get(FrozenCause.NOT_IN_OPTIMIZER, []))
        lost = self.static_frozen.get(FrozenCause.REQUIRES_GRAD_FALSE)
        if lost:  # made trainable since: no longer frozen
            trainable = {name for name, _ in named}
            self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE] = [name for name in lost if name not in trainable]
            if not self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE]:
                del self.static_frozen[FrozenCause.REQUIRES_GRAD_FALSE]

    def _judge_outside(self, pending: PendingCheck) -> None:
        frozen, info = self._outside.judge(pending.outside_with_grad)
        if info is not None:
            self.emit(info, pending.step, pending.where)
        if frozen and self.static_frozen.get(FrozenCause.NOT_IN_OPTIMIZER) != frozen:
            self.static_frozen[FrozenCause.NOT_IN_OPTIMIZER] = frozen
            if pending.step == self._static_recorded_step:  # later check steps record it with the static causes
                for verdict in static_frozen_verdicts({FrozenCause.NOT_IN_OPTIMIZER: frozen}):
                    self._record(verdict, pending.step, pending.where)

    def _observe_candidates(self, step: int) -> None:
        """The parameters that never had a gradient, looked at on this optimizer's step (no device work)."""
        looked = self._watch.look(self.context.optimizer_index)
        if looked is None:
            return
        missing = self.history.missing
        resolved = [n for n in looked[0] if n in missing.candidates]
        confirmed = missing.observe_step(step, *looked)
        if resolved or confirmed:  # fewer candidates wait: fewer replicas are worth watching
            wanted = set(missing.replicas_to_watch())
            self._watch.drop(resolved + confirmed + [n for n in looked[0] + looked[1]
                                                     if n not in missing.candidates and n not in wanted])
        self._record_confirmed(confirmed, step)

    def _left_out(self, names: list[str], step: int, where: Where) -> list[str]:
        """``names`` (confirmed without a gradient) less those whose values changed all the same, which from now on
        are :class:`.OutsideTraining`'s (an info, once for them)."""
        kept, info = self._outside.updated_elsewhere(names, self.history.missing.had_gradient)
        if info is not None:
            self.emit(info, step, where)
        return kept

    def _record_confirmed(self, names: list[str], step: int) -> None:
        if names:
            names = self._left_out(names, step, self.context.where())
        self._record(judge_missing(step, names, self._trainable, self._positions, self.history.missing, names), step,
                     self.context.where())
