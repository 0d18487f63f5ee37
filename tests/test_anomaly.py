"""AnomalyDetectionCallback in real Trainer runs with planted bugs."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_debug import AnomalyDetectionCallback, AnomalyError, DebugConfig
from tests.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report, read_scalars


def starts(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and e.get("episode") == "start"]


def lightning_debug_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "lightning-debug" in str(w.message)]


def test_log_of_zero_is_found_at_its_step_with_scalars(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=20)
    with pytest.warns(UserWarning, match=r"\[step 7\] The loss is NaN/Inf"):
        trainer.fit(TinyRegressor(log_zero_from_step=7))
    events = read_events(debug_dir(trainer))
    loss_events = starts(events, "nonfinite_loss")
    assert [e["step"] for e in loss_events] == [7]
    assert loss_events[0]["severity"] == "error" and loss_events[0]["callback"] == "AnomalyDetectionCallback"
    assert "log or division" in loss_events[0]["message"]
    assert not starts(events, "nonfinite_grad"), "log(0) of a constant leaves the gradients finite"
    ends = [e for e in events if e.get("episode") == "end"]
    assert ends and ends[0]["details"]["steps"] == 13 and ends[0]["details"]["first_step"] == 7
    scalars = read_scalars(trainer.log_dir)
    assert dict(scalars["debug/loss_finite"])[6] == 1.0 and dict(scalars["debug/loss_finite"])[7] == 0.0
    counts = dict(scalars["debug/anomaly/count"])
    assert counts[6] == 0.0 and counts[7] == 1.0 and counts[19] == 13.0
    assert sorted(counts) == list(range(20)), "anomaly_check_frequency=1 checks every optimizer step"
    report = read_report(debug_dir(trainer))
    assert report["status"] == "finished"
    assert report["findings"]["nonfinite_loss"]["first_step"] == 7
    assert report["findings"]["nonfinite_loss"]["last_step"] == 19
    assert "nonfinite_loss" in (debug_dir(trainer) / "report.md").read_text()


def test_nan_in_one_layer_names_the_gradients(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6)
    with pytest.warns(UserWarning):
        trainer.fit(TinyRegressor(nan_layer_from_step=3))
    grad_events = starts(read_events(debug_dir(trainer)), "nonfinite_grad")
    assert [e["step"] for e in grad_events] == [3]
    parameters = grad_events[0]["details"]["parameters"]
    assert {"head.weight", "hidden.weight"} <= set(parameters)
    assert "inp.weight" in parameters, "NaN flows back through every layer below the planted one"


def test_learning_rate_that_overflows_weights_names_the_parameters(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(anomaly_detection_mode="stop")], max_steps=10)
    with pytest.warns(UserWarning, match=r"\[step 1\] Parameter .*\(nonfinite_param"):
        trainer.fit(TinyRegressor(lr=3e38))
    events = read_events(debug_dir(trainer))
    param_events = starts(events, "nonfinite_param")
    assert [e["step"] for e in param_events] == [1]
    assert param_events[0]["severity"] == "critical"
    assert "in the optimizer step at step 0" in param_events[0]["message"]
    assert "head.weight" in param_events[0]["details"]["parameters"]
    assert trainer.global_step == 2, "stop mode ends training right after the step that found it"


def test_raise_mode_raises_with_step_and_still_writes_the_report(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(anomaly_detection_mode="raise")], max_steps=20)
    with pytest.raises(AnomalyError, match="non-finite loss at step 5") as raised:
        trainer.fit(TinyRegressor(log_zero_from_step=5))
    assert raised.value.step == 5 and raised.value.kinds == ["nonfinite_loss"]
    report = read_report(debug_dir(trainer))
    assert report["status"] == "failed" and "AnomalyError" in report["error"]
    assert report["findings"]["nonfinite_loss"]["first_step"] == 5


class ParameterSnapshot(pl.Callback):
    """Keeps a copy of the parameters as they are when a given step starts."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.parameters: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self.parameters = [p.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_skip_mode_drops_the_bad_steps_without_touching_the_weights(tmp_path: Path, optimizer: str) -> None:
    snapshot = ParameterSnapshot(step=4)
    callback = AnomalyDetectionCallback(anomaly_detection_mode="skip")
    trainer = make_trainer(tmp_path, [callback, snapshot], max_steps=12)
    model = TinyRegressor(nan_layer_from_step=4, optimizer=optimizer)
    with pytest.warns(UserWarning, match=r"\[step 4\] .*\(nonfinite_grad"):
        trainer.fit(model)
    assert trainer.global_step == 12, "skip mode keeps training"
    for before, after in zip(snapshot.parameters, model.parameters()):
        assert torch.equal(before, after), "no update, no momentum, no weight decay on skipped steps"
    assert callback.monitor.skipped_steps == 8
    assert read_report(debug_dir(trainer))["sections"]["anomaly"]["skipped_steps"] == 8


def test_stop_mode_stops_cleanly_after_the_step(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(anomaly_detection_mode="stop")], max_steps=30)
    model = TinyRegressor(nan_layer_from_step=6)
    with pytest.warns(UserWarning):
        trainer.fit(model)
    assert trainer.global_step == 7 and trainer.should_stop
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the non-finite update was dropped"
    assert read_report(debug_dir(trainer))["status"] == "finished"


def test_healthy_run_reports_nothing(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=200)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor())
    assert lightning_debug_warnings(caught) == []
    events = read_events(debug_dir(trainer))
    assert [e for e in events if e["severity"] in ("warning", "error", "critical")] == []
    report = read_report(debug_dir(trainer))
    assert report["findings"] == {} and "No problems found." in (debug_dir(trainer) / "report.md").read_text()
    assert set(dict(read_scalars(trainer.log_dir)["debug/loss_finite"]).values()) == {1.0}


def test_frequency_counts_optimizer_steps_under_accumulation(tmp_path: Path) -> None:
    """With 2 micro-batches per step and a NaN in only one of them, the step is still caught."""

    class OddBatchNaN(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 6 and batch_idx % 2 == 0:
                loss = loss * torch.tensor(float("nan"))
            return loss

    callback = AnomalyDetectionCallback(anomaly_check_frequency=3)
    trainer = make_trainer(tmp_path, [callback], max_steps=10, accumulate_grad_batches=2)
    with pytest.warns(UserWarning):
        trainer.fit(OddBatchNaN())
    steps = [s for s, _ in read_scalars(trainer.log_dir)["debug/anomaly/count"]]
    assert steps == [0, 3, 6, 9]
    assert [e["step"] for e in starts(read_events(debug_dir(trainer)), "nonfinite_loss")] == [6]


def test_manual_optimization_is_checked(tmp_path: Path) -> None:
    class Manual(TinyRegressor):
        def __init__(self) -> None:
            super().__init__(log_zero_from_step=3)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()

    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6)
    with pytest.warns(UserWarning):
        trainer.fit(Manual())
    assert [e["step"] for e in starts(read_events(debug_dir(trainer)), "nonfinite_loss")] == [3]


def test_bf16_mixed_precision_is_checked_normally(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6, precision="bf16-mixed")
    with pytest.warns(UserWarning):
        trainer.fit(TinyRegressor(nan_layer_from_step=2))
    events = read_events(debug_dir(trainer))
    assert [e["step"] for e in starts(events, "nonfinite_grad")] == [2]
    assert not starts(events, "amp_overflow_skipped")


def test_expert_level_turns_autograd_anomaly_mode_on_and_off(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            seen.append(torch.is_anomaly_enabled())

    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(level="expert"), Probe()], max_steps=2)
    with pytest.warns(UserWarning, match="set_detect_anomaly"):
        trainer.fit(TinyRegressor())
    assert seen == [True, True] and not torch.is_anomaly_enabled()


def test_resume_keeps_counting(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    first = make_trainer(tmp_path / "a", [AnomalyDetectionCallback(), saver], max_steps=8, enable_checkpointing=True)
    with pytest.warns(UserWarning):
        first.fit(TinyRegressor(log_zero_from_step=5))
    checkpoint = next((tmp_path / "ckpt").glob("*.ckpt"))
    resumed_callback = AnomalyDetectionCallback()
    second = make_trainer(tmp_path / "b", [resumed_callback], max_steps=12)
    second.fit(TinyRegressor(log_zero_from_step=5), ckpt_path=str(checkpoint))
    counts = dict(read_scalars(second.log_dir)["debug/anomaly/count"])
    assert counts[8] == 4.0 and counts[11] == 7.0, "3 anomalous steps before the resume, then 4 more"
    tally = resumed_callback.monitor.tally.kinds["nonfinite_loss"]
    assert tally["first_step"] == 5 and tally["steps"] == 7
    assert tally["episodes"] == 1, "a mid-run checkpoint carries the open episode over"
    assert not [e for e in read_events(debug_dir(second)) if e.get("episode") == "start"], "no second start event"


def test_unwritable_output_dir_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the directory should be")
    callback = AnomalyDetectionCallback(debug_output_dir=str(blocker / "debug"))
    trainer = make_trainer(tmp_path, [callback], max_steps=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyRegressor(log_zero_from_step=3))
    assert trainer.global_step == 10
    could_not = [m for m in (str(w.message) for w in caught) if m.startswith("lightning-debug: writing")]
    assert len(could_not) == 2, could_not  # one for events.jsonl, one for the report
    assert "events.jsonl failed" in could_not[0] and "writing the report failed" in could_not[1]


def test_user_exception_propagates_untouched(tmp_path: Path) -> None:
    class Broken(TinyRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 3:
                raise self.error
            return super().training_step(batch, batch_idx)

    model = Broken()
    model.error = KeyError("user bug")
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=10)
    with pytest.raises(KeyError) as raised:
        trainer.fit(model)
    assert raised.value is model.error
    assert read_report(debug_dir(trainer))["status"] == "failed"


def test_callbacks_pickle_and_take_config_or_overrides() -> None:
    callback = AnomalyDetectionCallback(DebugConfig(anomaly_check_frequency=5), anomaly_detection_mode="skip")
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.config.anomaly_check_frequency == 5 and clone.config.anomaly_detection_mode == "skip"
    assert callback.state_key != AnomalyDetectionCallback().state_key
    with pytest.raises(ValueError, match="anomaly_detection_mode must be one of warn, raise, skip, stop"):
        AnomalyDetectionCallback(anomaly_detection_mode="explode")
