"""Several optimizers (a GAN in manual optimization) and steps Lightning skips, on real Trainer runs.

Each optimizer step is judged on the parameters that optimizer owns, and the check frequencies
count each optimizer's own steps; a ``training_step`` that returns ``None`` (no backward, no
update) is not a layer without gradients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import (
    AnomalyDetectionCallback,
    DebugConfig,
    GradientHealthCallback,
    MemoryProfilerCallback,
    PerformanceProfilerCallback,
)
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_report, read_scalars

pytestmark = pytest.mark.timeout(120)

SERIOUS = ("warning", "error", "critical")
NOISE = 4


class Generator(nn.Module):
    def __init__(self, unused_layer: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, 8))
        self.unused = nn.Linear(8, 8) if unused_layer else None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.body(z)


class TinyGAN(pl.LightningModule):
    """A GAN in manual optimization: the discriminator steps, then the generator, every batch.

    Args:
        unused_generator_layer: The generator owns a layer its forward never uses (missing gradients).
        nan_discriminator_from: From this discriminator step on (its own count), its loss is multiplied
            by ``log(0)``: a non-finite loss and non-finite discriminator gradients.
        zero_generator_grads: False plants a loop that never zeroes the generator's gradients.
    """

    def __init__(self, unused_generator_layer: bool = False, nan_discriminator_from: int | None = None,
                 zero_generator_grads: bool = True) -> None:
        super().__init__()
        self.zero_generator_grads = zero_generator_grads
        self.automatic_optimization = False
        self.generator = Generator(unused_generator_layer)
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.nan_discriminator_from = nan_discriminator_from
        self.d_steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(torch.randn(real.shape[0], NOISE))
        d_real, d_fake = self.discriminator(real), self.discriminator(fake.detach())
        d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        if self.nan_discriminator_from is not None and self.d_steps >= self.nan_discriminator_from:
            d_loss = d_loss * torch.log(torch.zeros(()))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.d_steps += 1
        g_out = self.discriminator(fake)
        g_loss = bce(g_out, torch.ones_like(g_out))
        if self.zero_generator_grads:
            opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 8, generator=generator) * 0.5 + 1.0), batch_size=16)


def every_check(frequency: int, level: str = "advanced", **extra: Any) -> list[pl.Callback]:
    config = DebugConfig(level=level, anomaly_check_frequency=frequency, gradient_checking_frequency=frequency,
                         memory_profiling_frequency=frequency, performance_profiling_frequency=frequency,
                         print_summary=False, save_plots=False, **extra)
    return [AnomalyDetectionCallback(config), GradientHealthCallback(config), MemoryProfilerCallback(config),
            PerformanceProfilerCallback(config)]


def fit(tmp_path: Path, model: pl.LightningModule, callbacks: list[pl.Callback], batches: int) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, callbacks, max_steps=-1, max_epochs=1, limit_train_batches=batches)
    trainer.fit(model)
    return trainer


def serious(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["severity"] in SERIOUS]


def test_gan_healthy_with_every_check_every_step_is_quiet(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyGAN(), every_check(1, log_gradients=True, log_weights=True), batches=12)
    assert trainer.global_step == 24, "Lightning's global_step counts both optimizers' steps"
    events = read_events(debug_dir(trainer))
    assert serious(events) == [], [(e["kind"], e["step"], e["message"][:160]) for e in serious(events)]
    report = read_report(debug_dir(trainer))
    assert report["sections"]["gradients"]["checks"] == 24, "every step of both optimizers is checked"
    ratios = report["sections"]["gradients"]["parameter_update_ratios"]
    assert {"generator.body.0.weight", "discriminator.0.weight"} <= set(ratios)
    assert all(stats["min"] > 0 for stats in ratios.values()), "each optimizer step moves its own parameters"


def test_gan_with_frequency_ten_checks_both_optimizers(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyGAN(), every_check(10, level="basic", log_gradients=True), batches=20)
    assert serious(read_events(debug_dir(trainer))) == []
    scalars = read_scalars(trainer.logger.log_dir)
    generator_steps = [step for step, _ in scalars["debug/grad/norm/generator.body.0.weight"]]
    discriminator_steps = [step for step, _ in scalars["debug/grad/norm/discriminator.0.weight"]]
    # 40 optimizer steps (global_step 0..39), D at even, G at odd ones: each checked every 10 of its own steps,
    # at global steps 0/1 and 20/21, logged on Lightning's rows, whose axis counts batches: 0 and 10
    assert discriminator_steps == [0, 10]
    assert generator_steps == [0, 10]
    assert read_report(debug_dir(trainer))["sections"]["gradients"]["checks"] == 4


def test_unused_generator_layer_is_named_at_the_generator_step(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyGAN(unused_generator_layer=True), every_check(1), batches=6)
    missing = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    assert missing, "the unused generator layer is found"
    first = missing[0]
    assert first["step"] == 1, "found at the generator's first step (global_step 1), not the discriminator's"
    assert first["details"]["parameters"] == ["generator.unused.weight", "generator.unused.bias"]
    assert all(set(e["details"]["parameters"]) <= {"generator.unused.weight", "generator.unused.bias"}
               for e in missing)


def test_nan_in_the_discriminator_loss_names_its_step_and_parameters(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyGAN(nan_discriminator_from=3), every_check(1, level="basic"), batches=6)
    events = read_events(debug_dir(trainer))
    loss = [e for e in events if e["kind"] == "nonfinite_loss"]
    grads = [e for e in events if e["kind"] == "nonfinite_grad"]
    assert loss and loss[0]["step"] == 6, "the 4th discriminator step is global_step 6"
    assert grads and grads[0]["step"] == 6
    assert set(grads[0]["details"]["parameters"]) == {"discriminator.0.weight", "discriminator.0.bias",
                                                      "discriminator.2.weight", "discriminator.2.bias"}
    assert loss[0]["batch"] == 3 and loss[0]["optimizer"] == 1, "batch 3, the second optimizer (discriminator)"


def test_generator_gradients_never_zeroed_are_named_not_the_discriminators(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyGAN(zero_generator_grads=False), every_check(1, level="basic")[:2], batches=6)
    found = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "grad_not_zeroed" and e.get("episode") != "end"]
    assert found and found[0]["step"] == 3, "the generator's second step adds to its first step's gradients"
    assert all(name.startswith("generator.") for e in found for name in e["details"]["parameters"])


class SometimesNone(TinyRegressor):
    """Returns None every third batch: Lightning then skips backward and the optimizer update."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if batch_idx % 3 == 2:
            return None
        return super().training_step(batch, batch_idx)


def test_training_step_returning_none_is_quiet(tmp_path: Path) -> None:
    # the checks that judge gradients and weights; step timing of such steps is the performance area's
    trainer = fit(tmp_path, SometimesNone(), every_check(1)[:3], batches=12)
    events = read_events(debug_dir(trainer))
    assert serious(events) == [], [(e["kind"], e["step"], e["message"][:160]) for e in serious(events)]
    gradients = read_report(debug_dir(trainer))["sections"]["gradients"]
    assert gradients["steps_without_gradients"] == 4


class GANPair(nn.Module):
    """Generator and discriminator in one module, so that events name them ``generator.*`` / ``discriminator.*``."""

    def __init__(self, unused_generator_layer: bool = False) -> None:
        super().__init__()
        self.generator = Generator(unused_generator_layer)
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def accelerate_gan(root: Path, *, name_optimizers: bool = True, unused_generator_layer: bool = False,
                   batches: int = 12, **overrides: Any) -> tuple[Any, Path]:
    """A GAN loop in Accelerate: the discriminator steps, then the generator, each after its own backward."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from lightning_debug.accelerate import AccelerateDebugger

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=str(root))
    gan = GANPair(unused_generator_layer)
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    data = DataLoader(TensorDataset(torch.randn(256, 8) * 0.5 + 1.0), batch_size=16)
    gan, opt_g, opt_d, data = accelerator.prepare(gan, opt_g, opt_d, data)
    config = DebugConfig(print_summary=False, save_plots=False, **overrides)
    debugger = AccelerateDebugger(accelerator, gan, [opt_g, opt_d], config)
    bce = nn.functional.binary_cross_entropy_with_logits
    with debugger:
        for batch, (real,) in enumerate(data):
            if batch == batches:
                break
            fake = gan.generator(torch.randn(real.shape[0], NOISE))
            d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
            d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            opt_d.zero_grad()
            debugger.backward(d_loss, **({"optimizer": opt_d} if name_optimizers else {}))
            opt_d.step()
            g_out = gan.discriminator(fake)
            opt_g.zero_grad()
            debugger.backward(bce(g_out, torch.ones_like(g_out)), **({"optimizer": opt_g} if name_optimizers else {}))
            opt_g.step()
    accelerator.end_training()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return debugger, Path(debugger.run.session.output_dir)


def test_accelerate_gan_with_named_optimizers_is_quiet(tmp_path: Path) -> None:
    debugger, directory = accelerate_gan(tmp_path, level="advanced", anomaly_check_frequency=1,
                                         gradient_checking_frequency=1, memory_profiling_frequency=1,
                                         mode="full_debug", log_weights=True)
    assert debugger.step == 24
    events = read_events(directory)
    assert serious(events) == [], [(e["kind"], e["step"], e["message"][:160]) for e in serious(events)]
    gradients = read_report(directory)["sections"]["gradients"]
    assert gradients["checks"] == 24
    assert all(stats["min"] > 0 for stats in gradients["parameter_update_ratios"].values())


def test_accelerate_gan_unused_generator_layer_and_frequency_per_optimizer(tmp_path: Path) -> None:
    _, directory = accelerate_gan(tmp_path, unused_generator_layer=True, batches=20, gradient_checking_frequency=10,
                                  mode="gradient_checking")
    missing = [e for e in read_events(directory) if e["kind"] == "missing_grad" and e.get("episode") != "end"]
    # each optimizer checked at its own steps 0 and 10: D at 0 and 20, G at 1 and 21; only G's steps miss
    assert [e["step"] for e in missing] == [1]
    assert missing[0]["details"]["parameters"] == ["generator.unused.weight", "generator.unused.bias"]
    assert missing[0]["optimizer"] == 0
    assert read_report(directory)["sections"]["gradients"]["checks"] == 4


def test_accelerate_several_optimizers_without_a_name_say_so_once(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="optimizer=opt") as caught:
        debugger, _ = accelerate_gan(tmp_path, name_optimizers=False, batches=3, mode="anomaly_detection")
    assert debugger.step == 6
    assert len([w for w in caught if "optimizer=opt" in str(w.message)]) == 1
