"""The wording of every anomaly finding: what was seen, what it follows from, what to do and what the run does.
Nothing here judges or reads a tensor; ``consequence_of`` names the finding that explains this one, so the
report leads with the root.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_debug.checks.localize import Cause, CauseSite
from lightning_debug.config import AnomalyMode
from lightning_debug.core.findings import Finding, quoted
from lightning_debug.core.kinds import COMMON_CAUSES, Kind, Severity, advice_for_cause
from lightning_debug.errors import AnomalyError
from lightning_debug.monitors.anomaly.forensics import ParamsOrigin
from lightning_debug.monitors.anomaly.policy import Verdict

NAMES_IN_DETAILS = 20

ACTIONS = {
    AnomalyMode.WARN: "Training continues (anomaly_detection_mode='warn').",
    AnomalyMode.RAISE: "Raising AnomalyError (anomaly_detection_mode='raise').",
    AnomalyMode.SKIP: "This optimizer step was skipped: no update, no momentum, no weight decay, and any "
                      "BatchNorm running statistics its forward changed are restored (anomaly_detection_mode='skip').",
    AnomalyMode.STOP: "The non-finite update was dropped (any BatchNorm running statistics its forward changed are "
                      "restored) and training stops after this step (anomaly_detection_mode='stop').",
}
EXPERT_STACKS = ("level=EXPERT records every forward operation's stack (torch.autograd.set_detect_anomaly, several "
                 "times the step time) so that an error in backward names its forward line; use it to pin down a "
                 "known problem.")
NO_REPLAY_IN_LOOP = ("level=ADVANCED names the cause of a NaN by replaying the step, which this training loop does "
                     "not allow (manual optimization steps the optimizers inside training_step); NaN/Inf are still "
                     "found, without their cause.")
NO_BATCH_CAPTURED = "no batch was captured for this step"


def names(items: Sequence[tuple[str, float]]) -> str:
    """The first five names, quoted, and how many more::

        >>> names([(f"w{i}", 0.0) for i in range(7)])
        '`w0`, `w1`, `w2`, `w3`, `w4` and 2 more'
    """
    return quoted([name for name, _ in items], 5)


def on_ranks(ranks: Sequence[int], world_size: int) -> str:
    """`` on rank 1, 3`` under distributed training, nothing on one process::

        >>> on_ranks([1, 3], 4), on_ranks([0], 1)
        (' on rank 1, 3', '')
    """
    return f" on rank {', '.join(map(str, ranks))}" if world_size > 1 and ranks else ""


def no_replay_on_sharded(sharded: Sequence[str]) -> str:
    """Why level=ADVANCED names no cause on a model with sharded parameters::

        >>> no_replay_on_sharded(["layer.weight"]).split(":")[0]
        'level=ADVANCED cannot replay a step of a model with sharded parameters (FSDP, tensor parallel'
    """
    return (f"level=ADVANCED cannot replay a step of a model with sharded parameters (FSDP, tensor parallel: "
            f"{names([(name, 0.0) for name in sharded])}): the replayed forward would re-run their "
            "collectives. Non-finite losses, gradients and parameters are still detected "
            "and named; the operation and module that produced them are not.")


def replay_failed(error: Exception) -> str:
    """The cause of a replay that raised::

        >>> replay_failed(RuntimeError("shape mismatch"))
        'the replay failed (RuntimeError: shape mismatch)'
    """
    return f"the replay failed ({type(error).__name__}: {error})"


def outside_the_replay(scope: str) -> str:
    """The cause when the replayed model is finite and the step's loss computation lies outside the replay::

        >>> outside_the_replay("the loss function")[:89]
        'the replayed forward of the model gave finite outputs, so the NaN/Inf comes from the loss'
    """
    return (f"the replayed forward of the model gave finite outputs, so the NaN/Inf comes from {scope}, which the "
            "replay does not cover (a log or division of a value that reaches 0 in the loss function, or NaN/Inf in "
            "the targets)")


MASKED_ROW_ADVICE = ("Every key of that row is masked: keep at least one unmasked key per row (or drop fully padded "
                     "samples), or mask with a large finite negative (torch.finfo(dtype).min) instead of -inf. ")


def cause_advice(cause: Cause) -> str:
    """The fix for what a replay found: a fully masked softmax row has its own, else the operation's::

        >>> masked = Cause(CauseSite.FORWARD, "softmax over a row that is entirely -inf", operation="torch.softmax",
        ...                inputs={"fully_masked_rows": 1})
        >>> cause_advice(masked).startswith("Every key of that row is masked")
        True
    """
    if cause.inputs.get("fully_masked_rows"):
        return MASKED_ROW_ADVICE
    return advice_for_cause(cause.where, cause.operation)


def backward_left_out(collectives: Sequence[str]) -> str:
    """The cause when the forward replay is finite and its backward was left out for the step's own collectives::

        >>> backward_left_out(["c10d.allgather_"])[:72]
        'the replayed forward gave finite values; the backward was not replayed: '
    """
    return ("the replayed forward gave finite values; the backward was not replayed: the training step calls "
            f"collectives of its own ({', '.join(f'`{name}`' for name in collectives)}), and a backward replay "
            "stops at the first NaN on the rank that has it, so the other ranks would wait in the collective's "
            "backward. The NaN/Inf most likely arises in the backward (a sqrt, norm or division at 0): run one "
            "process with `level='advanced'` to name the operation")


def anomaly_error(step: int, kinds: Sequence[Kind], verdict: Verdict, world_size: int,
                  cause: Cause | None) -> AnomalyError:
    """What ``anomaly_detection_mode='raise'`` raises: the kinds, the parameters and the cause::

        >>> verdict = Verdict([0], [], [], False, -1, [], [])
        >>> str(anomaly_error(3, [Kind.NONFINITE_LOSS], verdict, 1, None))
        'lightning-debug: non-finite loss at step 3'
    """
    parameters = [n for n, _ in (verdict.bad_params or verdict.bad_grads)][:NAMES_IN_DETAILS]
    ranks = verdict.bad_loss_ranks
    return AnomalyError(
        f"lightning-debug: non-finite {', '.join(k.value.removeprefix('nonfinite_') for k in kinds)} at step "
        f"{step}" + (f" (parameters: {', '.join(parameters)})" if parameters else "")
        + on_ranks(ranks, world_size) + (f". Cause: {cause.summary}" if cause is not None else ""),
        step=step, kinds=[kind.value for kind in kinds],
        details={"parameters": parameters, "ranks": ranks, "cause": cause.to_dict() if cause else None})


def amp_overflow(step: int, bad_grads: Sequence[tuple[str, float]]) -> Finding:
    """An fp16 overflow the GradScaler handles: an ``info``, as designed::

        >>> amp_overflow(2, [("w", float("inf"))]).message
        'fp16 gradients overflowed at step 2 (1 parameters); the GradScaler skips this step and lowers its scale, as designed.'
    """
    return Finding(Kind.AMP_OVERFLOW_SKIPPED, Severity.INFO,
                   f"fp16 gradients overflowed at step {step} ({len(bad_grads)} parameters); the "
                   "GradScaler skips this step and lowers its scale, as designed.",
                   {"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]]})


def fallen_first(fall: tuple[float, float] | None) -> str:
    """What to fix first when the loss fell without bound before it went non-finite (``fall``: the last checked loss
    and the magnitude of the run's first ones, :func:`~lightning_debug.checks.unbounded.fallen_far`)::

        >>> fallen_first((-2.6e22, 0.61))[:56]
        'Before it the loss had fallen to -2.6e+22 (the first los'
    """
    if fall is None:
        return ""
    return (f"Before it the loss had fallen to {fall[0]:.4g} (the first losses were within {fall[1]:.4g} of 0): a "
            "loss with no lower bound drives the logits and the weights until they overflow. Fix the loss first: "
            "binary_cross_entropy_with_logits needs targets in [0, 1] (not -1/1 or 0/255), nll_loss needs "
            "log-probabilities (log_softmax), and a loss term must not be negated. ")


def nonfinite_activation(step: int, cause: Cause, params_first: bool,
                         fall: tuple[float, float] | None = None) -> Finding:
    """The forward operation the replay caught producing NaN/Inf from finite inputs, with the fix for it::

        >>> cause = Cause(CauseSite.FORWARD, "`torch.log` in module `head` produced NaN/Inf", operation="torch.log")
        >>> nonfinite_activation(3, cause, params_first=False).message
        'At step 3, `torch.log` in module `head` produced NaN/Inf. Add an epsilon or clamp the argument (torch.log(x.clamp_min(1e-12)), x / (y + 1e-8)).'
    """
    return Finding(Kind.NONFINITE_ACTIVATION, Severity.ERROR,
                   f"At step {step}, {cause.summary}. {fallen_first(fall)}{cause_advice(cause)}".strip(),
                   dict(cause.to_dict(), **({"consequence_of": Kind.NONFINITE_PARAM.value} if params_first else {}),
                        **({"loss_fell_to": fall[0]} if fall is not None else {})))


def nonfinite_loss(step: int, verdict: Verdict, world_size: int, cause: Cause | None, mode: AnomalyMode,
                   params_first: bool, activation: bool, fall: tuple[float, float] | None = None) -> Finding:
    """The loss: on which ranks, what it follows from (weights, batch, an activation), the fix and the action::

        >>> verdict = Verdict([0], [], [], False, -1, [], [])
        >>> finding = nonfinite_loss(5, verdict, 1, None, AnomalyMode.WARN, False, False)
        >>> finding.message.startswith("The loss is NaN/Inf at step 5. Common causes:"), finding.details["action"]
        (True, 'warn')
    """
    origin = verdict.params
    from_inputs = bool(set(verdict.bad_loss_ranks) & set(verdict.bad_input_ranks))
    follows = (Kind.NONFINITE_PARAM if params_first else Kind.NONFINITE_INPUT if from_inputs
               else Kind.NONFINITE_ACTIVATION if activation else None)
    because = (f" because the parameters it was computed with are already non-finite "
               f"({origin.since}; see nonfinite_param)" if params_first and origin is not None else
               " and the batch itself holds NaN/Inf (see nonfinite_input)" if from_inputs else "")
    found = f" Cause: {cause.summary}." if cause is not None else ""
    return Finding(
        Kind.NONFINITE_LOSS, Severity.ERROR,
        f"The loss is NaN/Inf at step {step}{on_ranks(verdict.bad_loss_ranks, world_size)}{because}.{found} "
        + fallen_first(fall) + (cause_advice(cause) if cause is not None
           and cause.where is not CauseSite.NOT_REPRODUCED else
           "" if params_first else f"Common causes: {COMMON_CAUSES[Kind.NONFINITE_LOSS]}. ")
        + ACTIONS[mode],
        dict({"ranks": verdict.bad_loss_ranks, "world_size": world_size, "action": mode.value},
             **({"cause": cause.to_dict()} if cause is not None else {}),
             **({"consequence_of": follows.value} if follows else {}),
             **({"loss_fell_to": fall[0]} if fall is not None else {})))


def nonfinite_grad(step: int, verdict: Verdict, gradients: int, grad_ranks: list[int], cause: Cause | None,
                   mode: AnomalyMode, params_first: bool) -> Finding:
    """The gradients: how many of ``gradients``, and whether the loss or weights explain them or the backward does::

        >>> verdict = Verdict([0], [("w", float("nan"))], [], False, -1, [], [])
        >>> finding = nonfinite_grad(5, verdict, 3, [0], None, AnomalyMode.WARN, False)
        >>> finding.message.split(" Training")[0], finding.details["consequence_of"]
        ('1 of 3 gradients are NaN/Inf at step 5: `w`; the loss is already non-finite.', 'nonfinite_loss')
    """
    bad_grads = verdict.bad_grads
    origin_text = ("the parameters are already non-finite" if params_first else
                   "the loss is already non-finite" if verdict.bad_loss_ranks else
                   "the loss is finite, so the problem is in the backward pass: sqrt/pow/norm at 0, "
                   "division by a tiny value, or an overflow")
    follows = Kind.NONFINITE_LOSS if verdict.bad_loss_ranks else Kind.NONFINITE_PARAM if params_first else None
    found = f" Cause: {cause.summary}." if cause is not None else ""
    return Finding(
        Kind.NONFINITE_GRAD, Severity.ERROR,
        f"{len(bad_grads)} of {gradients} gradients are NaN/Inf at step {step}: "
        f"{names(bad_grads)}; {origin_text}.{found}"
        + ("" if follows else " Clip gradients or lower the learning rate if they overflow.")
        + " " + ACTIONS[mode],
        dict({"parameters": [n for n, _ in bad_grads[:NAMES_IN_DETAILS]], "count": len(bad_grads),
              "ranks": grad_ranks, "action": mode.value},
             **({"cause": cause.to_dict()} if cause is not None else {}),
             **({"consequence_of": follows.value} if follows else {})))


def optimizer_context(learning_rates: Sequence[float], last_grad_norm: float) -> str:
    """`` (lr 0.1; last finite gradient norm 3.2)``: what a weight overflow is read against::

        >>> optimizer_context([0.1, 0.1], 3.21), optimizer_context([], math.nan)
        (' (lr 0.1; last finite gradient norm 3.21)', '')
    """
    rates = sorted(set(learning_rates))
    parts = [f"lr {', '.join(f'{lr:.3g}' for lr in rates)}"] if rates else []
    if math.isfinite(last_grad_norm):
        parts.append(f"last finite gradient norm {last_grad_norm:.3g}")
    return f" ({'; '.join(parts)})" if parts else ""


def nonfinite_param(bad_params: Sequence[tuple[str, float]], origin: ParamsOrigin, world_size: int,
                    ranks: list[int], mode: AnomalyMode, last_finite_step: int, context: str) -> Finding:
    """``nonfinite_param``, with what made the weights non-finite: non-finite gradients applied by an
    update (a consequence: the advice is to fix those), or an update with finite gradients (the
    optimizer overflowed them: the learning rate), or not known (both named)::

        >>> origin = ParamsOrigin(4, 4, True, False, "in the optimizer step at step 4")
        >>> finding = nonfinite_param([("w", 0.0)], origin, 1, [0], AnomalyMode.SKIP, 3, "")
        >>> finding.details["consequence_of"], finding.message.endswith("training stops (anomaly_detection_mode='skip').")
        ('nonfinite_grad', True)
    """
    action = ("Skipping steps cannot repair the weights, so training stops (anomaly_detection_mode='skip')."
              if mode is AnomalyMode.SKIP else ACTIONS[mode])
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
    return Finding(
        Kind.NONFINITE_PARAM, Severity.CRITICAL,
        f"Parameter {names(bad_params)} became non-finite {origin.since}{on_ranks(ranks, world_size)}{why}{action}",
        dict({"parameters": [n for n, _ in bad_params[:NAMES_IN_DETAILS]], "count": len(bad_params),
              "last_finite_step": last_finite_step, "update_step": origin.update_step,
              "by_nonfinite_gradients": origin.by_gradients, "action": mode.value},
             **({"consequence_of": Kind.NONFINITE_GRAD.value} if origin.by_gradients else {})))


def nonfinite_input(step: int, rows: list[dict[str, Any]], ranks: list[int], world_size: int,
                    handled: bool = False) -> Finding:
    """``nonfinite_input``: the tensor, its micro-batch and the samples that hold NaN/Inf.

    NaN is also how tabular and sensor data mark a missing value, which the model masks or imputes
    (``torch.nan_to_num``, ``torch.where(x.isnan(), ...)``, a loss over the labelled entries only): then the
    step's loss, gradients and weights are finite, and the finding is an ``info`` (``handled``) that still
    names the samples. An error only when the step is not finite::

        >>> row = {"tensor": "x", "shape": [4, 2], "samples": [1], "count": 1, "epoch": 0, "batch": 7, "rank": 0}
        >>> nonfinite_input(7, [row], [0], 1).message.split(". The data")[0]
        'Bad input at step 7: `x` (shape [4, 2]) holds 1 NaN/Inf value(s) in sample(s) [1] of batch 7 of epoch 0'
        >>> nonfinite_input(7, [row], [0], 1, handled=True).severity.value
        'info'
    """
    first = rows[0] if rows else None
    if first is not None:
        batch_text = f"batch {first['batch']} of epoch {first['epoch']}"
        what = (f"`{first['tensor']}` (shape {first['shape']}) holds {first['count']} NaN/Inf value(s) in "
                f"sample(s) {first['samples']} of {batch_text}" + on_ranks([first["rank"]], world_size))
        more = f"; {len(rows) - 1} more tensor(s) too" if len(rows) > 1 else ""
    else:
        what, more = "a batch tensor holds NaN/Inf (the samples are known on that rank only)", ""
    if handled:
        headline = "Input with NaN/Inf at step"
        tail = ("The loss, gradients and weights of this step are finite, so the model handles them (missing "
                "values masked or imputed). If they are not meant to be there, check those samples.")
    else:
        headline = "Bad input at step"
        tail = ("The data holds NaN/Inf before the model sees it: check those samples (missing values, a zero std "
                "in normalisation, a corrupt file).")
    return Finding(
        Kind.NONFINITE_INPUT, Severity.INFO if handled else Severity.ERROR,
        f"{headline} {step}{on_ranks(ranks, world_size)}: {what}{more}. {tail}",
        {"samples": first["samples"] if first else [], "tensor": first["tensor"] if first else None,
         "shape": first["shape"] if first else None, "count": sum(row["count"] for row in rows),
         "ranks": ranks, "inputs": rows[:NAMES_IN_DETAILS], "handled": handled})


def nonfinite_buffer(broken: list[str], step: int, restored: bool, world_size: int, mode: AnomalyMode) -> Finding:
    """Buffers a dropped step could not put back: why, and that training stops::

        >>> nonfinite_buffer(["bn.running_var"], 6, False, 1, AnomalyMode.SKIP).message.split(":")[0]
        'Buffers `bn.running_var` are NaN/Inf at step 6 and could not be restored'
    """
    why = ("they were already non-finite before this step (a NaN batch on a step that was not checked: set "
           "anomaly_check_frequency=1 with skip)" if restored else
           "no copy of them was taken before this step's forward")
    shown = names([(name, 0.0) for name in broken]) if broken else "on another rank"
    return Finding(
        Kind.NONFINITE_BUFFER, Severity.CRITICAL,
        f"Buffers {shown} are NaN/Inf at step {step} and could not be restored: {why}. Evaluation with these "
        "running statistics gives NaN, so training stops instead of continuing over a broken model "
        f"(anomaly_detection_mode='{mode.value}'). Restart from a checkpoint, or reset them "
        "(module.reset_running_stats()).",
        {"buffers": broken[:NAMES_IN_DETAILS], "count": len(broken), "restored": restored,
         "world_size": world_size, "action": AnomalyMode.STOP.value})


def checked_buffers(step: int, verdict: Verdict, world_size: int, mode: AnomalyMode) -> Finding:
    """Buffers a check step found NaN/Inf after its forward, named with their module's class, and what the mode does::

        >>> verdict = Verdict([], [], [], False, 19, [], [], bad_buffer_ranks=[0],
        ...                   bad_buffers=[("bn.running_var", "BatchNorm1d")])
        >>> checked_buffers(20, verdict, 1, AnomalyMode.WARN).message.split(",")[0]
        'Buffers `bn.running_var` (BatchNorm1d) hold NaN/Inf after the forward of step 20'
    """
    shown = ", ".join(f"`{name}` ({module})" for name, module in verdict.bad_buffers[:NAMES_IN_DETAILS])
    action = ("The step is dropped and the buffers are put back as they were before its forward"
              if mode in (AnomalyMode.SKIP, AnomalyMode.STOP) else
              "Evaluation runs on these statistics from now on: reset them (module.reset_running_stats()) or restart "
              "from a checkpoint")
    return Finding(
        Kind.NONFINITE_BUFFER, Severity.ERROR,
        f"Buffers {shown or 'of the model'} hold NaN/Inf after the forward of step {step}"
        f"{on_ranks(verdict.bad_buffer_ranks, world_size)}, while the loss, gradients and weights are finite. A batch with extreme values (a finite 1e20 "
        "has a variance that is Inf in float32) or a NaN sample updated the running statistics. "
        f"{action}; find that batch (normalise or clip the inputs).",
        {"buffers": [name for name, _ in verdict.bad_buffers[:NAMES_IN_DETAILS]],
         "modules": [module for _, module in verdict.bad_buffers[:NAMES_IN_DETAILS]],
         "count": len(verdict.bad_buffers), "ranks": verdict.bad_buffer_ranks, "world_size": world_size,
         "action": mode.value})
