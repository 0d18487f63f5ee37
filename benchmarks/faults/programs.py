"""One configurable Lightning program: an MLP on synthetic data whose bugs are planted by a :class:`Program`.

Every case of the benchmark is a :class:`Program` (the buggy one) and another (its fixed twin), built by
:func:`build`. The model is deliberately plain: ``layers.N`` (Linear), ``acts.N`` (the activation modules,
so per-module findings can name them), ``head`` and an optional ``out_act``; what makes it buggy is only
what a user would write differently (an activation, an initialisation, a learning rate, a loss, a line of
the training step).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset


STEPS = 400
"""Optimizer steps of every program: long enough that the default schedule (gradient checks every 100 steps)
looks at steps 0, 100, 200 and 300, as it would in any real run of a few hundred steps or more (and that
300 is before 90% of the run, where a learning rate of 0 stops being a schedule's end)."""


@dataclasses.dataclass(frozen=True)
class Program:
    """What a user wrote. Defaults are a healthy 4-class MLP trained with SGD.

    ``fault`` names a numerical bug of DeepLocalize/DeepDiagnosis planted from ``fault_step`` on
    (``log_zero``, ``div_zero``, ``sqrt_neg``, ``exp_overflow``, ``nan_input``, ``const_feature``);
    ``fixed`` True is the twin's guarded version of the same operation (an epsilon, a clamp, the stable
    form). ``silent`` names a TrainCheck-style silent error (see :mod:`benchmarks.faults.silent`), ``resource``
    a memory or performance bug (see :mod:`benchmarks.faults.resources`).
    """

    task: str = "classify"            # classify | regress
    features: int = 16
    classes: int = 4
    width: int = 32
    depth: int = 3
    act: str = "relu"                 # relu | sigmoid | tanh | leaky
    out_act: str | None = None        # relu | sigmoid | tanh | softmax applied to the logits
    out_fn: str | None = None         # sigmoid | softmax | relu written in forward (torch.sigmoid, ...), no module
    init: str = "default"             # default | small | large | kaiming | xavier | neg_bias | constant
    bias_value: float = 0.0
    batchnorm: bool = False
    optimizer: str = "sgd"            # sgd | adam
    lr: float = 0.05
    momentum: float = 0.0
    input_scale: float = 1.0
    target_scale: float = 1.0
    shuffle_labels: bool = False
    majority: float = 0.0             # this share of the labels class 0 (the rest drawn as before, 0 read as 1)
    loss: str = "ce"                  # ce | mse | bce_raw | bce_logits | nll_raw | neg_ce | ce_sum | ce_quarter
    #                                   | bce_logits_pos_weight, ce_smooth (with criterion)
    criterion: bool = False           # the loss as a module attribute (self.criterion = nn.CrossEntropyLoss())
    fault: str | None = None
    fault_step: int = 5
    fixed: bool = False
    silent: str | None = None
    resource: str | None = None       # a memory or performance bug (see benchmarks.faults.resources)
    period: int = 0                   # its period in steps, where it recurs
    stall_ms: float = 0.0             # its blocking time (per sample in a loader, per recurrence in a step)
    steps: int = STEPS
    epochs: int | None = None         # a bound on epochs too: a program whose optimizer steps may never be counted
    batch: int = 32
    samples: int = 512
    seed: int = 0
    val: bool = False
    gradient_clip: float | None = None  # Trainer(gradient_clip_val=...) of the buggy program; its twin clips at 1.0


def data(program: Program) -> Dataset:
    """Gaussian blobs (classify) or a linear target (regress), pre-shuffled and fixed by the seed; the
    data bugs (scale, shuffled labels, a NaN sample, a constant feature normalised) are planted here."""
    g = torch.Generator().manual_seed(program.seed)
    n, d = program.samples, program.features
    if program.task == "classify":
        centres = 2.0 * torch.randn(program.classes, d, generator=g)
        labels = torch.randint(0, program.classes, (n,), generator=g)
        if program.majority:
            labels = torch.where(torch.rand(n, generator=g) < program.majority, 0, labels.clamp_min(1))
        inputs = centres[labels] + torch.randn(n, d, generator=g)
        if program.shuffle_labels:
            labels = labels[torch.randperm(n, generator=g)]
        targets: torch.Tensor = labels
    else:
        inputs = torch.randn(n, d, generator=g)
        targets = torch.tanh(inputs @ torch.randn(d, 1, generator=g) / math.sqrt(d)) * program.target_scale
    inputs = inputs * program.input_scale
    if program.fault in ("log_zero", "sqrt_neg"):
        inputs = inputs.abs() + 0.5       # a positive feature the model takes the log/sqrt of
    sample = program.fault_step * program.batch + 3
    if program.fault == "nan_input" and not program.fixed:
        inputs[sample, 2] = float("nan")  # a missing value in one record
    if program.fault == "const_feature":
        inputs[:, 5] = 1.0                # a feature constant in the whole data set, standardised below
        std = inputs.std(0)
        inputs = (inputs - inputs.mean(0)) / (std + 1e-8 if program.fixed else std)
    return TensorDataset(inputs, targets)


CRITERIA = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss, "bce_raw": nn.BCELoss, "bce_logits": nn.BCEWithLogitsLoss,
            "nll_raw": nn.NLLLoss,  # pos_weight: negatives over positives of one-hot labels of 4 classes (the docs')
            "bce_logits_pos_weight": lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor(3.0)),
            "ce_smooth": lambda: nn.CrossEntropyLoss(label_smoothing=0.1)}
FUNCTIONS = {"sigmoid": torch.sigmoid, "softmax": lambda z: F.softmax(z, dim=-1), "relu": F.relu}
ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "leaky": lambda: nn.LeakyReLU(0.1),
               "softmax": lambda: nn.Softmax(dim=-1)}


class FaultProgram(pl.LightningModule):
    """The program a :class:`Program` describes."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = p = program
        sizes = [p.features] + [p.width] * p.depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norms = nn.ModuleList(nn.BatchNorm1d(b) for b in sizes[1:]) if p.batchnorm else None
        self.acts = nn.ModuleList(ACTIVATIONS[p.act]() for _ in sizes[1:])
        self.head = nn.Linear(p.width, p.classes if p.task == "classify" else 1)
        self.out_act = ACTIVATIONS[p.out_act]() if p.out_act else None
        self.criterion = CRITERIA[p.loss]() if p.criterion else None
        self._initialise()

    def _initialise(self) -> None:
        p = self.program
        torch.manual_seed(p.seed)
        for layer in self.layers:
            if p.init == "small":
                nn.init.normal_(layer.weight, std=0.01)
            elif p.init == "large":
                nn.init.normal_(layer.weight, std=1.5)
            elif p.init == "kaiming":
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            elif p.init == "xavier":
                nn.init.xavier_normal_(layer.weight)
            elif p.init == "constant":                 # every unit alike: symmetry never broken
                nn.init.constant_(layer.weight, 0.1)
                nn.init.zeros_(layer.bias)
            if p.init == "neg_bias" or p.bias_value:
                nn.init.constant_(layer.bias, p.bias_value)

    # --- the numerical bugs of DeepLocalize / DeepDiagnosis --------------------------------------------
    def _planted_now(self) -> bool:
        return self.training and self.trainer.global_step == self.program.fault_step

    def _prepare_inputs(self, x: torch.Tensor) -> torch.Tensor:
        p = self.program
        if p.fault == "log_zero":
            if self._planted_now():
                x = x.clone()
                x[3, 0] = 0.0                       # a count that is 0 in one record
            return torch.log(x + 1e-6) if p.fixed else torch.log(x)
        if p.fault == "sqrt_neg":
            if self._planted_now():
                x = x.clone()
                x[3, 0] = -0.5                      # a reading below the offset it was shifted by
            return torch.sqrt(x.clamp_min(1e-6)) if p.fixed else torch.sqrt(x)
        if p.fault == "div_zero":
            if self._planted_now():
                x = x.clone()
                x[:, 1] = 0.7                       # a batch in which feature 1 does not vary
            std = x.std(0, keepdim=True)
            return (x - x.mean(0, keepdim=True)) / (std + 1e-5 if p.fixed else std)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._prepare_inputs(x)
        for index, layer in enumerate(self.layers):
            h = layer(h)
            if self.norms is not None:
                h = self.norms[index](h)
            h = self.acts[index](h)
        z = self.head(h)
        if self.program.fault == "exp_overflow" and self._planted_now():
            z = z + 100.0 * torch.arange(z.shape[-1], dtype=z.dtype)   # one confident batch: logits near 300
        if self.program.out_fn is not None:
            return FUNCTIONS[self.program.out_fn](z)
        return self.out_act(z) if self.out_act is not None else z

    def loss_of(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.program
        if p.task == "regress":
            return F.mse_loss(z, y)
        if p.fault == "exp_overflow":             # a hand-written softmax cross-entropy
            if p.fixed:
                return F.cross_entropy(z, y)
            e = torch.exp(z)
            return -torch.log(e.gather(1, y[:, None]) / e.sum(1, keepdim=True)).mean()
        if self.criterion is not None:
            return self.criterion(z, y if p.loss in ("ce", "ce_smooth", "nll_raw") else F.one_hot(y, p.classes).float())
        if p.loss == "bce_raw":
            return F.binary_cross_entropy(z, F.one_hot(y, p.classes).float())
        if p.loss == "bce_logits":
            return F.binary_cross_entropy_with_logits(z, F.one_hot(y, p.classes).float())
        if p.loss == "nll_raw":
            return F.nll_loss(z, y)
        if p.loss == "mse":
            return F.mse_loss(z, F.one_hot(y, p.classes).float())
        if p.loss == "neg_ce":
            return -F.cross_entropy(z, y)
        if p.loss == "ce_sum":
            return F.cross_entropy(z, y, reduction="sum")
        if p.loss == "ce_quarter":                 # accumulation over 4 micro-batches written by hand
            return F.cross_entropy(z, y) / 4
        return F.cross_entropy(z, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_of(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_of(self(x), y))

    def configure_optimizers(self) -> Any:
        p = self.program
        params = self.parameters()
        if p.optimizer == "adam":
            return torch.optim.Adam(params, lr=p.lr)
        return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(self.program), batch_size=self.program.batch, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(dataclasses.replace(self.program, seed=self.program.seed + 1, samples=128,
                                                   fault=None)), batch_size=64)


def build(program: Program) -> pl.LightningModule:
    """The Lightning module of ``program`` (a TrainCheck silent error or a resource bug gets its own subclass)."""
    if program.resource is not None:
        from benchmarks.faults.resources import build_resource

        return build_resource(program)
    if program.silent is not None:
        from benchmarks.faults.silent import build_silent

        return build_silent(program)
    return FaultProgram(program)

