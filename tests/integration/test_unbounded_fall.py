"""A loss that falls without bound (``nll_loss`` on raw logits: AutoTrainer's "loss issue") is ``loss_divergence``
by the anomaly callback alone, and negative losses that converge stay quiet: a negative cosine similarity (from a
random start and from a zero-initialised head) and a Gaussian negative log-likelihood with a learned variance on
noiseless targets, which falls below zero for hundreds of steps. Real Trainer runs on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import AnomalyDetectionCallback, debug_callbacks
from tests.harness.toolkit import TinyRegressor, debug_dir, fit_seeded as fit, read_events

pytestmark = pytest.mark.timeout(180)

LOUD = {"warning", "error", "critical"}


class Regression(pl.LightningModule):
    """An MLP on 16 features, Adam (``sgd``: plain SGD); ``loss`` chooses the objective:

    - ``nll_raw``: 4-class ``nll_loss`` on the raw logits (the bug: -logit of the target, unbounded below);
    - ``bce_pm1``: ``binary_cross_entropy_with_logits`` against one-hot targets written as -1/+1 (unbounded below);
    - ``cosine``: the negative cosine similarity between the output and a linear target (bounded by -1);
    - ``gaussian``: the Gaussian negative log-likelihood of noiseless linear targets with a learned log-variance
      (it falls below 0 as the variance shrinks, about a nat per 2.7x less variance).
    ``zero_head`` initialises the last layer at 0 (the first loss is exactly 0).
    """

    def __init__(self, loss: str, zero_head: bool = False, lr: float = 1e-3, sgd: bool = False) -> None:
        super().__init__()
        outputs = {"nll_raw": 4, "cosine": 8, "gaussian": 2, "bce_pm1": 4}[loss]
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs))
            self.mixing = torch.randn(16, 8)
        if zero_head:
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)
        self.loss_name, self.lr, self.sgd = loss, lr, sgd
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        if self.loss_name == "nll_raw":
            loss = F.nll_loss(out, y)
        elif self.loss_name == "bce_pm1":
            loss = F.binary_cross_entropy_with_logits(out, 2 * F.one_hot(y, 4).float() - 1)
        elif self.loss_name == "cosine":
            loss = -F.cosine_similarity(out, x @ self.mixing, dim=1).mean()
        else:
            target = x[:, :4].sum(dim=1)
            mean, log_var = out[:, 0], out[:, 1]
            loss = 0.5 * (log_var + (target - mean) ** 2 / log_var.exp()).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(512, 16, generator=generator)
        labels = torch.randint(0, 4, (512,), generator=generator)
        return DataLoader(TensorDataset(inputs, labels), batch_size=32, shuffle=True)


def loud(trainer: pl.Trainer) -> list[dict[str, Any]]:
    return [e for e in read_events(debug_dir(trainer)) if e["severity"] in LOUD and e.get("episode") != "end"]


def test_nll_loss_on_raw_logits_falls_without_bound_and_the_anomaly_callback_alone_names_it(tmp_path: Path) -> None:
    model = Regression("nll_raw")
    trainer = fit(tmp_path, model, [AnomalyDetectionCallback()], 240)
    losses = model.losses
    assert abs(losses[0]) < 1 and losses[-1] < -1000 * max(abs(v) for v in losses[:5]), "the plant: an unbounded fall"
    falls = [e for e in loud(trainer) if e["kind"] == "loss_divergence"]
    assert falls, [(e["step"], e["kind"]) for e in loud(trainer)]
    first = falls[0]
    assert first["details"]["judged_by"] == "unbounded_fall"
    assert 64 <= first["step"] < 240 and first["details"]["recent_level"] < 0
    assert "falls without bound" in first["message"] and "log_softmax" in first["message"]
    report = (debug_dir(trainer) / "report.md").read_text()
    assert "No problems found" not in report and "loss_divergence" in report


@pytest.mark.parametrize("loss,zero_head", [("cosine", False), ("cosine", True), ("gaussian", False)])
def test_a_negative_loss_that_converges_is_quiet(tmp_path: Path, loss: str, zero_head: bool) -> None:
    model = Regression(loss, zero_head=zero_head, lr=3e-3)
    trainer = fit(tmp_path, model, debug_callbacks(), 300)
    losses = model.losses
    assert min(losses[-20:]) < 0 and min(losses) < losses[0] - 0.5, "the twin: a loss that falls below zero"
    assert [(e["step"], e["kind"]) for e in loud(trainer)] == []


def test_under_accelerate_the_same_fall_is_named(tmp_path: Path) -> None:
    """The rule is the framework-free loss judge's: the Accelerate adapter's loop names the same fall."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from lightning_debug import DebugConfig
    from lightning_debug.accelerate import AccelerateDebugger
    from tests.harness.toolkit import fresh_accelerate, run_dir

    with fresh_accelerate():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
        model = Regression("nll_raw")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        loader = model.train_dataloader()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        steps = 240
        debugger = AccelerateDebugger(accelerator, model, optimizer,
                                      DebugConfig(save_plots=False, print_summary=False), train_dataloader=loader,
                                      total_steps=steps)
        with debugger:
            while debugger.step < steps:
                for x, y in loader:
                    debugger.backward(F.nll_loss(model.net(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    if debugger.step >= steps:
                        break
    events = read_events(run_dir(tmp_path / "debug_outputs"))
    falls = [e for e in events if e["kind"] == "loss_divergence" and e.get("episode") in (None, "start")]
    assert falls and falls[0]["details"]["judged_by"] == "unbounded_fall", [(e["step"], e["kind"]) for e in events]
    assert 64 <= falls[0]["step"] < steps


def test_a_loss_that_falls_without_bound_into_an_overflow_is_named_as_the_cause_of_the_nan(tmp_path: Path) -> None:
    model = Regression("bce_pm1", lr=0.05, sgd=True)
    trainer = fit(tmp_path, model, debug_callbacks(), 200)
    finite = [v for v in model.losses if v == v and abs(v) != float("inf")]
    assert len(finite) < len(model.losses) and finite[-1] < -1000, "the plant: a fall that ends in an overflow"
    nan = {e["kind"]: e for e in loud(trainer) if e["kind"] in ("nonfinite_activation", "nonfinite_loss")}
    assert set(nan) == {"nonfinite_activation", "nonfinite_loss"}, sorted((e["step"], e["kind"]) for e in loud(trainer))
    for event in nan.values():
        assert event["details"]["loss_fell_to"] < -1000 and "no lower bound" in event["message"]
        assert "targets in [0, 1]" in event["message"]


def test_a_nan_from_a_log_of_zero_is_not_blamed_on_the_loss_falling(tmp_path: Path) -> None:
    trainer = fit(tmp_path, TinyRegressor(log_zero_from_step=30), debug_callbacks(), 40)
    nan = [e for e in loud(trainer) if e["kind"] == "nonfinite_loss"]
    assert nan and all("loss_fell_to" not in e["details"] and "no lower bound" not in e["message"] for e in nan)

