"""Non-finite loss, gradients and parameters: what was found, and what the run does about it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_debug.checks.localize import Cause, capture_rng, localize
from lightning_debug.checks.numerics import fused_norms, nonfinite_named
from lightning_debug.config import DebugConfig, DebugLevel
from lightning_debug.core.findings import Finding
from lightning_debug.core.monitor import Monitor, Where
from lightning_debug.core.schedule import CheckSchedule
from lightning_debug.core.step_numerics import HostNumerics, StepNumerics
from lightning_debug.errors import AnomalyError

ANOMALY_KINDS = {"nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_activation", "amp_overflow_skipped"}
Replay = Callable[[Any], "torch.Tensor | None"]
NAMES_IN_DETAILS = 20

ACTIONS = {
    "warn": "Training continues (anomaly_detection_mode='warn').",
    "raise": "Raising AnomalyError (anomaly_detection_mode='raise').",
    "skip": "This optimizer step was skipped: no update, no momentum, no weight decay (anomaly_detection_mode='skip').",
    "stop": "The non-finite update was dropped and training stops after this step (anomaly_detection_mode='stop').",
}


def _names(items: list[tuple[str, float]]) -> str:
    shown = ", ".join(f"`{name}`" for name, _ in items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _on_ranks(ranks: list[int], world_size: int) -> str:
    return f" on rank {', '.join(map(str, ranks))}" if world_size > 1 and ranks else ""


def _advice(cause: Cause) -> str:
    """The seed checklist's fixes for what the replay found."""
    operation = (cause.operation or "").lower()
    if cause.where == "inputs":
        return "Clean or filter the data (torch.nan_to_num, drop bad samples) and check the normalization. "
    if cause.where == "backward":
        return ("A backward-only NaN: sqrt/pow/norm/atan2 at exactly 0 has an infinite derivative; add an epsilon "
                "inside (torch.sqrt(x + 1e-12)) or clamp the argument. ")
    if any(name in operation for name in ("log", "div", "reciprocal", "rsqrt")):
        return "Add an epsilon or clamp the argument (torch.log(x.clamp_min(1e-12)), x / (y + 1e-8)). "
    if any(name in operation for name in ("sqrt", "pow")):
        return "The argument is negative or zero: clamp it (x.clamp_min(0) + 1e-12) or use torch.abs. "
    if any(name in operation for name in ("exp", "softmax", "matmul", "linear", "mm", "bmm", "conv")):
        return ("An overflow: values grew too large (max |x| above); lower the learning rate, clip gradients, "
                "normalize inputs or use a numerically stable form (log_softmax, logsumexp). ")
    return ""


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` a no-op: torch optimizers skip parameters whose ``.grad`` is None,
    so there is no update, no momentum and no weight decay for this step."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


class AnomalyMonitor(Monitor):
    """See :class:`lightning_debug.AnomalyDetectionCallback` for the behaviour users rely on."""

    report_name = "anomaly"

    def __init__(self, config: DebugConfig, source: str = "AnomalyDetectionCallback") -> None:
        super().__init__(config, source)
        self.schedule = CheckSchedule(config.anomaly_check_frequency)
        self.anomaly_count = 0
        self.skipped_steps = 0
        self.last_finite_param_step = -1
        self.uses_grad_scaler = False
        self._previous_detect_anomaly: bool | None = None
        self._positions: dict[int, Where] = {}
        self.localizes = config.level >= DebugLevel.ADVANCED
        self._step_inputs: tuple[int, list[tuple[Any, Any]]] = (-1, [])
        self._last_grad_norm = float("nan")
        self._learning_rates: list[float] = []

    @property
    def mode(self) -> str:
        return self.config.anomaly_detection_mode

    def due(self, step: int) -> bool:
        return self.schedule.is_due(step)

    def start(self, uses_grad_scaler: bool) -> None:
        self.uses_grad_scaler = uses_grad_scaler
        if self.config.level >= DebugLevel.EXPERT and self._previous_detect_anomaly is None:
            self._previous_detect_anomaly = torch.is_anomaly_enabled()
            torch.autograd.set_detect_anomaly(True)
            self.warn("level=EXPERT runs every backward under torch.autograd.set_detect_anomaly, which costs "
                      "several times the step time; use it to pin down a known problem.")

    def restore(self) -> None:
        if self._previous_detect_anomaly is not None:
            torch.autograd.set_detect_anomaly(self._previous_detect_anomaly)
            self._previous_detect_anomaly = None

    def capture_inputs(self, step: int, batch: Any) -> None:
        """Keep a reference to this micro-batch and the RNG state, for a replay (ADVANCED+, check steps)."""
        if not (self.localizes and self.due(step)):
            return
        if self._step_inputs[0] != step:
            self._step_inputs = (step, [])
        self._step_inputs[1].append((batch, capture_rng()))

    def observe_loss(self, step: int, loss: torch.Tensor) -> None:
        if self.due(step):
            self.session.observe_loss(step, loss)

    def check(self, numerics: StepNumerics, where: Where, optimizer: torch.optim.Optimizer,
              model: torch.nn.Module | None = None, replay: Replay | None = None) -> str:
        """Check this step's numerics; returns ``"continue"``, ``"skip"`` or ``"stop"``.

        In ``warn`` mode (below ADVANCED) the values are read later without a sync and this returns
        ``"continue"``. Otherwise it reads them now (one sync), names the cause by replaying the step
        when ``level >= ADVANCED`` and ``replay`` is given, raises :class:`AnomalyError` in ``raise``
        mode and drops the optimizer step's gradients in ``skip`` and ``stop`` modes.
        """
        self._learning_rates = [float(group.get("lr", float("nan"))) for group in optimizer.param_groups]
        if self.mode == "warn" and not (self.localizes and replay is not None):
            self._positions[numerics.step] = where
            if len(self._positions) > 64:
                self._positions.pop(min(self._positions))
            numerics.subscribe(self._on_numerics)
            return "continue"
        host = numerics.read(blocking=True)
        cause = self._replay(host, model, replay) if model is not None and replay is not None else None
        kinds = [kind for kind in self._inspect(host, where, cause) if kind != "amp_overflow_skipped"]
        if not kinds or self.mode == "warn":
            return "continue"
        if self.mode == "raise":
            names = [n for n, _ in (host.nonfinite_params() or host.nonfinite_grads())][:NAMES_IN_DETAILS]
            ranks = host.ranks_with_nonfinite_loss
            raise AnomalyError(
                f"lightning-debug: non-finite {', '.join(k.removeprefix('nonfinite_') for k in kinds)} at step "
                f"{host.step}" + (f" (parameters: {', '.join(names)})" if names else "")
                + _on_ranks(ranks, len(host.ranks)) + (f". Cause: {cause.summary}" if cause is not None else ""),
                step=host.step, kinds=kinds,
                details={"parameters": names, "ranks": ranks, "cause": cause.to_dict() if cause else None})
        drop_gradients(optimizer)
        self.skipped_steps += 1
        return "stop" if self.mode == "stop" or "nonfinite_param" in kinds else "skip"

    def _replay(self, host: HostNumerics, model: torch.nn.Module, replay: Replay) -> Cause | None:
        """Localize the first step of an episode of non-finite loss or gradients (every rank at once)."""
        anomalous = bool(host.ranks_with_nonfinite_loss or host.ranks_with_nonfinite_grads)
        if not anomalous or (self.uses_grad_scaler and not host.ranks_with_nonfinite_loss):
            return None
        if any(kind in ("nonfinite_loss", "nonfinite_grad") for kind, _ in self.episodes.open):
            return None
        step, inputs = self._step_inputs
        causes: list[Cause] = []
        if step == host.step:
            for batch, rng in inputs:
                cause = localize(model, batch, lambda batch=batch: replay(batch), rng, check_backward=True)
                causes.append(cause)
                if cause.where != "not_reproduced":
                    break
        own = causes[-1] if causes else Cause("not_reproduced", "no batch was captured for this step")
        own.replay_ms = sum(c.replay_ms for c in causes)
        if len(host.ranks) > 1 and dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own.to_dict())
            reproduced = [(rank, c) for rank, c in enumerate(gathered) if c and c.get("where") != "not_reproduced"]
            if reproduced:
                rank, first = reproduced[0]
                own = Cause(**{k: v for k, v in first.items()})
                own.summary = f"on rank {rank}: {own.summary}"
            own.outputs = dict(own.outputs, per_rank={rank: c.get("summary") for rank, c in enumerate(gathered)})
        return own

    def finalize(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], step: int, where: Where) -> None:
        """The last update has not been checked yet: check the parameters once more (one sync)."""
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if named:
            bad = nonfinite_named([n for n, _ in named], fused_norms([p for _, p in named]))
            if bad:
                self._record_params(bad, step, where, world_size=1, ranks=[0])
        self.close_episodes(step, where, ANOMALY_KINDS, final=True)

    def _on_numerics(self, host: HostNumerics) -> None:
        self._inspect(host, self._positions.pop(host.step, {"epoch": -1, "batch": -1}))

    def _inspect(self, host: HostNumerics, where: Where, cause: Cause | None = None) -> list[str]:
        """Record what ``host`` shows; return the kinds found (empty on a healthy step)."""
        step, world = host.step, len(host.ranks)
        bad_loss_ranks = host.ranks_with_nonfinite_loss
        bad_grads = host.nonfinite_grads()
        bad_params = host.nonfinite_params() if bad_loss_ranks or bad_grads or host.param_norms else []
        kinds: list[str] = []
        if self.uses_grad_scaler and bad_grads and not bad_loss_ranks and not bad_params:
            kinds.append("amp_overflow_skipped")
            self.record(Finding("amp_overflow_skipped", "info",
                                f"fp16 gradients overflowed at step {step} ({len(bad_grads)} parameters); the "
                                "GradScaler skips this step and lowers its scale, as designed.",
                                {"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]]}), step, where)
        else:
            if bad_params:
                kinds.append("nonfinite_param")
                if host.param_norms or host.read_before_update:
                    self._record_params(bad_params, step, where, world, host.ranks_with_nonfinite_params)
                else:  # scanned a step late: these are the weights after this step's update
                    self._record_params(bad_params, step + 1, where, world, [], last_finite=step)
            else:
                self.last_finite_param_step = step
            found = f" Cause: {cause.summary}." if cause is not None else ""
            cause_details = {"cause": cause.to_dict()} if cause is not None else {}
            if cause is not None and cause.where == "forward" and cause.operation:
                kinds.append("nonfinite_activation")
                self.record(Finding("nonfinite_activation", "error",
                                    f"At step {step}, {cause.summary}. {_advice(cause)}".strip(), cause.to_dict()),
                            step, where, key=cause.module or "", warn=False)
            if bad_loss_ranks:
                kinds.append("nonfinite_loss")
                because = " because parameters are already non-finite" if bad_params else ""
                self.record(Finding(
                    "nonfinite_loss", "error",
                    f"The loss is NaN/Inf at step {step}{_on_ranks(bad_loss_ranks, world)}{because}.{found} "
                    + (_advice(cause) if cause is not None and cause.where != "not_reproduced" else
                       "Common causes: log or division of a value that reaches 0 (add an epsilon or clamp), sqrt "
                       "of a negative, a learning rate too high, NaN in the input batch. ") + ACTIONS[self.mode],
                    dict({"ranks": bad_loss_ranks, "world_size": world, "action": self.mode}, **cause_details)),
                    step, where)
            if bad_grads:
                kinds.append("nonfinite_grad")
                origin = ("the loss is already non-finite" if bad_loss_ranks else
                          "the loss is finite, so the problem is in the backward pass: sqrt/pow/norm at 0, "
                          "division by a tiny value, or an overflow")
                self.record(Finding(
                    "nonfinite_grad", "error",
                    f"{len(bad_grads)} of {len(host.grad_names)} gradients are NaN/Inf at step {step}: "
                    f"{_names(bad_grads)}; {origin}.{found} Clip gradients or lower the learning rate if they "
                    "overflow. " + ACTIONS[self.mode],
                    dict({"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]], "count": len(bad_grads),
                          "ranks": host.ranks_with_nonfinite_grads, "action": self.mode}, **cause_details)),
                    step, where)
        if any(kind != "amp_overflow_skipped" for kind in kinds):
            self.anomaly_count += 1
        elif math.isfinite(host.global_grad_norm):
            self._last_grad_norm = host.global_grad_norm
        metrics = {"debug/anomaly/count": float(self.anomaly_count)}
        if host.loss_checked:
            metrics["debug/loss_finite"] = 0.0 if bad_loss_ranks else 1.0
        self.log_metrics(step, metrics)
        self.close_episodes(step, where, ANOMALY_KINDS - {"nonfinite_activation"})
        return kinds

    def _record_params(self, bad_params: list[tuple[str, float]], step: int, where: Where, world_size: int,
                       ranks: list[int], last_finite: int | None = None) -> None:
        last = self.last_finite_param_step if last_finite is None else last_finite
        since = (f"in the optimizer step at step {step - 1}" if last == step - 1
                 else f"between steps {last} and {step}" if last >= 0 else f"before step {step}")
        action = ("Skipping steps cannot repair the weights, so training stops (anomaly_detection_mode='skip')."
                  if self.mode == "skip" else ACTIONS[self.mode])
        self.record(Finding(
            "nonfinite_param", "critical",
            f"Parameter {_names(bad_params)} became non-finite {since}{_on_ranks(ranks, world_size)}"
            f"{self._optimizer_context()}. With finite "
            "gradients this is the optimizer overflowing the weights: lower the learning rate, clip gradients, "
            "check weight decay and fp16 loss scaling. " + action,
            {"parameters": [n for n, _ in bad_params[:NAMES_IN_DETAILS]], "count": len(bad_params),
             "last_finite_step": last, "action": self.mode}), step, where)

    def _optimizer_context(self) -> str:
        learning_rates = sorted(set(self._learning_rates))
        parts = [f"lr {', '.join(f'{lr:.3g}' for lr in learning_rates)}"] if learning_rates else []
        if math.isfinite(self._last_grad_norm):
            parts.append(f"last finite gradient norm {self._last_grad_norm:.3g}")
        return f" ({'; '.join(parts)})" if parts else ""

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    last_finite_param_step=self.last_finite_param_step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.anomaly_count = int(state_dict.get("anomaly_count", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.last_finite_param_step = int(state_dict.get("last_finite_param_step", -1))

    def report_section(self) -> dict[str, Any]:
        return dict(super().report_section(), anomaly_count=self.anomaly_count, skipped_steps=self.skipped_steps,
                    mode=self.mode, check_frequency=self.config.anomaly_check_frequency)
