"""Verdicts that fit the model (issue 13): exploding judged against the run's own norms, clipping named,
vanishing judged per layer, and early divergence (loss_spike, loss_divergence, update_ratio_high)
named before anything is NaN. Real Trainer runs on CPU, a few dozen steps each."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, DebugConfig, GradientHealthCallback
from lightning_debug.checks.trends import NormHistory, jump_limit, median
from lightning_debug.monitors.anomaly.divergence import LossJudge
from tests.harness.toolkit import debug_dir, fit_seeded, make_trainer, read_events, read_scalars, regression_data

pytestmark = pytest.mark.timeout(120)

LOUD = {"warning", "error", "critical"}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Intra-op threads fight over a busy CPU (a 24-layer MLP step goes from 15 ms to over 1 s): one is enough."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


fit = fit_seeded


def loud(trainer: pl.Trainer) -> list[tuple[int, str, str]]:
    return [(e["step"], e["kind"], e["message"]) for e in read_events(debug_dir(trainer))
            if e["severity"] in LOUD and e.get("episode") != "end"]


def starts(trainer: pl.Trainer, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if e["kind"] == kind and e.get("episode") == "start"]


def every_check_every_step(**overrides: Any) -> list[pl.Callback]:
    """Both numeric checks on every step, weight norms and update ratios measured (``log_weights``)."""
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, log_weights=True, **overrides)
    return [AnomalyDetectionCallback(config), GradientHealthCallback(config)]


# --- models --------------------------------------------------------------------------------------
class DeepNormMLP(pl.LightningModule):
    """A healthy 24-layer MLP with LayerNorm and GELU, Adam at 1e-4 (global norm ~12 at step 0).

    ``grad_scale_from``: from this step on every gradient is multiplied by ``grad_scale`` (a hook on the
    logits: the loss itself is unchanged); ``loss_scale`` scales the loss from the start.
    """

    def __init__(self, depth: int = 24, width: int = 64, classes: int = 10, lr: float = 1e-4,
                 optimizer: str = "adam", grad_scale_from: int | None = None, grad_scale: float = 100.0,
                 loss_scale: float = 1.0, grad_spike_steps: tuple[int, ...] = ()) -> None:
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights whatever ran before: the norms are asserted
            torch.manual_seed(0)
            self.stem = nn.Linear(16, width)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                        for _ in range(depth))
            self.head = nn.Linear(width, classes)
        self.lr, self.optimizer_name = lr, optimizer
        self.grad_scale_from, self.grad_scale, self.loss_scale = grad_scale_from, grad_scale, loss_scale
        self.grad_spike_steps = grad_spike_steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        if self.grad_scale_from is not None and self.trainer.global_step >= self.grad_scale_from:
            logits.register_hook(lambda grad: grad * self.grad_scale)
        elif self.trainer.global_step in self.grad_spike_steps:
            logits.register_hook(lambda grad: grad * self.grad_scale)
        return nn.functional.cross_entropy(logits, y) * self.loss_scale

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(512, 16, generator=generator)
        targets = (inputs[:, :10].argmax(dim=1) + torch.randint(0, 2, (512,), generator=generator)) % 10
        return DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)


class WideClassifier(pl.LightningModule):
    """A small MLP over 1000 classes (loss ~6.9 at the start) with AdamW; lr=10 blows the loss up at step 1."""

    def __init__(self, lr: float = 10.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1000))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(512, 32, generator=generator),
                                        torch.randint(0, 1000, (512,), generator=generator)), batch_size=32)


class SlowlyDiverging(pl.LightningModule):
    """Linear regression with plain SGD at a learning rate just past the stable limit: the loss grows
    by a steady factor every step (no single jump), the classic overshoot."""

    def __init__(self, lr: float = 0.11) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.linear(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        inputs, targets = regression_data().tensors
        scale = torch.linspace(0.5, 3.0, 8)
        return DataLoader(TensorDataset(inputs * scale, targets), batch_size=256)


class MaskedPath(pl.LightningModule):
    """``hidden``'s output is multiplied by 0 (a mask bug): ``inp`` and ``hidden`` get exactly zero
    gradients on every step, a truly dead part of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.skip = nn.Linear(8, 16)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.hidden(torch.relu(self.inp(x))) * 0.0
        return nn.functional.mse_loss(self.head(torch.relu(h + self.skip(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=32, shuffle=True)


class KeyBiasAttention(nn.Module):
    """BERT's self-attention, written out: the key projection's bias adds ``q . b`` to every score of a
    query, which softmax ignores, so its gradient is zero up to rounding by construction."""

    def __init__(self, width: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.heads = heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, width = h.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(width // self.heads)).softmax(dim=-1)
        context = (scores @ v).transpose(1, 2).reshape(batch, length, width)
        return self.norm(h + self.out(context))


class TinyAttentionClassifier(pl.LightningModule):
    """Token embeddings, two attention layers with key biases, a classifier on the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.layers = nn.ModuleList(KeyBiasAttention() for _ in range(2))
        self.classifier = nn.Linear(32, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.classifier(h[:, 0]), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 100, (128, 12), generator=generator)
        return DataLoader(TensorDataset(ids, ids[:, 0] % 3), batch_size=16, shuffle=True)


class TinyBert(pl.LightningModule):
    """Stock ``transformers`` BertForSequenceClassification from a tiny config (no download)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=37, max_position_embeddings=64, num_labels=3)
        torch.manual_seed(0)
        self.model = transformers.BertForSequenceClassification(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 100, (128, 12), generator=generator)
        return DataLoader(TensorDataset(ids, ids[:, 0] % 3), batch_size=16, shuffle=True)


# --- healthy runs are quiet ----------------------------------------------------------------------
def test_healthy_deep_layernorm_gelu_mlp_is_quiet_at_defaults_and_with_every_check_every_step(tmp_path: Path) -> None:
    model = DeepNormMLP()
    trainer = fit(tmp_path / "defaults", model, [AnomalyDetectionCallback(), GradientHealthCallback()], 30)
    norms = dict(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"])
    assert norms[0] > 10.0, "the global norm at step 0 is above the old fixed threshold: the test means something"
    assert loud(trainer) == []
    trainer = fit(tmp_path / "every", DeepNormMLP(), every_check_every_step(), 20)
    assert loud(trainer) == []
    assert len(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"]) == 20


def test_a_large_gradient_norm_at_initialisation_is_not_exploding(tmp_path: Path) -> None:
    """A norm of 60 at step 0 is normal for many architectures (a ResNet-18 has 61): with no history it
    is not judged, and afterwards only against the run's own norms."""
    trainer = fit(tmp_path, DeepNormMLP(loss_scale=6.0), every_check_every_step(), 12)
    norms = dict(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"])
    assert norms[0] > 50.0
    assert loud(trainer) == []



class WideReluMLP(pl.LightningModule):
    """Six ReLU layers of width 1024, Adam at 1e-3 on the regression data: a healthy model whose gradient
    norm grows about 2x a step out of its initialisation for its first steps while its loss falls."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(1)
            layers: list[nn.Module] = [nn.Linear(8, 1024), nn.ReLU()]
            for _ in range(5):
                layers += [nn.Linear(1024, 1024), nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(1024, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(samples=512), batch_size=16, shuffle=True)


def test_a_norm_rising_out_of_its_initialisation_with_a_one_step_spike_is_not_exploding(tmp_path: Path) -> None:
    """The norm rises from 0.9 to 13 in 4 steps, spikes to 68 and 396 with a one-step loss blip, and is back at
    38 (3x where it was) the step after; the median of the first steps (3.4) is no level for it."""
    trainer = fit(tmp_path, WideReluMLP(), every_check_every_step(), 16)
    norms = [value for _, value in sorted(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"])]
    limit = jump_limit(norms[:5], 10, 6, 3)
    assert min(norms[5:8]) > limit > 3 * max(norms[:3]), f"3 steps over the limit the first steps set: {norms}"
    assert loud(trainer) == []

@pytest.mark.parametrize("model_class", [TinyAttentionClassifier, TinyBert])
def test_attention_key_bias_with_a_structurally_zero_gradient_is_not_vanishing(
        tmp_path: Path, model_class: type[pl.LightningModule]) -> None:
    trainer = fit(tmp_path, model_class(), every_check_every_step(log_gradients=True), 8)
    scalars = read_scalars(trainer.logger.log_dir)
    key_bias = [tag for tag in scalars if tag.startswith("debug/grad/norm/") and "key" in tag and "bias" in tag]
    assert key_bias and all(value < 1e-6 for tag in key_bias for _, value in scalars[tag]), \
        "the key bias gets a (near) zero gradient by construction: the plant is there"
    assert loud(trainer) == []


# --- exploding: judged against the run's own history, clipping named ---------------------------
def test_gradients_multiplied_by_100_are_exploding_at_that_step(tmp_path: Path) -> None:
    trainer = fit(tmp_path, DeepNormMLP(grad_scale_from=8), every_check_every_step(), 10)
    exploding = starts(trainer, "exploding_grad")
    assert [e["step"] for e in exploding] == [8]
    details = exploding[0]["details"]
    assert details["judged_by"] == "jump over recent norms"
    assert details["global_norm"] > 10 * details["recent_median"]
    assert "Clip the gradient norm at" in exploding[0]["message"]
    assert {kind for _, kind, _ in loud(trainer)} == {"exploding_grad"}


def test_gradient_spikes_that_fall_back_at_once_are_not_exploding(tmp_path: Path) -> None:
    """100x gradients on single steps (two of them in a row), the norm back to its level after: the shape
    of a healthy model's spikes (SwinV2, SwiftFormer). Quiet with every check every step, and with sparse
    checks where a spike lands on a check step (the steps after it are measured to judge it)."""
    trainer = fit(tmp_path / "every", DeepNormMLP(grad_spike_steps=(8, 9, 14)), every_check_every_step(), 20)
    norms = dict(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"])
    assert norms[8] > 10 * norms[7] and norms[14] > 10 * norms[13], "the spikes are there"
    assert loud(trainer) == []
    trainer = fit(tmp_path / "sparse", DeepNormMLP(grad_spike_steps=(12,)),
                  [AnomalyDetectionCallback(), GradientHealthCallback(gradient_checking_frequency=3)], 20)
    norms = dict(read_scalars(trainer.logger.log_dir)["debug/grad/global_norm"])
    assert norms[12] > 10 * norms[9], "the spike lands on a check step"
    assert loud(trainer) == []


def test_a_jump_on_a_sparse_check_step_is_confirmed_by_the_steps_after_it(tmp_path: Path) -> None:
    trainer = fit(tmp_path, DeepNormMLP(grad_scale_from=12),
                  [AnomalyDetectionCallback(), GradientHealthCallback(gradient_checking_frequency=3)], 15)
    exploding = starts(trainer, "exploding_grad")
    assert [e["step"] for e in exploding] == [12], "labelled where it began, confirmed by steps 13-14 (not checked)"
    assert exploding[0]["details"]["judged_by"] == "jump over recent norms"
    assert {kind for _, kind, _ in loud(trainer)} == {"exploding_grad"}


def test_exploding_with_clipping_configured_says_what_the_clip_did(tmp_path: Path) -> None:
    trainer = fit(tmp_path, DeepNormMLP(grad_scale_from=8),
                  [AnomalyDetectionCallback(), GradientHealthCallback(gradient_checking_frequency=1)], 10,
                  gradient_clip_val=1.0)
    exploding = starts(trainer, "exploding_grad")
    assert [e["step"] for e in exploding] == [8]
    event = exploding[0]
    details, message = event["details"], event["message"]
    assert details["clip_val"] == 1.0 and details["clip_algorithm"] == "norm"
    assert details["suggested_clip_val"] is None
    assert details["clip_factor"] == pytest.approx(details["global_norm"])
    assert details["global_norm"] > 100, "measured before Lightning clips (after on_before_optimizer_step)"
    assert "gradient_clip_val=1" in message and f"from {details['global_norm']:.4g} down to 1" in message
    assert "Clip the gradient norm at" not in message and "gradient_clip_val=10" not in message
    report = (debug_dir(trainer) / "report.md").read_text()
    assert "No clip value suggested: gradient clipping is already configured" in report


def test_explicit_threshold_is_applied_as_given(tmp_path: Path) -> None:
    trainer = fit(tmp_path, DeepNormMLP(),
                  [GradientHealthCallback(gradient_checking_frequency=1, gradient_explosion_threshold=5.0)], 4)
    exploding = starts(trainer, "exploding_grad")
    assert [e["step"] for e in exploding] == [0]
    assert exploding[0]["details"]["judged_by"] == "gradient_explosion_threshold"
    assert "> gradient_explosion_threshold 5" in exploding[0]["message"]


# --- vanishing: per layer ------------------------------------------------------------------------
def test_a_truly_dead_path_is_still_vanishing_with_advice_that_fits(tmp_path: Path) -> None:
    trainer = fit(tmp_path, MaskedPath(), [GradientHealthCallback(gradient_checking_frequency=1)], 6)
    vanishing = starts(trainer, "vanishing_grad")
    assert [e["step"] for e in vanishing] == [0]
    details, message = vanishing[0]["details"], vanishing[0]["message"]
    assert details["layers"] == ["inp", "hidden"] and details["dead_layers"] == ["inp", "hidden"]
    assert "exactly zero" in message and "sigmoid" not in message
    assert not any(name.startswith(("skip", "head")) for name in details["parameters"])


# --- early divergence ----------------------------------------------------------------------------
def test_adamw_at_lr_10_warns_within_the_first_steps_before_any_nan_at_the_defaults(tmp_path: Path) -> None:
    model = WideClassifier(lr=10.0)
    trainer = fit(tmp_path, model, [AnomalyDetectionCallback(), GradientHealthCallback()], 20)
    assert model.losses[0] < 8 and model.losses[1] > 100 * model.losses[0], "the plant: the loss blows up at step 1"
    findings = loud(trainer)
    assert findings, "a learning rate 10000x too high must not pass silently"
    step, kind, message = findings[0]
    assert (step, kind) == (1, "loss_spike")
    assert "learning rate 10" in message and "warm-up" in message
    assert all(math.isfinite(loss) for loss in model.losses[:step + 1])


def test_adamw_at_lr_10_has_a_high_update_ratio_at_step_0_where_ratios_are_measured(tmp_path: Path) -> None:
    trainer = fit(tmp_path, WideClassifier(lr=10.0), every_check_every_step(), 4)
    high = starts(trainer, "update_ratio_high")
    assert [e["step"] for e in high] == [0]
    ratios = high[0]["details"]["ratios"]
    assert set(ratios) == {"net.0", "net.2"} and min(ratios.values()) > 1.0
    assert high[0]["details"]["learning_rates"] == [10.0]


class ZeroInitialised(pl.LightningModule):
    """Healthy Adam training of a model with zero-initialised biases and a zero-initialised learned
    token, as transformers have: their first update ratio is infinite by construction."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.zeros(16))
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        for layer in (self.inp, self.head):
            nn.init.zeros_(layer.bias)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.relu(self.inp(x)) + self.token), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=32, shuffle=True)


def test_zero_initialised_parameters_are_not_update_ratio_high(tmp_path: Path) -> None:
    trainer = fit(tmp_path, ZeroInitialised(), every_check_every_step(), 6)
    ratios = read_scalars(trainer.logger.log_dir)["debug/weight/update_ratio/token"]
    assert max(value for _, value in ratios) > 0.5, "the plant: the token's first ratios are far above 1e-3"
    assert loud(trainer) == []


def test_a_steady_overshoot_is_loss_divergence(tmp_path: Path) -> None:
    model = SlowlyDiverging()
    trainer = fit(tmp_path, model, [AnomalyDetectionCallback()], 16)
    growth = [later / earlier for earlier, later in zip(model.losses[4:], model.losses[5:])]
    assert all(1.1 < factor < 10 for factor in growth), "the plant: a steady rise, no single jump"
    divergence = starts(trainer, "loss_divergence")
    assert [e["step"] for e in divergence] == [11], "the first rise above where the run started (9.9)"
    assert "rising steadily" in divergence[0]["message"] and "learning rate 0.11" in divergence[0]["message"]
    assert not starts(trainer, "loss_spike")
    assert all(math.isfinite(loss) for loss in model.losses)


# --- the arithmetic ------------------------------------------------------------------------------
def test_robust_levels_and_limits() -> None:
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert jump_limit([1.0, 1.0, 1.0, 50.0], 10, 6, 3) == 10.0, "one outlier does not move the level"
    history = NormHistory()
    for norm in (61.0, 58.0, 60.0):
        history.add(norm)
    assert history.limit() == 600.0
    history.add(math.nan)
    assert list(history.values) == [61.0, 58.0, 60.0]
    trend = LossJudge()
    assert [trend.judge(v).kind for v in (2.3, 0.5, 0.05, 0.01, 0.02, 0.3, 1.0)] == [None] * 7, \
        "a loss near 0 that comes back up toward where it started is no spike"
    negative = LossJudge()
    assert [negative.judge(v).kind for v in (-5.0, -1.0, 3.0, 40.0)] == [None] * 4


def test_accelerate_clip_grad_norm_is_observed_and_named(tmp_path: Path) -> None:
    """An Accelerate loop that clips with ``accelerator.clip_grad_norm_`` after ``debugger.backward``:
    the finding says what the clip did; ``finish()`` gives the accelerator its own method back."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from lightning_debug.accelerate import AccelerateDebugger

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        torch.manual_seed(0)
        accelerator = accelerate.Accelerator(cpu=True, project_dir=str(tmp_path))
        model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = DataLoader(regression_data(), batch_size=16, shuffle=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        debugger = AccelerateDebugger(accelerator, model, optimizer, gradient_checking_frequency=1)
        with debugger:
            for x, y in loader:
                out = model(x)
                if debugger.step >= 8:
                    out.register_hook(lambda grad: grad * 1000.0)
                debugger.backward(nn.functional.mse_loss(out, y))
                accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
                if debugger.step >= 10:
                    break
        assert "clip_grad_norm_" not in accelerator.__dict__
        events = [e for e in read_events(debugger.run.context.output_dir) if e["kind"] == "exploding_grad"
                  and e.get("episode") == "start"]
        assert [e["step"] for e in events] == [8]
        details = events[0]["details"]
        assert details["clip_val"] == 1.0 and details["clip_algorithm"] == "norm"
        assert details["suggested_clip_val"] is None and "gradient_clip_val=1, by norm" in events[0]["message"]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
