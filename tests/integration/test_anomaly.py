"""AnomalyDetectionCallback in real Trainer runs with planted bugs."""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_debug import AnomalyDetectionCallback, AnomalyError, DebugConfig
from tests.harness.toolkit import (as_on_an_accelerator, console_lines,
    TinyRegressor,
    debug_dir,
    make_trainer,
    read_events,
    read_report,
    read_scalars,
    regression_data,
)


def starts(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and e.get("episode") == "start"]


def lightning_debug_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [line for line in caught if "lightning-debug" in line]


@pytest.mark.parametrize("device", ["host", "accelerator"])
def test_log_of_zero_is_found_at_its_step_with_scalars(tmp_path: Path, device: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if device == "accelerator":
        as_on_an_accelerator(monkeypatch)
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=20)
    with console_lines(r"\[step 7\] The loss is NaN/Inf"):
        trainer.fit(TinyRegressor(log_zero_from_step=7))
    events = read_events(debug_dir(trainer))
    loss_events = starts(events, "nonfinite_loss")
    assert [e["step"] for e in loss_events] == [7]
    assert loss_events[0]["severity"] == "error" and loss_events[0]["callback"] == "AnomalyDetectionCallback"
    if device == "host":  # the defaults replay the step where it costs nothing, and name the operation
        assert "Cause: `torch.log` at toolkit.py" in loss_events[0]["message"]
        assert loss_events[0]["details"]["cause"]["where"] == "forward"
    else:  # read a step late, the parameters already updated: the common causes, and the level that names it
        assert "log or division" in loss_events[0]["message"] and "Cause:" not in loss_events[0]["message"]
    assert not starts(events, "nonfinite_grad"), "log(0) of a constant leaves the gradients finite"
    ends = [e for e in events if e.get("episode") == "end" and e["kind"] == "nonfinite_loss"]
    assert ends and ends[0]["details"]["steps"] == 13 and ends[0]["details"]["first_step"] == 7
    scalars = read_scalars(trainer.log_dir)
    assert dict(scalars["debug/loss_finite"])[6] == 1.0 and dict(scalars["debug/loss_finite"])[7] == 0.0
    counts = dict(scalars["debug/anomaly/count"])
    assert counts[7] == 1.0 and counts[19] == 13.0
    assert sorted(counts) == list(range(7, 20)), "a count is first written once it is not 0"
    assert sorted(dict(scalars["debug/loss_finite"])) == list(range(20)), \
        "anomaly_check_frequency=1 checks every optimizer step"
    report = read_report(debug_dir(trainer))
    assert report["status"] == "finished"
    assert report["findings"]["nonfinite_loss"]["first_step"] == 7
    assert report["findings"]["nonfinite_loss"]["last_step"] == 19
    assert "nonfinite_loss" in (debug_dir(trainer) / "report.md").read_text()


def test_nan_in_one_layer_names_the_gradients(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6)
    with console_lines(r"lightning-debug: "):
        trainer.fit(TinyRegressor(nan_layer_from_step=3))
    grad_events = starts(read_events(debug_dir(trainer)), "nonfinite_grad")
    assert [e["step"] for e in grad_events] == [3]
    parameters = grad_events[0]["details"]["parameters"]
    assert {"head.weight", "hidden.weight"} <= set(parameters)
    assert "inp.weight" in parameters, "NaN flows back through every layer below the planted one"


def test_learning_rate_that_overflows_weights_names_the_parameters(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(anomaly_detection_mode="stop")], max_steps=10)
    with console_lines(r"\[step 1\] Parameter .*\(nonfinite_param"):
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
    with pytest.raises(AnomalyError, match=r"non-finite activation, loss at step 5\. Cause: `torch\.log`") as raised:
        trainer.fit(TinyRegressor(log_zero_from_step=5))
    assert raised.value.step == 5 and raised.value.kinds == ["nonfinite_activation", "nonfinite_loss"]
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
    with console_lines(r"\[step 4\] .*\(nonfinite_grad"):
        trainer.fit(model)
    assert trainer.global_step == 12, "skip mode keeps training"
    for before, after in zip(snapshot.parameters, model.parameters()):
        assert torch.equal(before, after), "no update, no momentum, no weight decay on skipped steps"
    assert callback.monitor.skipped_steps == 8
    assert read_report(debug_dir(trainer))["sections"]["anomaly"]["skipped_steps"] == 8


def test_stop_mode_stops_cleanly_after_the_step(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback(anomaly_detection_mode="stop")], max_steps=30)
    model = TinyRegressor(nan_layer_from_step=6)
    with console_lines(r"lightning-debug: "):
        trainer.fit(model)
    assert trainer.global_step == 7 and trainer.should_stop
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the non-finite update was dropped"
    assert read_report(debug_dir(trainer))["status"] == "finished"


def test_healthy_run_reports_nothing(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=200)
    with console_lines() as caught:
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
    with console_lines(r"lightning-debug: "):
        trainer.fit(OddBatchNaN())
    steps = [s for s, _ in read_scalars(trainer.log_dir)["debug/loss_finite"]]
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
    with console_lines(r"lightning-debug: "):
        trainer.fit(Manual())
    assert [e["step"] for e in starts(read_events(debug_dir(trainer)), "nonfinite_loss")] == [3]


def test_bf16_mixed_precision_is_checked_normally(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6, precision="bf16-mixed")
    with console_lines(r"lightning-debug: "):
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
    with console_lines("set_detect_anomaly"):
        trainer.fit(TinyRegressor())
    assert seen == [True, True] and not torch.is_anomaly_enabled()


def test_resume_keeps_counting(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    first = make_trainer(tmp_path / "a", [AnomalyDetectionCallback(), saver], max_steps=8, enable_checkpointing=True)
    with console_lines(r"lightning-debug: "):
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
    callback = AnomalyDetectionCallback(debug_output_dir=str(blocker / "debug"))
    # after construction, which rejects a directory under a file (issue 43): the file appears later
    blocker.write_text("a file where the directory should be")
    trainer = make_trainer(tmp_path, [callback], max_steps=10)
    with console_lines() as caught:
        trainer.fit(TinyRegressor(log_zero_from_step=3))
    assert trainer.global_step == 10
    could_not = [m for m in caught if m.startswith("lightning-debug: writing")]
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


# --- root cause first (issue 13) --------------------------------------------------------------------
class LogOfZeroInGraph(TinyRegressor):
    """``log(0 * loss)`` from ``from_step`` on: a NaN loss whose gradients are NaN too, with finite weights."""

    def __init__(self, from_step: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.from_step = from_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.trainer.global_step >= self.from_step:
            loss = torch.log(loss * 0.0)
        return loss


def test_warn_mode_names_the_loss_first_and_the_parameters_as_its_consequence(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=9)
    with console_lines(r"\[step 5\] The loss is NaN/Inf"):
        trainer.fit(LogOfZeroInGraph(from_step=5))
    events = read_events(debug_dir(trainer))
    report = read_report(debug_dir(trainer))
    assert list(report["findings"])[:4] == ["nonfinite_activation", "nonfinite_loss", "nonfinite_grad",
                                            "nonfinite_param"], "the operation the replay names comes first"
    assert "consequence_of" not in report["findings"]["nonfinite_activation"]
    assert report["findings"]["nonfinite_loss"]["consequence_of"] == "nonfinite_activation"
    assert report["findings"]["nonfinite_grad"]["consequence_of"] == "nonfinite_loss"
    assert report["findings"]["nonfinite_param"]["consequence_of"] == "nonfinite_grad"
    loss = starts(events, "nonfinite_loss")[0]
    assert loss["step"] == 5 and "already non-finite" not in loss["message"]
    param = starts(events, "nonfinite_param")[0]
    assert param["step"] == 5, "the weights broke in step 5's update, not before step 6"
    assert "in the optimizer step at step 5, because the gradients of step 5 were non-finite" in param["message"]
    assert "lower the learning rate" not in param["message"].lower()
    assert param["details"]["by_nonfinite_gradients"] and param["details"]["update_step"] == 5
    markdown = (debug_dir(trainer) / "report.md").read_text()
    assert markdown.index("`nonfinite_loss`") < markdown.index("`nonfinite_grad`") < markdown.index("`nonfinite_param`")
    assert "(critical, consequence of `nonfinite_grad`)" in markdown


def test_an_overflowing_learning_rate_is_still_blamed_with_finite_gradients(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=6)
    with console_lines(r"\[step 0\] Parameter"):
        trainer.fit(TinyRegressor(lr=3e38))
    events = read_events(debug_dir(trainer))
    param = starts(events, "nonfinite_param")[0]
    assert param["step"] == 0 and "in the optimizer step at step 0" in param["message"]
    assert "although its gradients were finite" in param["message"] and "Lower the learning rate" in param["message"]
    assert "consequence_of" not in param["details"]
    loss = starts(events, "nonfinite_loss")[0]
    assert loss["step"] == 1 and loss["details"]["consequence_of"] == "nonfinite_param"
    assert list(read_report(debug_dir(trainer))["findings"])[0] == "nonfinite_param"


class Fp16Overflow(TinyRegressor):
    """Pure fp16: the squared error of outputs scaled by 1e5 overflows 65504 from the first step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x) * 1e5, y)


def test_pure_fp16_overflow_is_labelled_with_the_step_that_broke_the_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [AnomalyDetectionCallback()], max_steps=3, precision="16-true")
    with console_lines(r"lightning-debug: "):
        trainer.fit(Fp16Overflow())
    events = read_events(debug_dir(trainer))
    grads = starts(events, "nonfinite_grad")
    param = starts(events, "nonfinite_param")[0]
    assert [e["step"] for e in grads] == [0] and param["step"] == 0
    assert "in the optimizer step at step 0, because the gradients of step 0" in param["message"]


class BatchNormNet(pl.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear; sample ``nan_sample`` of the training data is NaN."""

    def __init__(self, nan_sample: int | None = 37) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.nan_sample = nan_sample
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _data(self, poisoned: bool) -> torch.utils.data.DataLoader:
        inputs, targets = regression_data().tensors
        inputs = inputs.clone()
        if poisoned and self.nan_sample is not None:
            inputs[self.nan_sample, 3] = float("nan")
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=16)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(poisoned=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._data(poisoned=False)


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_dropped_step_restores_the_batchnorm_statistics_its_forward_broke(tmp_path: Path, mode: str) -> None:
    callback = AnomalyDetectionCallback(anomaly_detection_mode=mode)
    trainer = make_trainer(tmp_path, [callback], max_steps=16, val_check_interval=8, num_sanity_val_steps=0)
    model = BatchNormNet(nan_sample=37)  # batch 2 of the one epoch
    with console_lines(r"\[step 2\] .*nonfinite_input"):
        trainer.fit(model)
    assert callback.monitor.skipped_steps == 1 and callback.monitor.restored_buffer_steps == 1
    assert trainer.global_step == (16 if mode == "skip" else 3)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor.float()).all(), f"{name} is not finite after the skipped step"
    assert int(model.net[1].num_batches_tracked) == trainer.global_step - 1, "the skipped forward is not counted"
    if mode == "skip":
        assert model.val_losses and all(math.isfinite(v) for v in model.val_losses)
    events = read_events(debug_dir(trainer))
    assert not starts(events, "nonfinite_buffer")
    assert "BatchNorm running statistics its forward changed are restored" in starts(events, "nonfinite_loss")[0]["message"]


def test_skip_stops_with_the_buffer_names_when_they_cannot_be_restored(tmp_path: Path) -> None:
    """Checked every 4 steps: at step 2 (not checked) an extra no-grad forward of a NaN batch poisons the
    running statistics (the weights stay finite); the NaN loss of step 4 is skipped, but the copy taken
    before step 4 is already broken, so the buffers are named and training stops."""
    callback = AnomalyDetectionCallback(anomaly_detection_mode="skip", anomaly_check_frequency=4)

    class LateNaN(BatchNormNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.trainer.global_step == 2:
                with torch.no_grad():
                    self.net(torch.full_like(batch[0], float("nan")))
            loss = super().training_step(batch, batch_idx)
            return loss + torch.log(torch.zeros(())) * (self.trainer.global_step == 4)

    trainer = make_trainer(tmp_path, [callback], max_steps=24, limit_val_batches=0)
    model = LateNaN(nan_sample=None)
    with console_lines(r"nonfinite_buffer"):
        trainer.fit(model)
    assert trainer.global_step == 5, "training stops instead of continuing over broken statistics"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    events = read_events(debug_dir(trainer))
    assert not starts(events, "nonfinite_param")
    buffer = starts(events, "nonfinite_buffer")[0]
    assert buffer["step"] == 4 and buffer["severity"] == "critical"
    assert set(buffer["details"]["buffers"]) == {"net.1.running_mean", "net.1.running_var"}
    assert "already non-finite before this step" in buffer["message"]
    assert "training continues" not in buffer["message"].lower()
