"""Non-finite loss, gradients and parameters: what was found, and what the run does about it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_debug.checks.batches import floating_tensors, nonfinite_samples
from lightning_debug.checks.localize import Cause, capture_rng, localize
from lightning_debug.checks.numerics import nonfinite_named
from lightning_debug.checks.trends import LossTrend
from lightning_debug.config import AnomalyMode, Area, DebugConfig, DebugLevel
from lightning_debug.core.buffers import BufferSnapshot
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import COMMON_CAUSES, Kind, Severity, advice_for_cause
from lightning_debug.core.monitor import Decision, Event, Monitor, NumericsSource, Replay
from lightning_debug.core.session import Where
from lightning_debug.core.step_numerics import HostNumerics
from lightning_debug.monitors.divergence import loss_finding
from lightning_debug.errors import AnomalyError

NAMES_IN_DETAILS = 20
INPUT_STEPS_KEPT = 8
BAD_BATCHES_KEPT = 20
InputRows = list[tuple[Where, list[tuple[str, torch.Tensor]]]]

ACTIONS = {
    AnomalyMode.WARN: "Training continues (anomaly_detection_mode='warn').",
    AnomalyMode.RAISE: "Raising AnomalyError (anomaly_detection_mode='raise').",
    AnomalyMode.SKIP: "This optimizer step was skipped: no update, no momentum, no weight decay, and any "
                      "BatchNorm running statistics its forward changed are restored (anomaly_detection_mode='skip').",
    AnomalyMode.STOP: "The non-finite update was dropped (any BatchNorm running statistics its forward changed are "
                      "restored) and training stops after this step (anomaly_detection_mode='stop').",
}


def _names(items: list[tuple[str, float]]) -> str:
    shown = ", ".join(f"`{name}`" for name, _ in items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _on_ranks(ranks: list[int], world_size: int) -> str:
    return f" on rank {', '.join(map(str, ranks))}" if world_size > 1 and ranks else ""


def _advice(cause: Cause) -> str:
    return advice_for_cause(cause.where, cause.operation)


@dataclass
class Verdict:
    """What one checked step shows, before anything is written: the same on every rank."""

    bad_loss_ranks: list[int]
    bad_grads: list[tuple[str, float]]
    bad_params: list[tuple[str, float]]
    uses_grad_scaler: bool
    last_finite_param_step: int
    bad_input_ranks: list[int]
    input_rows: list[dict[str, Any]]
    params: "ParamsOrigin | None" = None

    @property
    def amp_overflow(self) -> bool:
        """fp16 overflow the GradScaler handles: non-finite gradients with a finite loss and weights."""
        return self.uses_grad_scaler and bool(self.bad_grads) and not self.bad_loss_ranks and not self.bad_params

    def kinds(self, cause: Cause | None) -> list[Kind]:
        """The kinds this step shows; ``nonfinite_input`` alone decides nothing (its loss does)."""
        inputs = [Kind.NONFINITE_INPUT] if self.bad_input_ranks else []
        if self.amp_overflow:
            return [*inputs, Kind.AMP_OVERFLOW_SKIPPED]
        kinds = inputs + ([Kind.NONFINITE_PARAM] if self.bad_params else [])
        if cause is not None and cause.where == "forward" and cause.operation:
            kinds.append(Kind.NONFINITE_ACTIVATION)
        return kinds + [kind for kind, bad in ((Kind.NONFINITE_LOSS, self.bad_loss_ranks),
                                               (Kind.NONFINITE_GRAD, self.bad_grads)) if bad]


@dataclass
class ParamsOrigin:
    """When and why the non-finite parameters of a checked step became non-finite, as far as it is known.

    ``update_step``: the optimizer step whose update made them non-finite (None when it cannot be
    told); ``by_gradients``: that update applied non-finite gradients (so the parameters are a
    consequence of ``nonfinite_grad``); ``before_forward``: the weights this step's forward used
    were already non-finite (so its loss and gradients follow from them); ``label``: the step the
    finding is recorded at.
    """

    label: int
    update_step: int | None
    by_gradients: bool
    before_forward: bool
    since: str


class AnomalyMonitor(Monitor):
    """See :class:`lightning_debug.AnomalyDetectionCallback` for the behaviour users rely on."""

    area = Area.ANOMALY
    kinds = frozenset({Kind.NONFINITE_LOSS, Kind.NONFINITE_GRAD, Kind.NONFINITE_PARAM, Kind.NONFINITE_ACTIVATION,
                       Kind.AMP_OVERFLOW_SKIPPED, Kind.NONFINITE_INPUT, Kind.NONFINITE_BUFFER, Kind.LOSS_SPIKE,
                       Kind.LOSS_DIVERGENCE})
    deciding = frozenset({Kind.NONFINITE_LOSS, Kind.NONFINITE_GRAD, Kind.NONFINITE_PARAM, Kind.NONFINITE_ACTIVATION})
    events = frozenset({Event.START, Event.BATCH_START, Event.BEFORE_BACKWARD, Event.BEFORE_OPTIMIZER_STEP})
    frequency_field = "anomaly_check_frequency"

    def __init__(self, config: DebugConfig, source: str = "AnomalyDetectionCallback") -> None:
        super().__init__(config, source)
        self.anomaly_count = 0
        self.skipped_steps = 0
        self.last_finite_param_step = -1
        self._previous_detect_anomaly: tuple[bool, bool] | None = None
        self._positions: dict[int, Where] = {}
        self.localizes = config.level >= DebugLevel.ADVANCED
        self._step_inputs: tuple[int, list[tuple[Any, Any]]] = (-1, [])
        self._last_grad_norm = float("nan")
        self._learning_rates: list[float] = []
        self._inputs: dict[int, InputRows] = {}
        self.bad_batches: list[dict[str, Any]] = []
        # The last checked step: (step, its gradients were non-finite, its global gradient norm).
        self._last_check: tuple[int, bool, float] = (-1, False, math.nan)
        self._params_broken_at: int | None = None
        self._largest_value: dict[int, float] = {}
        self._weights_before: tuple[int, torch.Tensor | None] = (-1, None)
        self._buffers = BufferSnapshot()
        self.restored_buffer_steps = 0
        self.loss_trend = LossTrend()

    @property
    def mode(self) -> AnomalyMode:
        return self.config.anomaly_detection_mode

    def start(self, step: int) -> None:
        if self.config.level >= DebugLevel.EXPERT and self._previous_detect_anomaly is None:
            # check_nan=False: autograd must not raise inside the framework's backward (that would end a
            # warn/skip/stop run); a NaN is named by the replay, which checks NaN inside its own try.
            self._previous_detect_anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=False)
            self.warn("level=EXPERT records every forward operation's stack (torch.autograd.set_detect_anomaly, "
                      "several times the step time) so that an error in backward names its forward line; use it to "
                      "pin down a known problem.")
        if self.localizes and self.context.replay() is None:
            self.warn("level=ADVANCED names the cause of a NaN by replaying the step, which this training loop does "
                      "not allow (manual optimization steps the optimizers inside training_step); NaN/Inf are still "
                      "found, without their cause.")

    def restore(self) -> None:
        if self._previous_detect_anomaly is not None:
            enabled, check_nan = self._previous_detect_anomaly
            torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)
            self._previous_detect_anomaly = None

    def batch_start(self, step: int, batch: Any, captured: Any) -> None:
        """On check steps, count the batch's floating tensors that hold NaN/Inf (fused, read back with the
        loss flag) and keep a reference to them, to name the samples if they do; from ADVANCED also keep
        the micro-batch and the RNG state, for a replay. With several optimizers every batch is observed
        (cheap device work, no sync): which optimizer steps next, and whether its check is due, is not
        known yet."""
        if not (self.due(step) or self.numerics.several_optimizers):
            return
        self._measure_weights_before_forward(step)
        if self.mode in (AnomalyMode.SKIP, AnomalyMode.STOP) and self._buffers.step != step:
            model = self.context.module()
            if model is not None:  # before the step's first forward: what a skipped step restores
                self._buffers.take(model, step)
        tensors = floating_tensors(batch)
        if tensors:
            self.numerics.observe_inputs(step, [t for _, t in tensors])
            self._inputs.setdefault(step, []).append((self.context.where(), tensors))
            while len(self._inputs) > INPUT_STEPS_KEPT:
                self._inputs.pop(min(self._inputs))
        if not self.localizes:
            return
        if self._step_inputs[0] != step:
            self._step_inputs = (step, [])
        self._step_inputs[1].append((captured, capture_rng()))

    def _measure_weights_before_forward(self, step: int) -> None:
        """When the previous step's update may have overflowed the weights (see :meth:`_update_may_overflow`),
        flag on the device whether they are finite before this step's forward: a step-late parameter scan
        sees them only after this step's update, and this tells which update broke them (rare: one pass
        over the weights, read only if this step turns out non-finite)."""
        checked, grads_bad, norm = self._last_check
        if (self._weights_before[0] == step or checked != step - 1 or grads_bad or self._params_broken_at is not None
                or not self._update_may_overflow(norm)):
            return
        index = self.numerics.index(self.context.named_parameters, plain_sharded=self.context.grads_sharded)
        if len(index):
            self._weights_before = (step, (~torch.isfinite(index.plan.squares(index.local_params()))).any())

    def before_backward(self, step: int, loss: torch.Tensor) -> None:
        if self.due(step) or self.numerics.several_optimizers:
            self.numerics.observe_loss(step, loss)

    def before_optimizer_step(self, step: int, optimizer: Any, numerics: NumericsSource) -> Decision:
        """Check this step's numerics and decide what happens to the optimizer step.

        In ``warn`` mode (below ADVANCED) the values are read later without a sync and the step
        continues. Otherwise they are read now (one sync), the cause is named by replaying the step
        when ``level >= ADVANCED`` and a replay is possible, ``raise`` mode raises
        :class:`AnomalyError`, and ``skip``/``stop`` return the decision the run carries out (it drops
        the optimizer step's gradients).

        Decide first, write later: everything that decides (the gathered flags, the replay and the
        parameter scan, both collectives) comes from values every rank shares and runs on every
        rank; the findings are written afterwards, separately guarded, so a write that fails on one
        rank cannot change what that rank decides. A measurement that failed on any rank is a
        flag in the gathered rows, and every rank then continues this step without a decision.
        """
        if not self.optimizer_step_due(step):
            return Decision.CONTINUE
        current = numerics()
        where = self.context.where()
        self._learning_rates = [float(group.get("lr", float("nan"))) for group in optimizer.param_groups]
        replay = self.context.replay() if self.localizes else None
        if self.mode is AnomalyMode.WARN and replay is None:
            self._positions[current.step] = where
            if len(self._positions) > 64:
                self._positions.pop(min(self._positions))
            current.subscribe(self._on_numerics)
            return Decision.CONTINUE
        host = current.read(blocking=True)
        if host.failure is not None:
            self.measurement_failed(host.failure, "every rank continues this step without an anomaly decision",
                                    host.step)
            return Decision.CONTINUE
        model = self.context.module()
        if replay is not None and current.index.sharded:
            replay = None
            self._no_replay_on_sharded(current.index.sharded_names)
        cause = self._replay(host, model, replay) if model is not None and replay is not None else None
        verdict = self._judge(host)
        self.session.failures.call("writing the anomaly findings", self._write_findings, host, where, cause, verdict)
        kinds = [kind for kind in verdict.kinds(cause) if kind in self.deciding]
        if not kinds or self.mode is AnomalyMode.WARN:
            return Decision.CONTINUE
        if self.mode is AnomalyMode.RAISE:
            names = [n for n, _ in (verdict.bad_params or verdict.bad_grads)][:NAMES_IN_DETAILS]
            ranks = verdict.bad_loss_ranks
            raise AnomalyError(
                f"lightning-debug: non-finite {', '.join(k.value.removeprefix('nonfinite_') for k in kinds)} at step "
                f"{host.step}" + (f" (parameters: {', '.join(names)})" if names else "")
                + _on_ranks(ranks, len(host.ranks)) + (f". Cause: {cause.summary}" if cause is not None else ""),
                step=host.step, kinds=[kind.value for kind in kinds],
                details={"parameters": names, "ranks": ranks, "cause": cause.to_dict() if cause else None})
        self.skipped_steps += 1
        decision = Decision.STOP if self.mode is AnomalyMode.STOP or Kind.NONFINITE_PARAM in kinds else Decision.SKIP
        return self._undo_forward(host, where, decision)

    def _undo_forward(self, host: HostNumerics, where: Where, decision: Decision) -> Decision:
        """A dropped step leaves no trace: put back the buffers its forward changed (BatchNorm running
        statistics, copied before the forward), then check them; buffers that are still non-finite (no
        copy of this step, or broken earlier, on an unchecked step) are named and training stops.

        Runs on every rank (the decision is shared); the check's verdict is reduced across ranks, so
        every rank stops together.
        """
        model = self.context.module()
        if model is None:
            return decision
        try:
            restored = self._buffers.restore(model, host.step)
            broken = self._buffers.nonfinite(model)
        except Exception as failure:  # still join the reduction below, so that no rank decides alone
            self.session.failures.record("restoring the buffers of a skipped step", failure,
                                         "the buffers are left as the forward changed them")
            restored, broken = False, []
        if not self._buffers.names:  # the same model on every rank: nothing to restore anywhere
            return decision
        device = self.numerics.index(self.context.named_parameters, plain_sharded=self.context.grads_sharded).device
        stop = torch.tensor([1.0 if broken else 0.0], dtype=torch.float64, device=device)
        if len(host.ranks) > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(stop)
        if restored:
            self.restored_buffer_steps += 1
        if not stop.item():
            return decision
        self.session.failures.call("writing the anomaly findings", self._record_buffers, broken, host.step, where,
                                   restored, len(host.ranks))
        return Decision.STOP

    def _record_buffers(self, broken: list[str], step: int, where: Where, restored: bool, world_size: int) -> None:
        why = ("they were already non-finite before this step (a NaN batch on a step that was not checked: set "
               "anomaly_check_frequency=1 with skip)" if restored else
               "no copy of them was taken before this step's forward")
        names = _names([(name, 0.0) for name in broken]) if broken else "on another rank"
        self.record(Finding(
            Kind.NONFINITE_BUFFER, Severity.CRITICAL,
            f"Buffers {names} are NaN/Inf at step {step} and could not be restored: {why}. Evaluation with these "
            "running statistics gives NaN, so training stops instead of continuing over a broken model "
            f"(anomaly_detection_mode='{self.mode.value}'). Restart from a checkpoint, or reset them "
            "(module.reset_running_stats()).",
            {"buffers": broken[:NAMES_IN_DETAILS], "count": len(broken), "restored": restored,
             "world_size": world_size, "action": AnomalyMode.STOP.value}), step, where)

    def _replay(self, host: HostNumerics, model: torch.nn.Module, replay: Replay) -> Cause | None:
        """Localize the first step of an episode of non-finite loss or gradients (every rank at once).

        Whether to replay depends only on values every rank shares, and under distributed training
        every rank replays each of its micro-batches with the same number of calls whatever it finds
        (``localize(same_work=True)``), so collectives inside ``training_step`` still match; a replay
        that raises becomes an ``error`` cause, and the causes are gathered on every rank.
        """
        anomalous = bool(host.ranks_with_nonfinite_loss or host.ranks_with_nonfinite_grads)
        if not anomalous or (self.context.uses_grad_scaler and not host.ranks_with_nonfinite_loss):
            return None
        if any(kind in ("nonfinite_loss", "nonfinite_grad") for kind, _ in self.episodes.open):
            return None
        distributed = len(host.ranks) > 1 and dist.is_available() and dist.is_initialized()
        step, inputs = self._step_inputs
        causes: list[Cause] = []
        if step == host.step:
            for captured, rng in inputs:
                try:
                    cause = localize(model, captured, lambda captured=captured: replay(captured), rng,
                                     check_backward=True, same_work=distributed)
                except Exception as error:
                    cause = Cause("error", f"the replay failed ({type(error).__name__}: {error})")
                causes.append(cause)
                if cause.where not in ("not_reproduced", "error") and not distributed:
                    break
        found = [c for c in causes if c.where not in ("not_reproduced", "error")]
        own = (found or causes or [Cause("not_reproduced", "no batch was captured for this step")])[0]
        outside = self.context.replay_scope() if causes else None
        if outside and own.where == "not_reproduced":
            own = Cause("not_reproduced", f"the replayed forward of the model gave finite outputs, so the NaN/Inf "
                        f"comes from {outside}, which the replay does not cover (a log or division of a value that "
                        "reaches 0 in the loss function, or NaN/Inf in the targets)", replay_ms=own.replay_ms)
        own.replay_ms = sum(c.replay_ms for c in causes)
        if distributed:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own.to_dict())
            reproduced = [(rank, c) for rank, c in enumerate(gathered)
                          if c and c.get("where") not in ("not_reproduced", "error")]
            if reproduced:
                rank, first = reproduced[0]
                own = Cause(**{k: v for k, v in first.items()})
                own.summary = f"on rank {rank}: {own.summary}"
            own.outputs = dict(own.outputs, per_rank={rank: c.get("summary") for rank, c in enumerate(gathered)})
        return own

    def _no_replay_on_sharded(self, names: list[str]) -> None:
        """Say once why level=ADVANCED names no cause here: a replayed forward of sharded modules
        re-runs their collectives, which every rank would have to enter in lockstep."""
        if self.localizes:
            self.localizes = False
            self.warn(f"level=ADVANCED cannot replay a step of a model with sharded parameters (FSDP, tensor parallel: "
                      f"{_names([(name, 0.0) for name in names])}): the replayed forward would re-run their "
                      "collectives. Non-finite losses, gradients and parameters are still detected "
                      "and named; the operation and module that produced them are not.")

    def finalize(self, step: int) -> None:
        """The last update has not been checked yet: check the parameters once more (one sync).

        This can run on an exception path, where other ranks may not follow, so it issues no
        collective: each rank checks its own shards and rank 0 writes what it finds.
        """
        where = self.context.where()
        index = self.numerics.index(self.context.named_parameters, plain_sharded=self.context.grads_sharded)
        if len(index):
            bad = nonfinite_named(index.names, index.plan.squares(index.local_params()).sqrt())
            if bad:
                last, (checked, grads_bad, _) = self.last_finite_param_step, self._last_check
                known = last == step and checked == step
                since = (f"in the optimizer step at step {step}" if known else
                         f"after step {last}" if last >= 0 else f"by step {step}")
                self._record_params(bad, where, 1, [0], ParamsOrigin(step, step if known else None,
                                                                    known and grads_bad, False, since))
        super().finalize(step)

    def _on_numerics(self, host: HostNumerics) -> None:
        if host.failure is not None:
            self.measurement_failed(host.failure, "every rank continues this step without an anomaly decision",
                                    host.step)
            return
        self._write_findings(host, self._positions.pop(host.step, {"epoch": -1, "batch": -1}), None, self._judge(host))

    def _judge(self, host: HostNumerics) -> "Verdict":
        """What ``host`` shows, and the counts that follow from it; the same on every rank (the parameter
        scan, a collective, runs on every rank when the gathered flags ask for it). Writes nothing."""
        bad_loss_ranks = host.ranks_with_nonfinite_loss
        bad_grads = host.nonfinite_grads()
        scan = bool(bad_loss_ranks or host.ranks_with_nonfinite_grads or host.params_measured)
        inputs = self._inputs.pop(host.step, [])
        for old in [s for s in self._inputs if s < host.step]:
            del self._inputs[old]
        bad_input_ranks = host.ranks_with_nonfinite_inputs
        rows = self._input_rows(inputs, len(host.ranks), host.read_before_update) if bad_input_ranks else []
        verdict = Verdict(bad_loss_ranks, bad_grads, host.nonfinite_params() if scan else [],
                          self.context.uses_grad_scaler, self.last_finite_param_step, bad_input_ranks, rows)
        if verdict.bad_params:
            verdict.params = self._params_origin(host, bool(bad_grads))
            self._params_broken_at = (verdict.params.update_step if verdict.params.update_step is not None
                                      else host.step)
        else:
            self.last_finite_param_step = host.step
            self._params_broken_at = None
        if any(kind in self.deciding for kind in verdict.kinds(None)):
            self.anomaly_count += 1
        elif math.isfinite(host.global_grad_norm):
            self._last_grad_norm = host.global_grad_norm
        self._last_check = (host.step, bool(bad_grads), host.global_grad_norm)
        return verdict

    def _params_origin(self, host: HostNumerics, grads_bad: bool) -> ParamsOrigin:
        """Which update made the parameters non-finite, and whether its gradients did (see :class:`ParamsOrigin`).

        A scan read a step late sees the weights after this step's update: with this step's gradients
        non-finite, that update wrote them, unless the weights were already broken before its forward,
        which the previous check tells (already found non-finite; or its update, with finite gradients,
        was large enough to overflow the parameters' dtype: learning rate times gradient norm). A scan
        before the update sees the weights the forward used: they broke in an earlier update, by
        non-finite gradients when the previous checked step had them.
        """
        step = host.step
        seen_after = host.params_seen_after if host.params_seen_after is not None else step - 1
        last_step, last_grads_bad, last_norm = self._last_check
        if self._params_broken_at is not None and self._params_broken_at < step:
            return ParamsOrigin(step, None, False, True, f"since step {self._params_broken_at}")
        measured_step, broken_before = self._weights_before
        if seen_after >= step and measured_step == step and broken_before is not None:
            if bool(broken_before):  # measured before this step's forward (only after a risky update)
                return ParamsOrigin(step - 1, step - 1, False, True, f"in the optimizer step at step {step - 1}")
            return ParamsOrigin(step, step, grads_bad, False, f"in the optimizer step at step {step}")
        if seen_after >= step:  # the weights after this step's update
            if grads_bad and not (last_step == step - 1 and self._update_may_overflow(last_norm)):
                return ParamsOrigin(step, step, True, False, f"in the optimizer step at step {step}")
            if last_step == step - 1 and not last_grads_bad and self._update_may_overflow(last_norm):
                return ParamsOrigin(step - 1, step - 1, False, True, f"in the optimizer step at step {step - 1}")
            if seen_after == step:
                return ParamsOrigin(step, step, grads_bad, False, f"in the optimizer step at step {step}")
            return ParamsOrigin(seen_after, None, False, False, f"between steps {step} and {seen_after}")
        last = self.last_finite_param_step
        if last == step - 1 and last_step == step - 1:
            return ParamsOrigin(step, step - 1, last_grads_bad, True, f"in the optimizer step at step {step - 1}")
        since = f"between steps {last} and {step}" if last >= 0 else f"before step {step}"
        return ParamsOrigin(step, None, False, True, since)

    def _update_may_overflow(self, grad_norm: float) -> bool:
        """Whether an update with finite gradients of norm ``grad_norm`` could reach the largest value of
        the parameters' dtype: per element at most about lr x norm x 10 (momentum, Adam's normalisation)."""
        if not math.isfinite(grad_norm) or not self._learning_rates:
            return False
        lr = max((abs(lr) for lr in self._learning_rates if math.isfinite(lr)), default=0.0)
        return lr * max(grad_norm, 1.0) * 10.0 >= 0.5 * self._largest_parameter_value()

    def _largest_parameter_value(self) -> float:
        """The largest finite value of the smallest floating dtype among the trainable parameters (rare path)."""
        index = self.numerics.index(self.context.named_parameters, plain_sharded=self.context.grads_sharded)
        cached = self._largest_value.get(id(index))
        if cached is None:
            dtypes = {p.dtype for p in index.params if p.is_floating_point()}
            cached = min((torch.finfo(dtype).max for dtype in dtypes), default=torch.finfo(torch.float32).max)
            self._largest_value = {id(index): cached}
        return cached

    def _write_findings(self, host: HostNumerics, where: Where, cause: Cause | None, verdict: "Verdict") -> None:
        """Record the findings of a judged step: events (global zero), episodes, scalars."""
        step, world = host.step, len(host.ranks)
        bad_loss_ranks, bad_grads, bad_params = verdict.bad_loss_ranks, verdict.bad_grads, verdict.bad_params
        if verdict.bad_input_ranks:
            self._record_inputs(step, where, verdict.input_rows, verdict.bad_input_ranks, world)
        if verdict.amp_overflow:
            self.record(Finding(Kind.AMP_OVERFLOW_SKIPPED, Severity.INFO,
                                f"fp16 gradients overflowed at step {step} ({len(bad_grads)} parameters); the "
                                "GradScaler skips this step and lowers its scale, as designed.",
                                {"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]]}), step, where)
        else:
            origin = verdict.params
            params_first = bool(bad_params) and origin is not None and origin.before_forward
            found = f" Cause: {cause.summary}." if cause is not None else ""
            cause_details = {"cause": cause.to_dict()} if cause is not None else {}
            activation = cause is not None and cause.where == "forward" and bool(cause.operation)
            if bad_params and params_first:
                self._record_params(bad_params, where, world,
                                    host.ranks_with_nonfinite_params if host.params_measured else [], origin)
            if activation and cause is not None:
                self.record(Finding(Kind.NONFINITE_ACTIVATION, Severity.ERROR,
                                    f"At step {step}, {cause.summary}. {_advice(cause)}".strip(),
                                    dict(cause.to_dict(), **({"consequence_of": Kind.NONFINITE_PARAM.value}
                                                             if params_first else {}))),
                            step, where, key=cause.module or "", warn=False)
            if bad_loss_ranks:
                from_inputs = bool(set(bad_loss_ranks) & set(verdict.bad_input_ranks))
                follows = (Kind.NONFINITE_PARAM if params_first else Kind.NONFINITE_INPUT if from_inputs
                           else Kind.NONFINITE_ACTIVATION if activation else None)
                because = (f" because the parameters it was computed with are already non-finite "
                           f"({origin.since}; see nonfinite_param)" if params_first and origin is not None else
                           " and the batch itself holds NaN/Inf (see nonfinite_input)" if from_inputs else "")
                self.record(Finding(
                    Kind.NONFINITE_LOSS, Severity.ERROR,
                    f"The loss is NaN/Inf at step {step}{_on_ranks(bad_loss_ranks, world)}{because}.{found} "
                    + (_advice(cause) if cause is not None and cause.where != "not_reproduced" else
                       "" if params_first else f"Common causes: {COMMON_CAUSES[Kind.NONFINITE_LOSS]}. ")
                    + ACTIONS[self.mode],
                    dict({"ranks": bad_loss_ranks, "world_size": world, "action": self.mode.value},
                         **cause_details, **({"consequence_of": follows.value} if follows else {}))),
                    step, where)
            if bad_grads:
                origin_text = ("the parameters are already non-finite" if params_first else
                               "the loss is already non-finite" if bad_loss_ranks else
                               "the loss is finite, so the problem is in the backward pass: sqrt/pow/norm at 0, "
                               "division by a tiny value, or an overflow")
                follows = (Kind.NONFINITE_LOSS if bad_loss_ranks else Kind.NONFINITE_PARAM if params_first
                           else None)
                self.record(Finding(
                    Kind.NONFINITE_GRAD, Severity.ERROR,
                    f"{len(bad_grads)} of {len(host.grad_names)} gradients are NaN/Inf at step {step}: "
                    f"{_names(bad_grads)}; {origin_text}.{found}"
                    + ("" if follows else " Clip gradients or lower the learning rate if they overflow.")
                    + " " + ACTIONS[self.mode],
                    dict({"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]], "count": len(bad_grads),
                          "ranks": host.ranks_with_nonfinite_grads, "action": self.mode.value}, **cause_details,
                         **({"consequence_of": follows.value} if follows else {}))),
                    step, where)
            if bad_params and not params_first:
                ranks = host.ranks_with_nonfinite_params if host.params_measured else []
                self._record_params(bad_params, where, world, ranks, origin or ParamsOrigin(
                    step, None, False, False, f"before step {step}"))
        trend = loss_finding(self.loss_trend.judge(host.loss_value), step, self._learning_rates)
        if trend is not None:
            self.record(trend, step, where)
        metrics = {"debug/anomaly/count": float(self.anomaly_count)}
        if host.loss_checked:
            metrics["debug/loss_finite"] = 0.0 if bad_loss_ranks else 1.0
        self.log_metrics(step, metrics)
        self.close_episodes(step, where, self.kinds - {Kind.NONFINITE_ACTIVATION})

    def _input_rows(self, inputs: InputRows, world_size: int, synchronous: bool) -> list[dict[str, Any]]:
        """Which tensor of which micro-batch holds NaN/Inf, and which samples (a host read, rare path).

        Read synchronously (every rank at the same point, as the shared flags asked), the rows of every
        rank are gathered; read a step late, each rank knows only its own and rank zero writes them.
        """
        found: list[dict[str, Any]] = []
        for batch_where, tensors in inputs:
            for name, tensor in tensors:
                samples, count = nonfinite_samples(tensor)
                if count:
                    found.append({"tensor": name, "shape": list(tensor.shape), "samples": samples, "count": count,
                                  "epoch": batch_where.get("epoch", -1), "batch": batch_where.get("batch", -1)})
        per_rank = {self.context.rank: found}
        if synchronous and world_size > 1 and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, found)
            per_rank = {rank: rows or [] for rank, rows in enumerate(gathered)}
        return [dict(row, rank=rank) for rank, rank_rows in sorted(per_rank.items()) for row in rank_rows]

    def _record_inputs(self, step: int, where: Where, rows: list[dict[str, Any]], ranks: list[int],
                       world_size: int) -> None:
        """``nonfinite_input``: the tensor, its micro-batch and the samples that hold NaN/Inf."""
        first = rows[0] if rows else None
        if first is not None:
            batch_text = f"batch {first['batch']} of epoch {first['epoch']}"
            what = (f"`{first['tensor']}` (shape {first['shape']}) holds {first['count']} NaN/Inf value(s) in "
                    f"sample(s) {first['samples']} of {batch_text}" + _on_ranks([first["rank"]], world_size))
            more = f"; {len(rows) - 1} more tensor(s) too" if len(rows) > 1 else ""
        else:
            what, more = "a batch tensor holds NaN/Inf (the samples are known on that rank only)", ""
        self.bad_batches = (self.bad_batches + [dict(row, step=step) for row in rows])[-BAD_BATCHES_KEPT:]
        self.record(Finding(
            Kind.NONFINITE_INPUT, Severity.ERROR,
            f"Bad input at step {step}{_on_ranks(ranks, world_size)}: {what}{more}. The data holds NaN/Inf before "
            "the model sees it: check those samples (missing values, a zero std in normalisation, a corrupt file).",
            {"samples": first["samples"] if first else [], "tensor": first["tensor"] if first else None,
             "shape": first["shape"] if first else None, "count": sum(row["count"] for row in rows),
             "ranks": ranks, "inputs": rows[:NAMES_IN_DETAILS]}), step, where)

    def _record_params(self, bad_params: list[tuple[str, float]], where: Where, world_size: int,
                       ranks: list[int], origin: ParamsOrigin) -> None:
        """``nonfinite_param``, with what made the weights non-finite: non-finite gradients applied by an
        update (a consequence: the advice is to fix those), or an update with finite gradients (the
        optimizer overflowed them: the learning rate), or not known (both named)."""
        action = ("Skipping steps cannot repair the weights, so training stops (anomaly_detection_mode='skip')."
                  if self.mode is AnomalyMode.SKIP else ACTIONS[self.mode])
        context = self._optimizer_context()
        if origin.by_gradients:
            why = (f", because the gradients of step {origin.update_step} were non-finite: the update applied "
                   "NaN/Inf gradients to the weights. This is a consequence: fix what made the loss or the "
                   "gradients non-finite (the findings of that step, listed before this one); the weights are "
                   "broken from here on, so restart from a checkpoint once it is fixed. ")
        elif origin.update_step is not None:
            why = (f"{context} although its gradients were finite: the optimizer overflowed the weights. Lower the "
                   "learning rate, clip gradients, check weight decay and fp16 loss scaling. ")
        else:
            why = (f"{context}. If the gradients of the steps in between were finite, the optimizer overflowed "
                   "the weights (lower the learning rate, clip gradients, check weight decay and fp16 loss "
                   "scaling); if they were not, fix what made them non-finite. ")
        self.record(Finding(
            Kind.NONFINITE_PARAM, Severity.CRITICAL,
            f"Parameter {_names(bad_params)} became non-finite {origin.since}{_on_ranks(ranks, world_size)}"
            f"{why}{action}",
            dict({"parameters": [n for n, _ in bad_params[:NAMES_IN_DETAILS]], "count": len(bad_params),
                  "last_finite_step": self.last_finite_param_step, "update_step": origin.update_step,
                  "by_nonfinite_gradients": origin.by_gradients, "action": self.mode.value},
                 **({"consequence_of": Kind.NONFINITE_GRAD.value} if origin.by_gradients else {}))),
            origin.label, where)

    def _optimizer_context(self) -> str:
        learning_rates = sorted(set(self._learning_rates))
        parts = [f"lr {', '.join(f'{lr:.3g}' for lr in learning_rates)}"] if learning_rates else []
        if math.isfinite(self._last_grad_norm):
            parts.append(f"last finite gradient norm {self._last_grad_norm:.3g}")
        return f" ({'; '.join(parts)})" if parts else ""

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    last_finite_param_step=self.last_finite_param_step, loss_trend=self.loss_trend.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.anomaly_count = int(state_dict.get("anomaly_count", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.last_finite_param_step = int(state_dict.get("last_finite_param_step", -1))
        self.loss_trend.load_state_dict(state_dict.get("loss_trend", {}))

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    restored_buffer_steps=self.restored_buffer_steps,
                    mode=self.mode.value, nonfinite_inputs=list(self.bad_batches))
