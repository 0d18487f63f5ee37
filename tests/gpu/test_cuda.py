"""The CUDA tier: every path that only runs on a GPU, for real (no simulated CUDA).

Skipped as a whole without CUDA (this project's machines have none); ``scripts/gpu-check.sh`` installs
a CUDA torch into ``.venv`` and runs this tier and the GPT-134M bf16 benchmark in one command. Each test
trains a tiny model with a real ``lightning.Trainer`` on ``cuda:0`` and reads back the files the run
wrote: a real out-of-memory error and its post-mortem (with the allocation snapshot at EXPERT), an fp16
``GradScaler`` overflow told apart from a NaN, CUDA-event phase timing with no ``synchronize()`` on
non-check steps, CUDA memory readings, ``host_sync`` at EXPERT, and DDP over NCCL on one GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: scripts/gpu-check.sh runs this tier on a GPU", allow_module_level=True)

import lightning.pytorch as pl
from torch import nn

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import TinyRegressor, debug_dir, read_events, read_report, read_scalars

pytestmark = pytest.mark.timeout(300)
THIS_FILE = Path(__file__).name


def cuda_trainer(root: Path, config: DebugConfig, max_steps: int = 20, **kwargs: Any) -> pl.Trainer:
    from lightning.pytorch.loggers import TensorBoardLogger

    options: dict[str, Any] = dict(default_root_dir=str(root), max_steps=max_steps, accelerator="gpu", devices=1,
                                   logger=TensorBoardLogger(str(root), name="tb"), enable_progress_bar=False,
                                   enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
    options.update(kwargs)
    return pl.Trainer(callbacks=debug_callbacks(config), **options)


def fit(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)


def every_step(**overrides: Any) -> DebugConfig:
    options: dict[str, Any] = dict(anomaly_check_frequency=1, gradient_checking_frequency=1,
                                   memory_profiling_frequency=1, performance_profiling_frequency=1,
                                   print_summary=False, save_plots=False)
    options.update(overrides)
    return DebugConfig(**options)


def serious(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("severity") in ("warning", "error", "critical")]


# --- out of memory ------------------------------------------------------------------------------------


class AllocatesTooMuch(TinyRegressor):
    """At step 3 the forward asks for four times the device's memory: a real ``torch.OutOfMemoryError``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 3:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.empty(total, dtype=torch.float32, device=self.device)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("level", ["basic", "expert"])
def test_a_real_out_of_memory_error_leaves_its_post_mortem(level: str, tmp_path: Path) -> None:
    trainer = cuda_trainer(tmp_path, DebugConfig(level=level, print_summary=False, save_plots=False))
    with pytest.raises(torch.OutOfMemoryError):
        fit(trainer, AllocatesTooMuch())
    directory = debug_dir(trainer)
    oom = [e for e in read_events(directory) if e["kind"] == "oom"]
    assert len(oom) == 1 and oom[0]["step"] == 3 and oom[0]["severity"] == "critical", oom
    post_mortem = (directory / "oom_step3.md").read_text()
    assert "forward" in post_mortem and "OutOfMemoryError" in post_mortem
    assert "memory_summary" in post_mortem or "PyTorch CUDA memory summary" in post_mortem
    snapshots = sorted(directory.glob("oom_snapshot_step3*.pickle"))
    if level == "expert":  # allocation history is on for the whole run: the snapshot is written
        assert snapshots and snapshots[0].stat().st_size > 0
    else:
        assert not snapshots
    assert read_report(directory)["status"] == "failed"


# --- fp16 GradScaler overflow against a real NaN -------------------------------------------------------


class OverflowsOnce(TinyRegressor):
    """At step 5 the loss is multiplied by 1e6: finite in float32, but its scaled fp16 gradients overflow,
    which the GradScaler skips by design. ``nan_at``: a log of a negative number instead, a real NaN.

    The scaler's first steps overflow too (its scale starts at 2**16 and halves on each overflow until the
    gradients fit): on an H200 the first overflows were at steps 0 and 3, each as much an info as step 5's.
    """

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__(optimizer="adam", lr=1e-3)
        self.nan_at = nan_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        step = self.trainer.global_step
        if self.nan_at is None and step == 5:
            return loss * 1e6
        if self.nan_at is not None and step == self.nan_at:
            return loss + torch.log(-torch.ones((), device=loss.device))
        return loss


def test_fp16_grad_scaler_overflow_is_told_apart_from_a_nan(tmp_path: Path) -> None:
    trainer = cuda_trainer(tmp_path / "overflow", every_step(), max_steps=12, precision="16-mixed")
    fit(trainer, OverflowsOnce())
    events = read_events(debug_dir(trainer))
    overflow = [e for e in events if e["kind"] == "amp_overflow_skipped"]
    assert 5 in [e["step"] for e in overflow] and {e["severity"] for e in overflow} == {"info"}, events
    assert not [e for e in events if e["kind"] in ("nonfinite_grad", "nonfinite_loss", "nonfinite_param")]

    trainer = cuda_trainer(tmp_path / "nan", every_step(), max_steps=12, precision="16-mixed")
    fit(trainer, OverflowsOnce(nan_at=7))
    events = read_events(debug_dir(trainer))
    loss = [e for e in events if e["kind"] == "nonfinite_loss"]
    assert loss and loss[0]["step"] == 7 and loss[0]["severity"] == "error", events


# --- timing without synchronize() on non-check steps ---------------------------------------------------


def test_phase_timing_uses_cuda_events_and_never_synchronizes_on_non_check_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check every 10 steps: between them no ``torch.cuda.synchronize()`` at all (the phase times
    are CUDA events read once they completed, the flags come back through pinned memory)."""
    module = TinyRegressor()
    synced_at: list[int] = []
    real_synchronize = torch.cuda.synchronize

    def synchronize(*args: Any, **kwargs: Any) -> Any:
        synced_at.append(module.trainer.global_step if module._trainer is not None else -1)
        return real_synchronize(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    config = DebugConfig(level="advanced", anomaly_check_frequency=10, gradient_checking_frequency=10,
                         memory_profiling_frequency=10, performance_profiling_frequency=10, profile_steps=(0, 0),
                         print_summary=False, save_plots=False)
    trainer = cuda_trainer(tmp_path, config, max_steps=40)
    fit(trainer, module)
    during = [step for step in synced_at if 0 < step < 40]
    assert all(step % 10 == 0 for step in during), f"synchronized on non-check steps: {during}"
    scalars = read_scalars(trainer.logger.log_dir)
    assert {step for step, _ in scalars["debug/perf/step_ms"]} <= set(range(0, 40, 10))
    for phase in ("forward", "backward", "optimizer"):
        values = [value for _, value in scalars[f"debug/perf/{phase}_ms"]]
        assert values and all(value > 0 for value in values), phase
    assert not serious(read_events(debug_dir(trainer)))


# --- memory readings ----------------------------------------------------------------------------------


def test_cuda_memory_readings_are_logged_and_summarised(tmp_path: Path) -> None:
    trainer = cuda_trainer(tmp_path, every_step(level="advanced", profile_steps=(0, 0)), max_steps=12)
    fit(trainer, TinyRegressor())
    scalars = read_scalars(trainer.logger.log_dir)
    allocated = [value for _, value in scalars["debug/memory/cuda_allocated_mb"]]
    assert allocated and all(value > 0 for value in allocated)
    assert [value for _, value in scalars["debug/memory/cuda_peak_mb"]]
    assert any(tag.startswith("debug/memory/phase/") for tag in scalars)
    report = read_report(debug_dir(trainer))
    assert "memory" in report["sections"] and not serious(read_events(debug_dir(trainer)))


# --- host_sync at EXPERT ------------------------------------------------------------------------------


class SyncsEveryStep(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last_loss = loss.item()  # a host-device synchronization in user code, every step
        return loss


def test_host_sync_at_expert_names_the_users_line(tmp_path: Path) -> None:
    trainer = cuda_trainer(tmp_path, DebugConfig(level="expert", print_summary=False, save_plots=False),
                           max_steps=12)
    fit(trainer, SyncsEveryStep())
    syncs = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "host_sync"]
    assert syncs and syncs[0]["step"] >= 5, syncs
    sites = syncs[0]["details"]["sites"]
    assert any(THIS_FILE in site["file"] and "loss.item()" in site["code"] for site in sites), sites


# --- DDP over NCCL ------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="this torch has no NCCL")
def test_ddp_over_nccl_on_one_gpu_checks_and_reports(tmp_path: Path) -> None:
    """One process per GPU is what NCCL allows; with one GPU, DDP runs one NCCL rank: the collectives
    (the gathered flags, the phase all_gather) run for real on the GPU."""
    trainer = cuda_trainer(tmp_path, every_step(), max_steps=12, strategy="ddp")
    fit(trainer, TinyRegressor())
    assert trainer.strategy.root_device.type == "cuda"
    assert torch.distributed.get_backend() == "nccl" if torch.distributed.is_initialized() else True
    directory = debug_dir(trainer)
    assert not serious(read_events(directory)) and read_report(directory)["status"] == "finished"
    assert [value for _, value in read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"]]


def test_a_nan_under_ddp_over_nccl_is_found_at_its_step(tmp_path: Path) -> None:
    trainer = cuda_trainer(tmp_path, every_step(), max_steps=12, strategy="ddp")
    fit(trainer, TinyRegressor(log_zero_from_step=6))
    loss = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_loss"]
    assert loss and loss[0]["step"] == 6, loss


def test_a_missing_gradient_on_cuda_keeps_the_fused_norm_and_measures_zero() -> None:
    """On a GPU every slot goes to ``torch._foreach_norm``: the zeros for a missing gradient are one dense 0-d
    tensor per slot (no allocation of the slot's size each step), and the plan stays fused."""
    from lightning_debug.core.numerics import ParameterIndex

    model = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)]).cuda()
    x = torch.randn(2, 64, device="cuda")
    (model[0](x).sum() + model[2](x).sum()).backward()
    index = ParameterIndex(list(model.named_parameters()))
    grads, missing = index.local_grads()
    assert missing == [2, 3, 6, 7] and all(grads[i].dim() == 0 and grads[i].is_cuda for i in missing)
    assert all(grads[i] is index.local_grads()[0][i] for i in missing)
    expected = [0.0 if p.grad is None else p.grad.double().square().sum().item() for p in index.params]
    assert index.plan.squares(grads).tolist() == pytest.approx(expected, rel=1e-5) and index.plan.fused
