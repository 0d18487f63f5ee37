"""AccelerateDebugger in real Accelerate loops on CPU, with planted bugs, one and two processes."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lightning_debug import AnomalyError, DebugConfig  # noqa: E402
from lightning_debug.config import Area  # noqa: E402
from lightning_debug.accelerate import AccelerateDebugger  # noqa: E402
from tests.harness.toolkit import (console_lines, read_events, read_histogram_tags, read_report, read_scalars,  # noqa: E402
                           child_env, regression_data, run_children, run_dir)

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "accelerate_worker.py"


class Activation(nn.Module):
    """ReLU, or, once ``planted``, a square root of negative numbers (NaN inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.planted = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x - x.abs().max() - 1.0) if self.planted else torch.relu(x)


class TinyNet(nn.Module):
    """An MLP; ``unused`` is a layer that never takes part in the forward (missing gradients)."""

    def __init__(self, unused_layer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.act = Activation()
        self.unused = nn.Linear(16, 16) if unused_layer else None
        self.fail_with: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_with is not None:
            raise self.fail_with
        return self.head(self.act(self.hidden(torch.relu(self.inp(x)))))


@dataclass
class Run:
    accelerator: Accelerator
    debugger: AccelerateDebugger
    model: nn.Module
    losses: list[float] = field(default_factory=list)

    @property
    def debug_dir(self) -> Path:
        return run_dir(Path(self.accelerator.project_dir) / "debug_outputs")

    @property
    def tracker_dir(self) -> Path:
        return Path(self.accelerator.project_dir) / "run"

    def parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.debug_dir)

    def report_md(self) -> str:
        return (self.debug_dir / "report.md").read_text()


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons; every test starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_loop(root: Path, *, steps: int = 12, accumulation: int = 1, nan_input_at: int | None = None,
             log_zero_at: tuple[int, int] | None = None, overflow_at: int | None = None,
             unused_layer: bool = False, lr: float = 0.05, data_delay_s: float = 0.0,
             evaluate_after: tuple[int, float] | None = None, oom_at: int | None = None,
             nan_in_model_at: int | None = None, lr_zero_from: int | None = None,
             scaler: torch.amp.GradScaler | None = None, config: DebugConfig | None = None,
             pass_loader: bool = True, frozen_hidden: bool = False, **overrides: Any) -> Run:
    """A plain Accelerate loop with the debugger's three lines.

    ``nan_input_at``: from this optimizer step on, the batch carries a NaN (NaN loss and gradients).
    ``log_zero_at``: (step, micro-batch) at which the loss adds ``log(0)`` (the gradients stay finite).
    ``overflow_at``: at this step the loss adds ``sqrt(0)``: a finite loss with infinite gradients,
    what an fp16 overflow looks like to a GradScaler.
    ``data_delay_s``: the DataLoader takes this long per batch (a slow input pipeline).
    ``evaluate_after``: (step, seconds): after this optimizer step, an evaluation under
    ``torch.no_grad()`` that waits this long for its data, then runs a forward.
    ``oom_at``: the forward of this step raises ``torch.OutOfMemoryError``.
    ``nan_in_model_at``: from this step on, the activation after ``hidden`` takes sqrt of negatives.
    ``lr_zero_from``: a LambdaLR (stepped after each optimizer step, given to the debugger) is 0 from this step on.
    ``pass_loader``: give the prepared DataLoader to the debugger (``train_dataloader=``).
    ``frozen_hidden``: ``hidden`` gets ``requires_grad=False`` before the optimizer is built over every parameter.
    """
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(root),
                              gradient_accumulation_steps=accumulation)
    if scaler is not None:
        accelerator.scaler = scaler
    accelerator.init_trackers("run")
    model = TinyNet(unused_layer)
    model.hidden.requires_grad_(not frozen_hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        time.sleep(data_delay_s)
        return [torch.stack(column) for column in zip(*samples)]

    loader = DataLoader(regression_data(), batch_size=8, shuffle=True, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    schedule = (None if lr_zero_from is None else accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0 if step < lr_zero_from else 0.0)))
    if schedule is not None:
        overrides["lr_scheduler"] = schedule
    if pass_loader:
        overrides.setdefault("train_dataloader", loader)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config, **overrides)
    run = Run(accelerator, debugger, model)
    net = accelerator.unwrap_model(model)
    micro_batch = 0
    with debugger:
        while debugger.step < steps and not debugger.should_stop:
            for x, y in loader:
                with accelerator.accumulate(model):
                    if nan_input_at is not None and debugger.step >= nan_input_at:
                        x = x.clone()
                        x[0, 0] = float("nan")
                    net.act.planted = nan_in_model_at is not None and debugger.step >= nan_in_model_at
                    if oom_at == debugger.step:
                        net.fail_with = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
                    out = model(x)
                    loss = nn.functional.mse_loss(out, y)
                    if overflow_at == debugger.step:
                        loss = loss + torch.sqrt(out - out.detach()).sum()
                    if log_zero_at == (debugger.step, micro_batch):
                        loss = loss + torch.log(torch.zeros(()))
                    run.losses.append(float(loss.detach()))
                    micro_batch = 0 if accelerator.sync_gradients else micro_batch + 1
                    debugger.backward(loss)
                    optimizer.step()
                    if schedule is not None:
                        schedule.step()
                    optimizer.zero_grad()
                if evaluate_after is not None and accelerator.sync_gradients and debugger.step == evaluate_after[0] + 1:
                    model.eval()
                    with torch.no_grad():
                        time.sleep(evaluate_after[1])
                        model(x)
                    model.train()
                if debugger.should_stop or debugger.step >= steps:
                    break
    accelerator.end_training()
    return run


def text_tags(log_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return list(accumulator.Tags()["tensors"])


def starts(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind and e.get("episode") == "start"]


# --- anomaly ---------------------------------------------------------------------------------------

def test_skip_mode_keeps_parameters_finite_and_records_the_nan(tmp_path: Path) -> None:
    with console_lines(r"\[step 5\] The loss is NaN/Inf"):
        run = run_loop(tmp_path, steps=10, nan_input_at=5, anomaly_detection_mode="skip")
    assert run.parameters_finite(), "skip mode must drop every step whose gradients are NaN"
    assert run.debugger.step == 10
    events = read_events(run.debug_dir)
    assert [e["step"] for e in starts(events, "nonfinite_loss")] == [5]
    grad_event = starts(events, "nonfinite_grad")[0]
    assert grad_event["step"] == 5 and {"inp.weight", "head.bias"} <= set(grad_event["details"]["parameters"])
    assert grad_event["callback"] == "AccelerateDebugger" and grad_event["details"]["action"] == "skip"
    report = read_report(run.debug_dir)
    assert report["status"] == "finished" and report["sections"]["anomaly"]["skipped_steps"] == 5
    scalars = read_scalars(run.tracker_dir)
    loss_finite = dict(scalars["debug/loss_finite"])
    assert sorted(loss_finite) == list(range(10)), "one check per optimizer step, labelled 0..9"
    assert loss_finite[4] == 1.0 and loss_finite[5] == 0.0
    assert dict(scalars["debug/anomaly/count"])[9] == 5.0
    assert "debug/events/nonfinite_loss/text_summary" in text_tags(run.tracker_dir), "events reach the Text tab"


def test_without_skip_the_same_nan_reaches_the_weights(tmp_path: Path) -> None:
    """The control for the skip test: in warn mode the NaN step is applied."""
    with console_lines(r"lightning-debug: "):
        run = run_loop(tmp_path, steps=7, nan_input_at=5, anomaly_detection_mode="warn")
    assert not run.parameters_finite()
    params = starts(read_events(run.debug_dir), "nonfinite_param")
    assert [e["step"] for e in params] == [5], "labelled with the update that applied the NaN gradients"
    assert params[0]["details"]["consequence_of"] == "nonfinite_grad"


def test_raise_mode_raises_at_the_step_and_the_report_says_failed(tmp_path: Path) -> None:
    with pytest.raises(AnomalyError, match="non-finite loss at step 4") as raised:
        run_loop(tmp_path, steps=10, log_zero_at=(4, 0), anomaly_detection_mode="raise")
    assert raised.value.step == 4 and read_report(run_dir(tmp_path / "debug_outputs"))["last_step"] == 4
    report = read_report(run_dir(tmp_path / "debug_outputs"))
    assert report["status"] == "failed" and "AnomalyError" in report["error"]


def test_advanced_level_replays_the_step_and_names_the_operation(tmp_path: Path) -> None:
    with console_lines(r"\[step 4\]"):
        run = run_loop(tmp_path, steps=6, nan_in_model_at=4, level="advanced", anomaly_detection_mode="skip",
                       mode="anomaly_detection")
    loss_event = starts(read_events(run.debug_dir), "nonfinite_loss")[0]
    cause = loss_event["details"]["cause"]
    assert loss_event["step"] == 4 and cause["where"] == "forward"
    assert cause["module"] == "act" and "sqrt" in cause["operation"], cause
    assert run.parameters_finite() and run.debugger.step == 6


def test_advanced_replay_of_a_loss_outside_the_model_says_so(tmp_path: Path) -> None:
    """The loop's ``log(0)`` is not part of the model's forward: the replay must say that, not blame
    non-determinism."""
    with console_lines(r"\[step 4\]"):
        run = run_loop(tmp_path, steps=6, log_zero_at=(4, 0), level="advanced", anomaly_detection_mode="skip",
                       mode="anomaly_detection")
    loss_event = starts(read_events(run.debug_dir), "nonfinite_loss")[0]
    cause = loss_event["details"]["cause"]
    assert loss_event["step"] == 4 and cause["where"] == "not_reproduced"
    assert "the loss computed outside the model" in cause["summary"] and "finite outputs" in cause["summary"]
    assert "non-deterministic" not in loss_event["message"]


def test_skip_restores_batchnorm_statistics_in_an_accelerate_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs, targets = regression_data().tensors
    inputs = inputs.clone()
    inputs[21, 2] = float("nan")  # batch 2 of 8-sample batches
    loader = DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with console_lines(r"\[step 2\]"):
        with AccelerateDebugger(accelerator, model, optimizer, anomaly_detection_mode="skip",
                                mode="anomaly_detection") as debugger:
            for x, y in loader:
                debugger.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    net = accelerator.unwrap_model(model)
    assert debugger.run.monitor(Area.ANOMALY).restored_buffer_steps == 1  # type: ignore[union-attr]
    for name, tensor in [*net.named_parameters(), *net.named_buffers()]:
        assert torch.isfinite(tensor.float()).all(), name
    assert int(net[1].num_batches_tracked) == len(loader) - 1
    net.eval()
    with torch.no_grad():
        assert torch.isfinite(nn.functional.mse_loss(net(targets.new_zeros(4, 8)), targets[:4]))
    accelerator.end_training()


def test_stop_mode_sets_should_stop_after_the_bad_step(tmp_path: Path) -> None:
    with console_lines(r"lightning-debug: "):
        run = run_loop(tmp_path, steps=20, nan_input_at=3, anomaly_detection_mode="stop")
    assert run.debugger.should_stop and run.debugger.step == 4
    assert run.parameters_finite()


def test_accumulation_checks_only_real_optimizer_steps(tmp_path: Path) -> None:
    """4 micro-batches per step; a NaN loss on the 2nd micro-batch of step 3 is reported at step 3."""
    with console_lines(r"\[step 3\] The loss is NaN/Inf"):
        run = run_loop(tmp_path, steps=6, accumulation=4, log_zero_at=(3, 1))
    assert len(run.losses) == 24 and run.debugger.step == 6
    events = read_events(run.debug_dir)
    assert [e["step"] for e in starts(events, "nonfinite_loss")] == [3]
    scalars = read_scalars(run.tracker_dir)
    assert sorted(dict(scalars["debug/loss_finite"])) == list(range(6)), "one check per optimizer step"
    assert dict(scalars["debug/loss_finite"])[3] == 0.0 and dict(scalars["debug/loss_finite"])[2] == 1.0


def test_frequency_counts_optimizer_steps(tmp_path: Path) -> None:
    run = run_loop(tmp_path, steps=9, accumulation=2, anomaly_check_frequency=4)
    assert sorted(dict(read_scalars(run.tracker_dir)["debug/loss_finite"])) == [0, 4, 8]


def test_fp16_grad_scaler_overflow_is_recorded_not_raised_and_norms_are_unscaled(tmp_path: Path) -> None:
    """Accelerate creates a GradScaler only on GPUs; this is a real GradScaler on CPU, given to the
    Accelerator before ``prepare`` as Accelerate does for fp16. Gradients right after backward are
    still multiplied by the scale (2**16 here): the logged norms must be the true ones."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)
    run = run_loop(tmp_path, steps=6, scaler=scaler, overflow_at=2, anomaly_detection_mode="raise",
                   gradient_checking_frequency=1, gradient_explosion_threshold=1000.0)
    events = read_events(run.debug_dir)
    overflow = starts(events, "amp_overflow_skipped")
    assert [e["step"] for e in overflow] == [2] and overflow[0]["severity"] == "info"
    assert not starts(events, "nonfinite_grad") and run.parameters_finite()
    assert scaler.get_scale() == 2.0 ** 15, "the scaler skipped the overflow step and backed off once"
    norms = dict(read_scalars(run.tracker_dir)["debug/grad/global_norm"])
    assert sorted(norms) == [0, 1, 3, 4, 5], "the overflow step's infinite norm is not logged"
    assert max(norms.values()) < 100, "norms of the unscaled gradients (scaled ones are ~65536 times larger)"
    assert not starts(events, "exploding_grad")


def test_fp16_grad_scaler_skip_mode_hands_the_step_to_the_scaler(tmp_path: Path) -> None:
    """A NaN loss whose gradients stay finite: skip mode must still not update, under a GradScaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with console_lines(r"\[step 2\] The loss is NaN/Inf"):
        run = run_loop(tmp_path, steps=5, scaler=scaler, log_zero_at=(2, 0), anomaly_detection_mode="skip")
    assert run.debugger.step == 5 and run.parameters_finite()
    anomalies = run.debugger.run.monitor(Area.ANOMALY)
    assert anomalies is not None and anomalies.skipped_steps == 1
    assert run.accelerator._optimizers[0].step_was_skipped is False, "steps after the skipped one update again"


def test_a_parameter_frozen_before_the_debugger_saw_the_model_is_said_not_judged(tmp_path: Path) -> None:
    """The debugger first sees the model prepared, after the optimizer was built: a layer frozen before it while the
    optimizer holds it cannot be told from one its module built frozen, so the report says ``frozen_param`` for
    that cause was not judged, instead of a silent "by design" (issue 42: an adapter's missing fact is said)."""
    run = run_loop(tmp_path, frozen_hidden=True)
    events = run.events()
    assert [e for e in events if e["severity"] in {"warning", "error", "critical"}] == []
    info = [e for e in events if e["kind"] == "requires_grad_false"]
    assert info and info[0]["details"]["parameters"] == ["hidden.weight", "hidden.bias"]
    assert "Not judged: `frozen_param (requires_grad_false)`: the run first saw the model at its start" in run.report_md()
    assert "requires_grad_false" not in run_loop(tmp_path / "plain").report_md()


def test_invalid_config_fails_at_construction(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="anomaly_detection_mode"):
        AccelerateDebugger(accelerator, model, optimizer, anomaly_detection_mode="explode")
    with pytest.raises(ValueError, match="no field"):
        AccelerateDebugger(accelerator, model, optimizer, gradient_frequency=3)


def test_importing_lightning_debug_does_not_import_accelerate() -> None:
    """Accelerate is an optional extra: only ``lightning_debug.accelerate`` may import it."""
    ours = [name for name in sys.modules if name.split(".")[0] in ("lightning_debug", "accelerate")]
    saved = {name: sys.modules.pop(name) for name in ours}
    try:
        importlib.import_module("lightning_debug")
        assert not [name for name in sys.modules if name.split(".")[0] == "accelerate"]
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in ("lightning_debug", "accelerate")]:
            del sys.modules[name]
        sys.modules.update(saved)


# --- two processes -------------------------------------------------------------------------------

TWO_PROCESS_TIMEOUT_S = 240  # about 15 s alone; under the suite's 300 s per test


def torchrun_command(out: Path, modes: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
            "--out", str(out), "--modes", *modes, "--nan-rank", "1", "--nan-step", "3", "--steps", "8"]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (not torch.distributed.is_available() or not torch.distributed.is_gloo_available()
            or importlib.util.find_spec("torch.distributed.run") is None):
        pytest.skip("torchrun / torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("two_processes")
    completed = run_children(torchrun_command(out, ["raise", "stop", "skip", "fsdp2", "unprepared"]),
                             TWO_PROCESS_TIMEOUT_S, REPO)
    assert completed.returncode == 0, f"torchrun exited with {completed.returncode}:\n{completed.stdout[-5000:]}"
    return out


def test_the_two_processes_inherit_no_launch_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MASTER_PORT, RANK or WORLD_SIZE left in pytest's environment would reach torchrun's workers."""
    leaked = {"MASTER_PORT": "29500", "MASTER_ADDR": "10.0.0.1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3",
              "TORCHELASTIC_RUN_ID": "other", "ACCELERATE_MIXED_PRECISION": "fp16", "PL_GLOBAL_SEED": "7"}
    for key, value in leaked.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    env = child_env()
    assert not set(leaked) & set(env) and env["OMP_NUM_THREADS"] == "1"
    assert str(REPO) in env["PYTHONPATH"].split(os.pathsep) and env["PATH"] == os.environ["PATH"]


def results(out: Path, mode: str) -> list[dict[str, Any]]:
    return [json.loads((out / mode / f"result_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("mode", ["raise", "stop", "skip"])
def test_two_processes_take_the_same_decision_at_the_same_step(two_process_results: Path, mode: str) -> None:
    """The non-finite loss is on rank 1 only and its gradients are finite: rank 0 can only know
    through the gathered flags. Diverging decisions would desynchronise the weights (or hang)."""
    rank0, rank1 = results(two_process_results, mode)
    expected = {"raise": ("raised_at", 3), "stop": ("stopped_at", 3), "skip": ("skipped_steps", 5)}[mode]
    assert rank0[expected[0]] == rank1[expected[0]] == expected[1]
    assert rank0["steps_taken"] == rank1["steps_taken"] == {"raise": 3, "stop": 4, "skip": 8}[mode]
    assert rank0["param_checksum"] == rank1["param_checksum"], "both processes applied the same updates"
    assert rank0["params_finite"] and rank1["params_finite"]
    debug_dir = run_dir(two_process_results / mode / "debug")
    events = read_events(debug_dir)
    loss_events = starts(events, "nonfinite_loss")
    assert len(loss_events) == 1, "events are written once, by the main process"
    assert loss_events[0]["step"] == 3 and loss_events[0]["details"]["ranks"] == [1]
    assert read_report(debug_dir)["findings"]["nonfinite_loss"]["first_step"] == 3


def test_a_loader_left_out_of_prepare_is_named_and_the_prepared_ones_are_not(two_process_results: Path) -> None:
    """The DataLoader not given to ``accelerator.prepare``: both processes read the same batches. Named at check step
    2 (held from step 0, gradient checks every 2 steps); the loops whose loader was prepared read their own shares."""
    found = [e for e in read_events(run_dir(two_process_results / "unprepared" / "debug"))
             if e["severity"] in ("warning", "error") and e.get("episode") != "end"]
    assert [(e["kind"], e["step"], e["details"]["since_step"]) for e in found] == [("same_batch_on_ranks", 2, 0)]
    assert "accelerator.prepare()" in found[0]["message"]
    for mode in ("raise", "stop", "skip"):
        assert starts(read_events(run_dir(two_process_results / mode / "debug")), "same_batch_on_ranks") == []


def test_two_processes_with_a_model_sharded_by_fully_shard_before_prepare(two_process_results: Path) -> None:
    """FSDP2 applied by the user, the optimizer and loader prepared: DTensor gradients, the NaN of rank 1's
    step 3 is skipped on both processes, and the other steps' norms equal torch's."""
    rank0, rank1 = results(two_process_results, "fsdp2")
    expected = [[step, "skip" if step == 3 else "step"] for step in range(8)]
    assert rank0["decisions"] == rank1["decisions"] == expected
    assert rank0["param_checksum"] == rank1["param_checksum"] and rank0["params_finite"]
    assert rank0["failed_checks"] == rank1["failed_checks"] == {}
    assert rank0["sharded"] and rank1["sharded"], "the gradients were DTensor shards"
    assert len(rank0["norms"]) == 7
    for measured, reference in rank0["norms"] + rank1["norms"]:
        assert measured == pytest.approx(reference, rel=1e-6)
    events = read_events(run_dir(two_process_results / "fsdp2" / "debug"))
    assert [e["step"] for e in starts(events, "nonfinite_grad")] == [3]


# --- gradients -------------------------------------------------------------------------------------

def test_unused_layer_is_reported_as_missing_gradients_with_scalars(tmp_path: Path) -> None:
    with console_lines("received no gradient"):
        run = run_loop(tmp_path, steps=6, unused_layer=True, gradient_checking_frequency=2, log_gradients=True)
    missing = starts(read_events(run.debug_dir), "missing_grad")
    assert [e["step"] for e in missing] == [0]
    assert missing[0]["details"]["parameters"] == ["unused.weight", "unused.bias"]
    scalars = read_scalars(run.tracker_dir)
    assert sorted(dict(scalars["debug/grad/global_norm"])) == [0, 2, 4]
    assert dict(scalars["debug/grad/missing_count"])[4] == 3.0
    assert 0 < dict(scalars["debug/grad/norm/head.weight"])[2] < 10
    assert "debug/grad/norm/unused.weight" not in scalars
    assert read_report(run.debug_dir)["findings"]["missing_grad"]["callback"] == "gradients"


def test_weight_updates_and_histograms_use_the_optimizer_step_hook(tmp_path: Path) -> None:
    run = run_loop(tmp_path, steps=5, gradient_checking_frequency=2, log_gradients=True, log_weights=True)
    scalars = read_scalars(run.tracker_dir)
    ratios = dict(scalars["debug/weight/update_ratio_global"])
    assert sorted(ratios) == [0, 2, 4] and all(0 < r < 1 for r in ratios.values())
    assert dict(scalars["debug/weight/update_ratio/head.weight"])[2] > 0
    histograms = read_histogram_tags(run.tracker_dir)
    assert "debug/grad_hist/head.weight" in histograms and "debug/weight_hist/inp.bias" in histograms


@pytest.mark.parametrize("log_zero_from", [None, 6])
def test_an_lbfgs_closure_counts_one_step_per_optimizer_step(tmp_path: Path, log_zero_from: int | None) -> None:
    """``optimizer.step(closure)`` with L-BFGS runs the closure's forward and ``debugger.backward`` several times
    inside the step: the first is the step's, the others open no batch and add no step."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = TinyNet(False)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=4, line_search_fn="strong_wolfe")
    loader = DataLoader(regression_data(), batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = DebugConfig(level="advanced", anomaly_check_frequency=1, gradient_checking_frequency=1,
                         memory_profiling_frequency=1, performance_profiling_frequency=1)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config)
    evaluations = steps = 0
    with debugger:
        while steps < 12:
            for x, y in loader:
                def closure() -> torch.Tensor:
                    nonlocal evaluations
                    evaluations += 1
                    optimizer.zero_grad()
                    loss = nn.functional.mse_loss(model(x), y)
                    if log_zero_from is not None and steps >= log_zero_from:
                        loss = loss + torch.log(torch.zeros(()))
                    debugger.backward(loss)
                    return loss

                optimizer.step(closure)
                steps += 1
                if steps == 12:
                    break
    accelerator.end_training()
    assert evaluations > 2 * steps and debugger.step == steps == 12
    events = read_events(next(tmp_path.rglob("events.jsonl")).parent)
    loud = [(e["kind"], e["step"]) for e in events if e["severity"] in ("warning", "error", "critical")
            and e.get("episode") != "end"]
    if log_zero_from is None:
        assert loud == []
    else:
        assert ("nonfinite_loss", log_zero_from) in loud and min(step for _, step in loud) == log_zero_from


# --- memory and performance -----------------------------------------------------------------------

def test_memory_and_performance_scalars_reach_the_tensorboard_tracker(tmp_path: Path) -> None:
    run = run_loop(tmp_path, steps=8, accumulation=2, memory_profiling_frequency=3,
                   performance_profiling_frequency=2)
    scalars = read_scalars(run.tracker_dir)
    assert sorted(dict(scalars["debug/memory/cpu_rss_mb"])) == [0, 3, 6]
    assert all(value > 10 for _, value in scalars["debug/memory/cpu_rss_mb"])
    phases = {name: dict(scalars[f"debug/perf/{name}_ms"]) for name in ("step", "data", "forward", "backward",
                                                                         "optimizer")}
    assert sorted(phases["step"]) == [0, 2, 4, 6]
    for step in (2, 4, 6):
        parts = sum(phases[name][step] for name in ("data", "forward", "backward", "optimizer"))
        assert abs(parts - phases["step"][step]) < 1e-3 * phases["step"][step] + 1e-3
        assert all(phases[name][step] > 0 for name in ("data", "forward", "backward", "optimizer")), step
    samples_per_sec = dict(scalars["debug/perf/samples_per_sec"])
    assert abs(samples_per_sec[4] - 16 * 1000 / phases["step"][4]) < 1e-3 * samples_per_sec[4], \
        "two micro-batches of 8 samples per optimizer step"
    report = read_report(run.debug_dir)
    assert report["stats"]["memory/cpu_rss_mb"]["count"] == 3
    assert report["stats"]["step_time_ms"]["count"] == 4


def test_slow_data_loader_is_timed_as_data_wait_and_reported(tmp_path: Path) -> None:
    with console_lines("waits for data"):
        run = run_loop(tmp_path, steps=8, data_delay_s=0.03, performance_profiling_frequency=1)
    data_ms = dict(read_scalars(run.tracker_dir)["debug/perf/data_ms"])
    forward_ms = dict(read_scalars(run.tracker_dir)["debug/perf/forward_ms"])
    assert all(data_ms[step] >= 25 for step in range(1, 8)), data_ms
    assert all(forward_ms[step] < 25 for step in range(1, 8)), "the batch starts at the model's forward"
    bottleneck = starts(read_events(run.debug_dir), "dataloader_bottleneck")
    assert bottleneck and bottleneck[0]["details"]["num_workers"] == 0
    report_md = run.report_md()
    assert "Not judged: `loader settings`" not in report_md and "Not judged: `memory kept" not in report_md


def test_without_a_loader_given_the_loader_checks_are_listed_as_not_judged(tmp_path: Path) -> None:
    """The debugger reads no private list of the Accelerator's loaders: a loop that does not pass its DataLoader
    still has its data wait found from the step times, and report.md says what could not be judged without it."""
    run = run_loop(tmp_path, steps=8, data_delay_s=0.03, performance_profiling_frequency=1, pass_loader=False)
    bottleneck = starts(read_events(run.debug_dir), "dataloader_bottleneck")
    assert bottleneck and bottleneck[0]["details"]["num_workers"] is None  # not the prepared loader's, silently
    sections = read_report(run.debug_dir)["sections"]
    assert sections["performance"]["loader"] is None
    assert list(sections["performance"]["unavailable"]) == ["loader settings"]
    assert list(sections["memory"]["unavailable"]) == ["memory kept to an epoch's end"]
    report_md = run.report_md()
    assert "Not judged: `loader settings`: no training DataLoader was given" in report_md
    assert "Not judged: `memory kept to an epoch's end`: the epoch's length is unknown" in report_md


def test_several_loaders_given_quote_the_first(tmp_path: Path) -> None:
    other = DataLoader(regression_data(), batch_size=32, num_workers=0)
    run = run_loop(tmp_path, steps=4, performance_profiling_frequency=1, pass_loader=False,
                   train_dataloader=[DataLoader(regression_data(), batch_size=8, pin_memory=True), other])
    sections = read_report(run.debug_dir)["sections"]
    assert sections["performance"]["loader"]["batch_size"] == 8 and sections["performance"]["loader"]["pin_memory"]
    assert sections["performance"]["unavailable"] == {}
    assert list(sections["memory"]["unavailable"]) == ["memory kept to an epoch's end"]  # whose length is the epoch's?


def test_evaluation_between_steps_is_not_data_wait(tmp_path: Path) -> None:
    run = run_loop(tmp_path, steps=6, evaluate_after=(2, 0.3), performance_profiling_frequency=1)
    data_ms = dict(read_scalars(run.tracker_dir)["debug/perf/data_ms"])
    assert data_ms[3] < 100, f"a no_grad forward restarts the data clock: {data_ms}"


def test_a_tracker_that_writes_each_call_through_is_no_data_wait(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's default store (SQLite) takes milliseconds per ``accelerator.log``, which a loop calls between one
    step's end and the next forward: the step's time, not the data loader's."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # the store's artifacts (the report files attached at the end) go to ./mlruns
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with="mlflow", project_dir=str(tmp_path))
    accelerator.init_trackers("run")
    model = TinyNet()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                   DataLoader(regression_data(), batch_size=8, shuffle=True))
    debugger = AccelerateDebugger(accelerator, model, optimizer, performance_profiling_frequency=1)
    writes: list[float] = []
    with debugger:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            debugger.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            start = time.perf_counter()
            accelerator.log({"train/loss": loss.item()}, step=debugger.step)
            writes.append(1000 * (time.perf_counter() - start))
    accelerator.end_training()
    client = MlflowClient(tracking_uri=uri)
    run_id = client.search_runs([client.get_experiment_by_name("run").experiment_id])[0].info.run_id
    data_ms = {m.step: m.value for m in client.get_metric_history(run_id, "debug/perf/data_ms")}
    assert len(client.get_metric_history(run_id, "train/loss")) == 32
    assert statistics.median(writes) > 3 * statistics.median(data_ms.values()), (writes, data_ms)
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    assert not [e for e in events if e["severity"] in ("warning", "error", "critical")], events


def test_out_of_memory_leaves_a_post_mortem_and_propagates(tmp_path: Path) -> None:
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 GiB"):
        run_loop(tmp_path, steps=6, oom_at=3)
    directory = run_dir(tmp_path / "debug_outputs")
    oom = starts(read_events(directory), "oom")
    assert [e["step"] for e in oom] == [3] and oom[0]["details"]["phase"] == "forward"
    assert any("[8, 8]" in line for line in oom[0]["details"]["batch"]), oom[0]["details"]["batch"]
    assert (directory / "oom_step3.md").exists()
    assert read_report(directory)["status"] == "failed"


def test_mode_selects_the_areas_like_debug_callbacks(tmp_path: Path) -> None:
    run = run_loop(tmp_path, steps=3, mode="anomaly_detection", gradient_checking_frequency=1,
                   performance_profiling_frequency=1)
    assert [m.area for m in run.debugger.run.monitors] == [Area.ANOMALY, Area.LOOP, Area.ERRORS]
    tags = set(read_scalars(run.tracker_dir))
    assert "debug/loss_finite" in tags and not any(tag.startswith(("debug/grad/", "debug/perf/")) for tag in tags)


def test_a_launcher_job_the_accelerator_does_not_join_is_named(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun without Accelerator(cpu=True) on a CPU machine: N separate runs writing the same files."""
    accelerator = Accelerator(project_dir=str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = TinyNet()
    with pytest.warns(RuntimeWarning, match=r"started 2 processes .* Accelerator\(cpu=True\)"):
        AccelerateDebugger(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), save_debug_info=False)


def test_counts_resume_through_accelerate_checkpoints(tmp_path: Path) -> None:
    def session(steps: int, nan_at: int | None, load: bool) -> AccelerateDebugger:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
        model = TinyNet()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        debugger = AccelerateDebugger(accelerator, model, optimizer, mode="anomaly_detection")
        accelerator.register_for_checkpointing(debugger)
        if load:
            accelerator.load_state(str(tmp_path / "checkpoint"))
        x, y = regression_data(16)[:]
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            if debugger.step == nan_at:
                loss = loss + torch.log(torch.zeros(()))
            debugger.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        debugger.finish()
        if not load:
            accelerator.save_state(str(tmp_path / "checkpoint"))
        return debugger

    with console_lines(r"\[step 1\]"):
        session(3, nan_at=1, load=False)
    resumed = session(2, nan_at=None, load=True)
    anomalies = resumed.run.monitor(Area.ANOMALY)
    assert resumed.step == 5 and anomalies is not None and anomalies.anomaly_count == 1
    report = read_report(run_dir(tmp_path / "debug_outputs"))
    assert report["last_step"] == 5 and report["findings"]["nonfinite_loss"]["first_step"] == 1


def test_a_failing_check_warns_once_and_the_other_areas_go_on(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_debug.monitors.memory import MemoryMonitor

    def measure(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no memory counters here")

    monkeypatch.setattr(MemoryMonitor, "measure", measure)
    with console_lines("MemoryMonitor.* failed .*no memory counters here") as caught:
        run = run_loop(tmp_path, steps=6, memory_profiling_frequency=1, performance_profiling_frequency=1,
                       gradient_checking_frequency=1)
    assert sum("MemoryMonitor" in line for line in caught) == 1
    assert run.debugger.step == 6
    scalars = read_scalars(run.tracker_dir)
    assert "debug/memory/cpu_rss_mb" not in scalars
    for tag in ("debug/perf/step_ms", "debug/grad/global_norm", "debug/loss_finite"):
        assert sorted(dict(scalars[tag]))[-1] == 5, tag
    assert read_report(run.debug_dir)["status"] == "finished"


def test_a_learning_rate_at_zero_mid_loop_is_a_stall_once_the_loop_says_how_long_it_runs(tmp_path: Path) -> None:
    config = DebugConfig(mode="gradient_checking", gradient_checking_frequency=1)
    told = run_loop(tmp_path / "told", steps=24, lr_zero_from=8, config=config, total_steps=24)
    stalls = starts(told.events(), "learning_stalled")
    assert [event["step"] for event in stalls] == [9] and "LambdaLR" in stalls[0]["message"]
    assert "Not judged" not in told.report_md()
    untold = run_loop(tmp_path / "untold", steps=24, lr_zero_from=8, config=config)
    assert not starts(untold.events(), "learning_stalled")
    assert "Not judged: `learning_stalled`" in untold.report_md() and "total_steps" in untold.report_md()
    healthy = run_loop(tmp_path / "healthy", steps=24, config=config, total_steps=24)
    assert not [event for event in healthy.events() if event["severity"] in ("warning", "error", "critical")]


def test_total_steps_must_be_a_positive_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="total_steps"):
        run_loop(tmp_path, steps=1, total_steps=0)


class Classifier(nn.Module):
    def __init__(self, width: int, sigmoid: bool = False) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, width)
        self.out = nn.Sigmoid() if sigmoid else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(torch.relu(self.body(x))))


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("cause", ["softmax_over_batch", "shared_target", "probabilities_into_sigmoid",
                                   "single_class_batches"])
def test_the_rules_on_the_outputs_gradient_name_their_cause_in_an_accelerate_loop(tmp_path: Path, cause: str) -> None:
    """``nll_loss(log_softmax(logits, dim=0))``, an (N,) target broadcast against an (N, 1) output, a sigmoid's
    output fed to ``binary_cross_entropy_with_logits`` and ``cross_entropy`` on data in label order, each in a plain
    Accelerate loop with the gradient callback's defaults: named at the second judgement, as under a Trainer."""
    g = torch.Generator().manual_seed(0)
    labels = (torch.arange(4).repeat_interleave(8 * 37) if cause == "single_class_batches"
              else torch.randint(0, 4, (32 * 37,), generator=g))
    inputs = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(len(labels), 16, generator=g)
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = Classifier(1 if cause == "shared_target" else 4, sigmoid=cause == "probabilities_into_sigmoid")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    debugger = AccelerateDebugger(accelerator, model, optimizer, DebugConfig(mode="gradient_checking", save_plots=False),
                                  total_steps=110)
    with debugger:
        while debugger.step < 110:
            for x, y in loader:
                z = model(x)
                if cause == "probabilities_into_sigmoid":
                    loss = nn.functional.binary_cross_entropy_with_logits(z, nn.functional.one_hot(y, 4).float())
                elif cause == "single_class_batches":
                    loss = nn.functional.cross_entropy(z, y)
                else:
                    loss = (nn.functional.nll_loss(torch.log_softmax(z, dim=0), y) if z.shape[1] > 1
                            else nn.functional.mse_loss(z, y.float()))
                debugger.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if debugger.step >= 110:
                    break
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    named = [(e["step"], e["details"].get("cause", e["kind"])) for e in events
             if e["kind"] in ("learning_stalled", "single_class_batches") and e["severity"] == "warning"]
    assert named == [(100, cause)], [(e["kind"], e["step"]) for e in events]


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_a_softmax_output_fed_to_cross_entropy_under_gradient_accumulation_is_named_in_an_accelerate_loop(
        tmp_path: Path, factor: float) -> None:
    """``gradient_accumulation_steps=4``: ``debugger.backward`` sees the loss the loop computed and
    ``accelerator.backward`` divides it by 4 before it differentiates it, so the output's gradient is read against
    the quotient (``backward_divisor``): the softmax applied twice is named at step 100 (suspected at 0) as under a
    Trainer with ``accumulate_grad_batches=4`` (tests/integration/test_activation_defaults.py), the accumulation is
    no factor of the loss, and a loss halved by hand (under the softmax's floor, which cleared the run) is named
    with its factor."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (32 * 4 * 210,), generator=g)
    inputs = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(len(labels), 16, generator=g)
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path), gradient_accumulation_steps=4)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.Softmax(dim=-1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = DebugConfig(mode="gradient_checking", save_plots=False)
    debugger = AccelerateDebugger(accelerator, model, optimizer, config, total_steps=210)
    with debugger:
        for x, y in loader:
            with accelerator.accumulate(model):
                debugger.backward(factor * nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if debugger.step >= 210:
                break
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"].get("cause")) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        [(e["kind"], e["step"]) for e in events]
    assert stalled[0]["details"].get("loss_scale", 1.0) == pytest.approx(factor, rel=1e-3)
