"""Unit tier of the anomaly area: its rules fed recorded observations directly (no Trainer, milliseconds)."""

from __future__ import annotations

import math

import pytest

from lightning_debug.checks.localize import Cause, CauseSite
from lightning_debug.checks.trends import LossKind
from lightning_debug.config import AnomalyMode, DebugConfig
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.monitors.anomaly import AnomalySettings, forensics, policy, prose, replay
from lightning_debug.monitors.anomaly.divergence import LossJudge, loss_finding
from lightning_debug.monitors.anomaly.forensics import ParamsOrigin, WeightHistory, update_may_overflow
from lightning_debug.monitors.anomaly.policy import Action, Verdict

NAN = float("nan")
FP32_MAX = 3.4028234663852886e38


def verdict(loss: list[int] = (), grads: list[str] = (), params: list[str] = (), scaler: bool = False,
            inputs: list[int] = (), origin: ParamsOrigin | None = None) -> Verdict:
    return Verdict(list(loss), [(n, NAN) for n in grads], [(n, NAN) for n in params], scaler, -1, list(inputs), [],
                   origin)


def never(norm: float) -> bool:
    return False


def always(norm: float) -> bool:
    return True


FORWARD = Cause(CauseSite.FORWARD, "`torch.log` at model.py:3 in module `head` (Linear) produced NaN/Inf from "
                "finite inputs", module="head", operation="torch.log")


# --- settings ------------------------------------------------------------------------------------
def test_settings_are_frozen_and_follow_the_level() -> None:
    basic = AnomalySettings.from_config(DebugConfig())
    expert = AnomalySettings.from_config(DebugConfig(level="expert", anomaly_detection_mode="stop",
                                                     anomaly_check_frequency=4))
    assert (basic.mode, basic.localizes, basic.records_stacks) == (AnomalyMode.WARN, False, False)
    assert (expert.mode, expert.localizes, expert.records_stacks, expert.check_frequency) == (
        AnomalyMode.STOP, True, True, 4)
    with pytest.raises(AttributeError):
        basic.mode = AnomalyMode.SKIP  # type: ignore[misc]


# --- policy --------------------------------------------------------------------------------------
def test_kinds_of_a_step_in_causal_order() -> None:
    step = verdict(loss=[0], grads=["w"], params=["w"], inputs=[0])
    assert step.kinds(FORWARD) == [Kind.NONFINITE_INPUT, Kind.NONFINITE_PARAM, Kind.NONFINITE_ACTIVATION,
                                   Kind.NONFINITE_LOSS, Kind.NONFINITE_GRAD]
    assert step.anomalous()


def test_a_bad_input_alone_and_a_gradscaler_overflow_decide_nothing() -> None:
    assert policy.deciding(verdict(inputs=[1]).kinds(None)) == []
    overflow = verdict(grads=["w"], scaler=True)
    assert overflow.amp_overflow and overflow.kinds(None) == [Kind.AMP_OVERFLOW_SKIPPED]
    assert not overflow.anomalous()
    assert not verdict(loss=[0], grads=["w"], scaler=True).amp_overflow, "a non-finite loss is no fp16 overflow"


@pytest.mark.parametrize(("mode", "kinds", "action"), [
    (AnomalyMode.WARN, [Kind.NONFINITE_LOSS], Action.CONTINUE),
    (AnomalyMode.RAISE, [Kind.NONFINITE_GRAD], Action.RAISE),
    (AnomalyMode.SKIP, [Kind.NONFINITE_LOSS, Kind.NONFINITE_GRAD], Action.SKIP),
    (AnomalyMode.SKIP, [Kind.NONFINITE_PARAM], Action.STOP),
    (AnomalyMode.STOP, [Kind.NONFINITE_LOSS], Action.STOP),
    (AnomalyMode.STOP, [], Action.CONTINUE),
    (AnomalyMode.RAISE, [], Action.CONTINUE),
])
def test_decide(mode: AnomalyMode, kinds: list[Kind], action: Action) -> None:
    assert policy.decide(mode, kinds) is action


def test_only_a_forward_operation_is_an_activation() -> None:
    assert policy.names_activation(FORWARD)
    assert not policy.names_activation(Cause(CauseSite.BACKWARD, "b", operation="SqrtBackward0"))
    assert not policy.names_activation(Cause(CauseSite.FORWARD, "no single operation"))
    assert not policy.names_activation(None)


def test_what_reads_late_and_what_restores_buffers() -> None:
    assert policy.reads_late(AnomalyMode.WARN, replays=False) and not policy.reads_late(AnomalyMode.WARN, replays=True)
    assert [m for m in AnomalyMode if policy.restores_buffers(m)] == [AnomalyMode.SKIP, AnomalyMode.STOP]


# --- forensics -----------------------------------------------------------------------------------
def checked(history: WeightHistory, step: int, grads_bad: bool = False, norm: float = 1.0) -> None:
    history.after_check(step, None, grads_bad, norm, anomalous=grads_bad)


def test_update_may_overflow_only_near_the_dtype_range() -> None:
    assert update_may_overflow(5.0, [3e38], lambda: FP32_MAX)
    assert not update_may_overflow(5.0, [1e-3], lambda: FP32_MAX)
    assert not update_may_overflow(NAN, [3e38], lambda: FP32_MAX), "a non-finite norm says nothing"
    asked: list[int] = []
    assert not update_may_overflow(5.0, [], lambda: asked.append(1) or FP32_MAX)
    assert asked == [], "the dtype's range is looked up only when needed"
    assert update_may_overflow(1e3, [1e3], lambda: 65504.0), "fp16's range is far smaller"


def test_nonfinite_gradients_applied_by_this_update_are_the_origin() -> None:
    history = WeightHistory()
    checked(history, 4)
    origin = history.origin(5, seen_after=5, grads_bad=True, broken_before=None, may_overflow=never)
    assert (origin.label, origin.update_step, origin.by_gradients, origin.before_forward) == (5, 5, True, False)


def test_a_risky_update_with_finite_gradients_is_blamed_on_the_previous_step() -> None:
    history = WeightHistory()
    checked(history, 0, norm=5.0)
    origin = history.origin(1, seen_after=1, grads_bad=True, broken_before=None, may_overflow=always)
    assert (origin.label, origin.update_step, origin.by_gradients, origin.before_forward) == (0, 0, False, True)
    assert origin.since == "in the optimizer step at step 0"


def test_the_flag_measured_before_the_forward_decides() -> None:
    history = WeightHistory()
    checked(history, 2)
    broken = history.origin(3, seen_after=3, grads_bad=True, broken_before=True, may_overflow=always)
    assert (broken.label, broken.update_step, broken.before_forward) == (2, 2, True)
    fine = history.origin(3, seen_after=3, grads_bad=True, broken_before=False, may_overflow=always)
    assert (fine.label, fine.update_step, fine.by_gradients, fine.before_forward) == (3, 3, True, False)


def test_weights_already_broken_stay_labelled_from_where_they_broke() -> None:
    history = WeightHistory()
    history.after_check(3, ParamsOrigin(3, 3, True, False, "x"), True, NAN, anomalous=True)
    origin = history.origin(4, seen_after=4, grads_bad=True, broken_before=None, may_overflow=never)
    assert (origin.update_step, origin.before_forward, origin.since) == (None, True, "since step 3")


def test_a_scan_before_the_update_sees_the_weights_the_forward_used() -> None:
    history = WeightHistory()
    checked(history, 6, grads_bad=True, norm=NAN)
    origin = history.origin(7, seen_after=None, grads_bad=True, broken_before=None, may_overflow=never)
    assert (origin.update_step, origin.by_gradients, origin.before_forward) == (6, True, True)
    unknown = WeightHistory().origin(7, seen_after=None, grads_bad=False, broken_before=None, may_overflow=never)
    assert (unknown.update_step, unknown.since) == (None, "before step 7")


def test_a_scan_several_updates_late_names_the_range() -> None:
    history = WeightHistory()
    origin = history.origin(4, seen_after=6, grads_bad=False, broken_before=None, may_overflow=never)
    assert (origin.label, origin.update_step, origin.since) == (6, None, "between steps 4 and 6")


def test_the_weights_are_measured_before_a_forward_only_after_a_risky_update() -> None:
    history = WeightHistory()
    checked(history, 4, norm=5.0)
    assert history.wants_measure_before(5, -1, always)
    assert not history.wants_measure_before(5, -1, never), "a healthy update is not measured"
    assert not history.wants_measure_before(5, 5, always), "once per step"
    assert not history.wants_measure_before(6, -1, always), "the previous step was not checked"
    checked(history, 5, grads_bad=True, norm=NAN)
    assert not history.wants_measure_before(6, -1, always), "non-finite gradients explain the weights already"


def test_the_last_finite_gradient_norm_ignores_anomalous_steps() -> None:
    history = WeightHistory()
    history.after_check(1, None, False, 2.5, anomalous=False)
    history.after_check(2, None, False, 1e9, anomalous=True)
    assert history.last_grad_norm == 2.5 and history.last_finite_step == 2


def test_final_origin() -> None:
    history = WeightHistory()
    assert history.final_origin(3).since == "by step 3"
    checked(history, 5, grads_bad=True, norm=NAN)
    assert history.final_origin(5).by_gradients and history.final_origin(5).update_step == 5
    assert history.final_origin(8).since == "after step 5"


# --- replay --------------------------------------------------------------------------------------
def test_one_replay_per_episode_and_none_for_a_gradscaler_overflow() -> None:
    assert replay.wants_replay([0], [], False, [])
    assert replay.wants_replay([], [0], False, ["nonfinite_input"])
    assert not replay.wants_replay([], [], False, [])
    assert not replay.wants_replay([], [1], True, [])
    assert not replay.wants_replay([0], [0], False, [Kind.NONFINITE_GRAD.value])


def test_own_cause_prefers_a_found_one_and_explains_what_the_replay_does_not_cover() -> None:
    plain = Cause(CauseSite.NOT_REPRODUCED, "finite", replay_ms=1.0)
    failed = Cause(CauseSite.ERROR, "boom", replay_ms=2.0)
    assert replay.own_cause([plain, failed], None) is plain and plain.replay_ms == 3.0
    outside = replay.own_cause([Cause(CauseSite.NOT_REPRODUCED, "finite", replay_ms=1.0)], "the loss function")
    assert outside.where is CauseSite.NOT_REPRODUCED and "comes from the loss function" in outside.summary
    assert replay.own_cause([failed], "the loss function").where is CauseSite.ERROR


def test_across_ranks_takes_the_first_rank_that_reproduced() -> None:
    gathered = [Cause(CauseSite.ERROR, "boom").to_dict(), Cause(CauseSite.NOT_REPRODUCED, "finite").to_dict(),
                FORWARD.to_dict()]
    cause = replay.across_ranks(Cause.from_dict(gathered[0]), gathered)
    assert cause.where is CauseSite.FORWARD and cause.summary.startswith("on rank 2: `torch.log`")
    assert cause.outputs["per_rank"] == {0: "boom", 1: "finite", 2: FORWARD.summary}
    finite = Cause(CauseSite.NOT_REPRODUCED, "finite")
    nobody = replay.across_ranks(finite, [finite.to_dict()])
    assert nobody.where is CauseSite.NOT_REPRODUCED and nobody.summary == "finite"


def test_a_replay_that_raises_is_an_error_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: object, **kwargs: object) -> Cause:
        raise RuntimeError("no replay here")

    monkeypatch.setattr(replay, "localize", failing)
    inputs = [("batch", None), ("batch2", None)]
    causes = replay.replay_each(None, inputs, lambda batch: None, same_work=False)  # type: ignore[arg-type]
    assert [c.where for c in causes] == [CauseSite.ERROR, CauseSite.ERROR]
    assert causes[0].summary == "the replay failed (RuntimeError: no replay here)"


def test_cause_sites_are_strings_only_in_json() -> None:
    data = FORWARD.to_dict()
    assert data["where"] == "forward" and type(data["where"]) is str
    assert Cause.from_dict(data).where is CauseSite.FORWARD
    assert [site for site in CauseSite if not site.names_a_cause] == [CauseSite.NOT_REPRODUCED, CauseSite.ERROR]


# --- prose ---------------------------------------------------------------------------------------
def test_loss_after_broken_weights_names_them_and_drops_the_common_causes() -> None:
    origin = ParamsOrigin(1, 0, False, True, "in the optimizer step at step 0")
    step = verdict(loss=[0], params=["w"], origin=origin)
    finding = prose.nonfinite_loss(1, step, 1, None, AnomalyMode.WARN, step.params_first, False)
    assert finding.kind is Kind.NONFINITE_LOSS and finding.severity is Severity.ERROR
    assert "because the parameters it was computed with are already non-finite (in the optimizer step at step 0" \
        in finding.message
    assert "Common causes" not in finding.message and finding.details["consequence_of"] == "nonfinite_param"


def test_loss_with_a_bad_batch_and_a_replayed_cause() -> None:
    step = verdict(loss=[1], inputs=[1])
    finding = prose.nonfinite_loss(4, step, 2, FORWARD, AnomalyMode.SKIP, False, True)
    assert finding.message.startswith("The loss is NaN/Inf at step 4 on rank 1 and the batch itself holds NaN/Inf")
    assert f"Cause: {FORWARD.summary}." in finding.message and "Add an epsilon" in finding.message
    assert finding.message.endswith("(anomaly_detection_mode='skip').")
    assert finding.details["consequence_of"] == "nonfinite_input" and finding.details["cause"]["where"] == "forward"
    assert list(finding.details) == ["ranks", "world_size", "action", "cause", "consequence_of"]


def test_gradients_name_their_origin() -> None:
    backward = verdict(grads=[f"layer{i}.weight" for i in range(7)])
    finding = prose.nonfinite_grad(3, backward, 10, [0], None, AnomalyMode.WARN, False)
    assert finding.message.startswith("7 of 10 gradients are NaN/Inf at step 3: `layer0.weight`")
    assert "and 2 more; the loss is finite, so the problem is in the backward pass" in finding.message
    assert "Clip gradients" in finding.message and "consequence_of" not in finding.details
    from_loss = prose.nonfinite_grad(3, verdict(loss=[0], grads=["w"]), 1, [0], None, AnomalyMode.WARN, False)
    assert "the loss is already non-finite" in from_loss.message and "Clip" not in from_loss.message
    assert from_loss.details["consequence_of"] == "nonfinite_loss"


def test_parameters_broken_by_the_optimizer_point_at_the_learning_rate() -> None:
    origin = ParamsOrigin(0, 0, False, True, "in the optimizer step at step 0")
    context = prose.optimizer_context([3e38], 2.0)
    finding = prose.nonfinite_param([("head.weight", NAN)], origin, 1, [0], AnomalyMode.WARN, -1, context)
    assert finding.severity is Severity.CRITICAL
    assert finding.message.startswith("Parameter `head.weight` became non-finite in the optimizer step at step 0 "
                                      "(lr 3e+38; last finite gradient norm 2) although its gradients were finite")
    assert "consequence_of" not in finding.details and finding.details["update_step"] == 0
    unknown = prose.nonfinite_param([("w", NAN)], ParamsOrigin.unknown(5), 1, [0], AnomalyMode.STOP, 2, "")
    assert "If the gradients of the steps in between were finite" in unknown.message
    assert unknown.details["last_finite_step"] == 2


def test_activation_input_buffer_and_overflow_findings() -> None:
    activation = prose.nonfinite_activation(2, FORWARD, params_first=True)
    assert activation.message.startswith("At step 2, `torch.log`")
    assert activation.details["consequence_of"] == "nonfinite_param"
    assert prose.nonfinite_input(3, [], [1], 2).message.startswith(
        "Bad input at step 3 on rank 1: a batch tensor holds NaN/Inf (the samples are known on that rank only)")
    buffers = prose.nonfinite_buffer(["bn.running_mean"], 4, True, 1, AnomalyMode.SKIP)
    assert "already non-finite before this step" in buffers.message and buffers.details["action"] == "stop"
    assert "on another rank" in prose.nonfinite_buffer([], 4, False, 2, AnomalyMode.STOP).message
    assert prose.amp_overflow(0, [("w", NAN)]).severity is Severity.INFO


def test_the_raised_error_carries_kinds_parameters_and_cause() -> None:
    error = prose.anomaly_error(5, [Kind.NONFINITE_PARAM, Kind.NONFINITE_GRAD], verdict(grads=["a"], params=["w"]), 2,
                                FORWARD)
    assert str(error).startswith("lightning-debug: non-finite param, grad at step 5 (parameters: w). "
                                 "Cause: `torch.log`")
    assert error.step == 5 and error.kinds == ["nonfinite_param", "nonfinite_grad"]
    assert error.details["cause"]["where"] == "forward"


# --- the loss: spike and divergence --------------------------------------------------------------
def test_a_loss_that_blows_up_at_step_one_is_a_spike() -> None:
    trend = LossJudge()
    verdicts = [trend.judge(loss) for loss in (6.9, 7857.0, 9000.0)]
    assert [v.kind for v in verdicts] == [None, None, LossKind.SPIKE]
    finding = loss_finding(verdicts[2], 1, [10.0])
    assert finding is not None and finding.kind is Kind.LOSS_SPIKE
    assert "(learning rate 10)" in finding.message and finding.details["learning_rates"] == [10.0]
    assert "at step 1" in finding.message and "next check's loss was 9000" in finding.message
    outlier = LossJudge()
    last = [outlier.judge(loss) for loss in (6.9, 7857.0, 6.0)][-1]
    info = loss_finding(last, 1, [1e-3])
    assert info is not None and info.kind is Kind.LOSS_OUTLIER and info.severity is Severity.INFO
    assert "back near that level" in info.message


def test_a_steady_rise_is_a_divergence_and_a_noisy_descent_is_nothing() -> None:
    trend = LossJudge()
    kinds = [trend.judge(loss).kind for loss in [9.9, 5.0, 4.0, 3.5, 3.0, 3.4, 4.5, 6.0, 8.0, 11.0, 14.0, 19.0]]
    assert LossKind.DIVERGENCE in kinds and LossKind.SPIKE not in kinds
    first = kinds.index(LossKind.DIVERGENCE)
    assert first == 10, "the first rise above where the run started (9.9)"
    calm = LossJudge()
    assert [calm.judge(v).kind for v in (2.3, 0.5, 0.05, 0.01, 0.02, 0.3, 1.0, NAN)] == [None] * 8
    assert loss_finding(calm.judge(0.5), 9) is None


def test_the_divergence_finding_names_the_window() -> None:
    trend = LossJudge()
    verdicts = [trend.judge(loss) for loss in [9.9, 5.0, 4.0, 3.5, 3.0, 3.4, 4.5, 6.0, 8.0, 11.0, 14.0]]
    finding = loss_finding(verdicts[-1], 10, [0.11])
    assert finding is not None and finding.kind is Kind.LOSS_DIVERGENCE
    assert finding.message.startswith("The loss is rising steadily: 3.5 -> 14 over the last 8 checked steps")
    assert len(finding.details["recent_losses"]) == 8 and math.isclose(finding.details["limit"], 7.0)


def test_forensics_constants_are_what_the_docs_say() -> None:
    assert (forensics.UPDATE_GROWTH, forensics.OVERFLOW_MARGIN) == (10.0, 0.5)



def test_a_replay_never_names_an_uninitialized_allocation_as_the_cause() -> None:
    """``torch.empty_like`` (the buffers a gather fills) may hand back memory that held NaN; the replay
    zero-fills such allocations, so it is not named as the operation that made NaN from finite inputs
    (issue 25: "on rank 0: `torch.empty_like`" for a NaN planted on rank 1)."""
    import torch

    model = torch.nn.Linear(2, 1)

    def step(batch: torch.Tensor) -> torch.Tensor:
        freed = torch.empty(4096)
        freed.fill_(float("nan"))
        del freed
        gathered = torch.empty_like(torch.ones(4096))  # often the memory just freed, full of NaN
        return model(batch).sum() + 0.0 * gathered.sum()

    for _ in range(5):
        causes = replay.replay_each(model, [(torch.ones(1, 2), None)], step, same_work=True)
        assert [cause.where for cause in causes] == [CauseSite.NOT_REPRODUCED], causes[0].summary


def test_the_cause_named_across_ranks_is_that_of_a_rank_that_had_the_nan() -> None:
    """Rank 0 "reproduces" a NaN it never had (a kernel's accident); rank 1, whose loss was NaN, does not:
    the cause quoted is rank 1's, never rank 0's (issue 25)."""
    gathered = [Cause(CauseSite.FORWARD, "`torch.empty_like` produced NaN").to_dict(),
                Cause(CauseSite.NOT_REPRODUCED, "finite").to_dict()]
    cause = replay.across_ranks(Cause.from_dict(gathered[0]), gathered, origin=[1])
    assert cause.where is CauseSite.NOT_REPRODUCED and cause.summary == "on rank 1: finite"
    found = [gathered[0], Cause(CauseSite.FORWARD, "`torch.log` produced NaN").to_dict()]
    assert replay.across_ranks(Cause.from_dict(found[0]), found, origin=[1]).summary == \
        "on rank 1: `torch.log` produced NaN"
