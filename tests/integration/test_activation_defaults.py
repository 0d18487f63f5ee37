"""Issue 45: the activation and fade classes named at the default level (``log_activations`` off), each beside its fixed
twin, through a real Trainer: a steady fade of gradients through eight sigmoid layers (``vanishing_grad``), a ReLU on
the output logits (``dead_activation``), a tanh on a regression output whose targets it cannot reach
(``saturated_activation``) and a softmax on the output that ``cross_entropy`` softmaxes again (``learning_stalled``,
``probabilities_into_log_softmax``), and a loss normalised over the batch (``learning_stalled``,
``softmax_over_batch``), beside a contrastive loss over the batch, and an (N,) target broadcast against an (N, 1)
output (``learning_stalled``, ``shared_target``) beside a least-squares GAN's constant targets, and a sigmoid on the
output that ``binary_cross_entropy_with_logits`` applies again (``learning_stalled``, ``probabilities_into_sigmoid``)
beside the logits and the sigmoid with the losses made for them; training data sorted by label and not shuffled
(``single_class_batches``) beside the same data shuffled and unbalanced labels; the same output rules with the loss
as a module (``self.criterion``, a leaf the hooks see, called after the output), with a head the hooks do not see
(``h @ weight.T``: the last call is a hidden layer's) and with the output written in ``forward`` (``F.softmax``). The
``debug/activation/*`` scalars stay behind ``log_activations``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import DebugConfig, GradientHealthCallback, PerformanceProfilerCallback
from tests.harness.toolkit import debug_dir, fit_seeded, read_events, read_scalars

WARNING_OR_ABOVE = ("warning", "error", "critical")


POS_WEIGHT = (3.0, 1.5, 4.0, 2.0)
"""One weight per class, as imbalanced multi-label data is trained: ``BCEWithLogitsLoss(pos_weight=...)``."""
CRITERIA = {"ce": nn.CrossEntropyLoss, "ce_per_sample": lambda: nn.CrossEntropyLoss(reduction="none"),
            "ce_smooth": lambda: nn.CrossEntropyLoss(label_smoothing=0.1),
            "bce_logits": nn.BCEWithLogitsLoss, "bce": nn.BCELoss, "mse_one_hot": nn.MSELoss,
            "bce_logits_pos_weight": lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor(POS_WEIGHT)),
            "bce_weight": lambda: nn.BCELoss(weight=torch.tensor(POS_WEIGHT))}


FUNCTIONAL = {"softmax": lambda z: F.softmax(z, dim=1), "sigmoid": torch.sigmoid, "relu": F.relu,
              "softplus": F.softplus, "log_softmax": lambda z: F.log_softmax(z, dim=1)}


class Net(pl.LightningModule):
    """An MLP: ``layers.N`` and ``acts.N``, a ``head`` and an optional ``out_act`` on the output."""

    def __init__(self, act: type[nn.Module] = nn.ReLU, depth: int = 3, out_act: nn.Module | None = None,
                 regress: bool = False, target_scale: float = 1.0, optimizer: str = "sgd", lr: float = 0.05,
                 kaiming: bool = False, loss: str = "ce", wrong_labels: int = 0, order: str = "random",
                 module_loss: bool = False, metric: bool = False, functional_out: str | None = None,
                 squeeze: bool = False, samples: int = 512, warmup: int = 0) -> None:
        super().__init__()
        self.warmup = warmup  # optimizer steps of a linear warm-up from 0, stepped per step
        sizes = [16] + [32] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.acts = nn.ModuleList(act() for _ in sizes[1:])
        self.head = nn.Linear(32, 1 if regress else 4)
        self.out_act = out_act
        self.regress, self.target_scale, self.optimizer_name, self.lr = regress, target_scale, optimizer, lr
        self.loss = loss  # ce | nll_log (nll_loss of the log of a softmax output) | mse_one_hot | batch_softmax
        # | ce_sum | nll_log_sum (reduction="sum") | ce_smooth (label_smoothing=0.1)
        # | bce_logits | bce (binary cross-entropy of one-hot labels, on logits or on probabilities);
        # regress: mse | broadcast (an (N,) target against the (N, 1) output) | least_squares_gan
        self.wrong_labels = wrong_labels  # this many samples from the start have labels shuffled against inputs
        self.order = order  # random | sorted (by label, not shuffled) | shuffled (sorted, then shuffle=True)
        # | unbalanced (99.5% of the labels 0, shuffled) | majority (half the labels 0)
        self.functional_out = functional_out  # softmax | sigmoid | log_softmax, written in forward after the head
        self.squeeze = squeeze  # forward returns a regression's (N, 1) output as (N,), a view of it
        self.samples = samples  # of a regression's data, and of the sorted data (a quarter per class)
        self.criterion = CRITERIA[loss]() if module_loss else None  # the loss as a module: a leaf the hooks see
        self.metric = (torchmetrics.classification.MulticlassAccuracy(num_classes=4, average=None) if metric
                       else None)  # per-class accuracy, called on the output before the loss: a leaf too
        if kaiming:
            for layer in self.layers:
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts):
            x = act(layer(x))
        z = self.head(x)
        if self.functional_out is not None:
            return FUNCTIONAL[self.functional_out](z)
        z = self.out_act(z) if self.out_act is not None else z
        return z.squeeze(-1) if self.squeeze else z

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self(x)
        if self.metric is not None:
            self.metric(z, y)
        if self.criterion is not None:
            return self.criterion(z, y if self.loss.startswith("ce") else F.one_hot(y, 4).float()).mean()
        if self.regress and self.loss == "broadcast":
            return F.mse_loss(z, y.squeeze(-1))
        if self.regress and self.loss == "least_squares_gan":
            fake = self(torch.randn_like(x))  # the discriminator's last call: scored against 0 every step
            return F.mse_loss(z, torch.ones_like(z)) + F.mse_loss(fake, torch.zeros_like(fake))
        if self.regress:
            return F.mse_loss(z, y.squeeze(-1) if self.squeeze else y)
        if self.loss == "nll":
            return F.nll_loss(z, y)
        if self.loss == "nll_log":
            return F.nll_loss(torch.log(z), y)
        if self.loss == "ce_sum":
            return F.cross_entropy(z, y, reduction="sum")
        if self.loss == "ce_smooth":
            return F.cross_entropy(z, y, label_smoothing=0.1)
        if self.loss == "nll_log_sum":
            return F.nll_loss(torch.log(z), y, reduction="sum")
        if self.loss == "mse_one_hot":
            return F.mse_loss(z, F.one_hot(y, 4).float())
        if self.loss == "batch_softmax":
            return F.nll_loss(F.log_softmax(z, dim=0), y)
        if self.loss == "bce_logits":
            return F.binary_cross_entropy_with_logits(z, F.one_hot(y, 4).float())
        if self.loss == "bce":
            return F.binary_cross_entropy(z, F.one_hot(y, 4).float())
        return F.cross_entropy(z, y)

    def configure_optimizers(self) -> Any:
        optimizer = (torch.optim.Adam(self.parameters(), lr=self.lr) if self.optimizer_name == "adam"
                     else torch.optim.SGD(self.parameters(), lr=self.lr))
        if not self.warmup:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / self.warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        if self.regress:
            x = torch.randn(self.samples, 16, generator=g)
            y = torch.tanh(x @ torch.randn(16, 1, generator=g) / 4) * self.target_scale
        else:
            n = max(512, self.wrong_labels, 32 * (self.trainer.max_steps if self._trainer is not None else 0))
            labels = torch.randint(0, 4, (n,), generator=g)
            if self.order == "majority":  # half the labels 0, a quarter 1, an eighth 2 and 3
                labels = torch.where(torch.rand(n, generator=g) < 0.5, 0, labels.clamp_min(1))
            x = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(n, 16, generator=g)
            y = labels.clone()
            wrong = min(self.wrong_labels, n)
            y[:wrong] = labels[:wrong][torch.randperm(wrong, generator=g)]
            if self.order in ("sorted", "shuffled"):  # a quarter of the samples of each class, in label order
                y = torch.arange(4).repeat_interleave(self.samples // 4)
                x = 2.0 * torch.randn(4, 16, generator=g)[y] + torch.randn(len(y), 16, generator=g)
            elif self.order == "unbalanced":
                y = (torch.rand(n, generator=g) < 0.005).long() * torch.randint(1, 4, (n,), generator=g)
                x = 2.0 * torch.randn(4, 16, generator=g)[y] + torch.randn(n, 16, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=self.order in ("shuffled", "unbalanced"))


def fit(tmp_path: Path, model: pl.LightningModule, steps: int, every: int,
        **trainer_options: Any) -> tuple[list[dict[str, Any]], Path]:
    config = DebugConfig(gradient_checking_frequency=every, print_summary=False, save_plots=False)
    trainer = fit_seeded(tmp_path, model, [GradientHealthCallback(config)], max_steps=steps, **trainer_options)
    return read_events(debug_dir(trainer)), Path(trainer.log_dir)


def warnings_of(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in events if e.get("severity") in WARNING_OR_ABOVE]


def test_a_steady_fade_through_eight_sigmoid_layers_is_vanishing_grad_and_its_relu_twin_is_quiet(
        tmp_path: Path) -> None:
    events, _ = fit(tmp_path / "buggy", Net(act=nn.Sigmoid, depth=8), steps=11, every=5)
    fades = [e for e in events if e["kind"] == "vanishing_grad"]
    assert fades and fades[0]["step"] == 0, warnings_of(events)
    assert fades[0]["details"]["rule"] == "fade" and fades[0]["details"]["ratio"] < 1e-3
    assert fades[0]["details"]["first_layer"].startswith("layers.")
    twin, _ = fit(tmp_path / "twin", Net(act=nn.ReLU, depth=8, kaiming=True), steps=11, every=5)
    assert warnings_of(twin) == []


def test_a_relu_on_the_output_logits_is_dead_activation_at_the_defaults_without_activation_scalars(
        tmp_path: Path) -> None:
    events, log_dir = fit(tmp_path / "buggy", Net(out_act=nn.ReLU(), optimizer="adam", lr=1e-3), steps=101, every=20)
    dead = [e for e in events if e["kind"] == "dead_activation"]
    assert dead and dead[0]["details"]["modules"] == ["out_act"] and dead[0]["details"]["output"], warnings_of(events)
    assert not [tag for tag in read_scalars(log_dir) if tag.startswith("debug/activation/")]
    twin, _ = fit(tmp_path / "twin", Net(optimizer="adam", lr=1e-3), steps=101, every=20)
    assert warnings_of(twin) == []


class FunctionalHead(Net):
    """The head applied as ``x @ head.weight.T + head.bias`` (a weight-tied head's form), in ``forward`` or in
    ``training_step`` after it (``in_step``): the module ``head`` never runs, so the last layer the hooks see is the
    hidden ReLU ``acts.2``, one of whose 32 units is dead (bias -50). In ``forward``, the model's output is what
    ``forward`` returns; in ``training_step``, the loss's graph shows a weight between ``acts.2`` and the loss, so no
    call gives the output."""

    def __init__(self, in_step: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.in_step = in_step
        with torch.no_grad():
            self.layers[-1].bias[0] = -50.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act in zip(self.layers, self.acts):
            x = act(layer(x))
        return x if self.in_step else self.head_of(x)

    def head_of(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ self.head.weight.T + self.head.bias
        return self.out_act(z) if self.out_act is not None else z

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        z = self.head_of(self(x)) if self.in_step else self(x)
        return F.cross_entropy(z, y)


@pytest.mark.parametrize("in_step", [False, True], ids=["in_forward", "in_training_step"])
def test_a_hidden_relu_before_a_head_the_hooks_do_not_see_is_not_the_models_output(tmp_path: Path,
                                                                                   in_step: bool) -> None:
    """One dead unit of 32 in a hidden layer is no finding; taking the hidden ReLU for the output (the last call the
    hooks saw) named it "a ReLU on the output". The twin puts a ReLU module on that head's output: still named."""
    events, _ = fit(tmp_path / "healthy", FunctionalHead(in_step, optimizer="adam", lr=1e-3), steps=101, every=20)
    assert warnings_of(events) == []
    events, _ = fit(tmp_path / "buggy", FunctionalHead(in_step, out_act=nn.ReLU(), optimizer="adam", lr=1e-3),
                    steps=101, every=20)
    dead = [e for e in events if e["kind"] == "dead_activation"]
    assert dead and dead[0]["details"]["modules"] == ["out_act"] and dead[0]["details"]["output"], warnings_of(events)


@pytest.mark.parametrize("squeeze", [False, True], ids=["n_by_1", "squeezed"])
@pytest.mark.parametrize("scale", [20.0])
def test_a_tanh_on_a_regression_output_beyond_its_range_is_saturated_activation(tmp_path: Path, scale: float,
                                                                                squeeze: bool) -> None:
    """``squeezed``: ``forward`` returns the tanh's output as ``(N,)``, a view of the same values: the tanh is still
    the model's output."""
    buggy = Net(out_act=nn.Tanh(), regress=True, target_scale=scale, optimizer="adam", lr=1e-2, squeeze=squeeze)
    events, _ = fit(tmp_path / "buggy", buggy, steps=201, every=20)  # measured at 0, 100, 200: held 2 checks
    saturated = [e for e in events if e["kind"] == "saturated_activation"]
    assert saturated and saturated[0]["details"]["modules"] == ["out_act"], warnings_of(events)
    assert saturated[0]["details"]["loss"] >= 0.25 * saturated[0]["details"]["first_loss"]
    twin = Net(regress=True, target_scale=scale, optimizer="adam", lr=1e-2, squeeze=squeeze)
    assert warnings_of(fit(tmp_path / "twin", twin, steps=201, every=20)[0]) == []


def test_a_softmax_output_fed_to_cross_entropy_is_learning_stalled_at_its_floor(tmp_path: Path) -> None:
    buggy = Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3)
    events, _ = fit(tmp_path / "buggy", buggy, steps=201, every=20)  # measured at 0, 100, 200: held 2 checks
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["out_act"] and details["classes"] == 4 and details["since_step"] == 0
    assert details["floor"] <= details["loss"] < details["floor"] + 0.2 and "loss_scale" not in details
    assert "nll_loss(torch.log(p))" in stalled[0]["message"]


@pytest.mark.parametrize(("functional", "module"), [(False, "out_act"), (True, "model")])
def test_a_sigmoid_output_fed_to_cross_entropy_is_learning_stalled_at_its_floor(tmp_path: Path, functional: bool,
                                                                                 module: str) -> None:
    """``cross_entropy(torch.sigmoid(z), y)``: logits bounded to [0, 1] cannot go below log(1 + 3/e) = 0.744 for 4
    classes (the loss went from 1.39 to 0.744 in 400 Adam steps, the twin's to 4e-4, and the run ended in "No
    problems found"). Rows that do not sum to 1 are judged on the output's gradient, only on an output no affine map
    made: the twins (logits, and a sigmoid into binary_cross_entropy) are quiet in
    test_logits_into_bce_with_logits_and_a_sigmoid_into_bce_or_mse_are_quiet."""
    buggy = (Net(functional_out="sigmoid", optimizer="adam", lr=1e-3) if functional
             else Net(out_act=nn.Sigmoid(), optimizer="adam", lr=1e-3))
    events, _ = fit(tmp_path / "buggy", buggy, steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == [module] and details["summing_to_1"] is False
    assert details["floor"] == pytest.approx(0.7437, abs=1e-4) and "drop the sigmoid" in stalled[0]["message"]
    assert warnings_of(fit(tmp_path / "twin", Net(optimizer="adam", lr=1e-3), steps=201, every=20)[0]) == []


@pytest.mark.parametrize("twin", ["smoothing_on_logits", "nll_log"])
def test_a_softmax_output_fed_to_cross_entropy_with_label_smoothing_is_named_with_the_smoothing(tmp_path: Path,
                                                                                              twin: str) -> None:
    """``nn.CrossEntropyLoss(label_smoothing=0.1)`` after an ``nn.Softmax``: the loss sits above cross_entropy of the
    rows as logits (0.82 against 0.74 at the floor), which printed "No problems found"; read with the output
    gradient's labels it is that loss smoothed by 0.1. The twins: the same loss on logits, and the softmax with
    ``nll_loss(torch.log(p))`` (its rows never have cross_entropy's gradient)."""
    buggy = Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3, loss="ce_smooth", module_loss=True)
    events, _ = fit(tmp_path / "buggy", buggy, steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["out_act"] and details["since_step"] == 0
    assert details["label_smoothing"] == pytest.approx(0.1, abs=1e-3)
    assert details["floor"] <= details["loss"] < details["floor"] + 0.2
    assert "label_smoothing=0.1" in stalled[0]["message"]
    model = (Net(optimizer="adam", lr=1e-3, loss="ce_smooth", module_loss=True) if twin == "smoothing_on_logits"
             else Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3, loss="nll_log"))
    assert warnings_of(fit(tmp_path / "twin", model, steps=201, every=20)[0]) == []


@pytest.mark.parametrize("twin", ["sum_on_logits", "nll_log_sum"])
def test_a_softmax_output_fed_to_cross_entropy_summed_over_the_batch_is_named_with_its_factor(tmp_path: Path,
                                                                                           twin: str) -> None:
    """``cross_entropy(p, y, reduction="sum")`` after an ``nn.Softmax``: the loss is 32 times the mean's, far above
    its floor, which printed "No problems found"; the output's gradient reads the factor. The twins: the same loss
    on logits, and the softmax with ``nll_loss(torch.log(p), reduction="sum")``."""
    events, _ = fit(tmp_path / "buggy", Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3, loss="ce_sum"),
                    steps=101, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["loss_scale"] == pytest.approx(32, rel=1e-3) and details["since_step"] == 0
    assert details["floor"] <= details["loss"] and "32 times what cross_entropy gives" in stalled[0]["message"]
    model = (Net(optimizer="adam", lr=1e-3, loss="ce_sum") if twin == "sum_on_logits"
             else Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3, loss="nll_log_sum"))
    assert warnings_of(fit(tmp_path / "twin", model, steps=201, every=20)[0]) == []


@pytest.mark.parametrize("buggy", [True, False], ids=["softmax_output", "logits"])
def test_under_gradient_accumulation_the_loss_is_judged_as_the_step_computed_it(tmp_path: Path, buggy: bool) -> None:
    """``accumulate_grad_batches=4``: Lightning hands ``on_before_backward`` the loss divided by 4, under the
    softmax's floor, which cleared the run ("No problems found"); multiplied back, the softmax before cross_entropy
    is named as without accumulation, at the loss the user logs, and the accumulation is no factor of the loss (the
    output's gradient is read against the quotient). The twin: the same run on logits."""
    model = Net(out_act=nn.Softmax(dim=-1) if buggy else None, optimizer="adam", lr=1e-3)
    events, _ = fit(tmp_path, model, steps=201, every=20, accumulate_grad_batches=4)
    if not buggy:
        assert warnings_of(events) == []
        return
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_log_softmax")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["floor"] <= details["loss"] < details["floor"] + 0.2 and "loss_scale" not in details


def test_labels_shuffled_against_their_inputs_are_learning_stalled_at_chance(tmp_path: Path) -> None:
    """A classifier on labels that do not belong to their inputs (one epoch of 9,632 samples, never repeated) keeps
    its cross-entropy at log 4 while nothing else looks wrong: named once held 4 judgements (0, 100, 200, 300)."""
    events, _ = fit(tmp_path / "buggy", Net(optimizer="adam", lr=1e-3, wrong_labels=10**6), steps=301, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(300, "loss_at_chance")], warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["head"] and details["classes"] == 4 and details["since_step"] == 0
    assert abs(details["loss"] - details["chance"]) < 0.03 * details["chance"]
    assert "labels belong to their inputs" in stalled[0]["message"] and "Weight decay" not in stalled[0]["message"]
    assert details["decay_per_step"] == 0


class Decayed(Net):
    """SGD at 0.05 with momentum 0.9 and ``weight_decay``: 0.5 (a percentage's value, or 5e-4 mistyped) takes a
    quarter of every weight each step."""

    def __init__(self, weight_decay: float) -> None:
        super().__init__()
        self.weight_decay = weight_decay

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)


@pytest.mark.parametrize("weight_decay", [0.5, 5e-4])
def test_a_weight_decay_that_holds_the_weights_at_0_is_named_first_at_chance(tmp_path: Path,
                                                                            weight_decay: float) -> None:
    """The weights decay to 0 and the loss stays at log 4: named as a loss at chance whose advice was to check the
    labels; the weight decay (0.25 of every weight a step) now comes first. The twin, 5e-4, learns and is quiet."""
    events, _ = fit(tmp_path, Decayed(weight_decay), steps=301, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    if weight_decay < 1e-3:
        assert warnings_of(events) == []
        return
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(300, "loss_at_chance")], warnings_of(events)
    assert stalled[0]["details"]["decay_per_step"] == pytest.approx(0.25)
    message = stalled[0]["message"]
    assert message.index("Weight decay takes 0.25 of every weight") < message.index("labels belong")
    vanishing = [e["message"] for e in events if e["kind"] == "vanishing_grad" and e["severity"] == "warning"]
    assert vanishing and all("Weight decay takes 0.25 of every weight" in text for text in vanishing)


@pytest.mark.parametrize("wrong", [True, False], ids=["shuffled", "right"])
def test_labels_shuffled_against_their_inputs_on_unbalanced_classes_are_named_below_log_c(tmp_path: Path,
                                                                                          wrong: bool) -> None:
    """Half the labels of one class: a model that learns only how often each class comes pays ~1.21, far under
    log 4 = 1.39, which cleared the run at its first judgement ("No problems found"). Its rows' cross-entropy is
    compared with what their average prediction costs: as much, so named at step 300 like the balanced case; the twin,
    the same unbalanced data with its own labels, learns from its inputs and is quiet."""
    events, _ = fit(tmp_path, Net(optimizer="adam", lr=1e-3, order="majority", wrong_labels=10**6 if wrong else 0),
                    steps=301, every=20)
    if not wrong:
        assert warnings_of(events) == []
        return
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(300, "loss_at_chance")], warnings_of(events)
    details = stalled[0]["details"]
    assert details["measure"] == "rows_against_average" and details["reference"] < 0.93 * details["chance"]
    assert "how often each class comes" in stalled[0]["message"]


@pytest.mark.parametrize("warmup", [100_000, 200])
def test_while_the_learning_rate_warms_up_chance_is_held_but_not_confirmed(tmp_path: Path, warmup: int) -> None:
    """A warm-up from 0 over 100,000 steps: at step 300 Adam's learning rate is 3e-6 and the model has barely left
    its start, at log 4, where labels shuffled against their inputs would keep it; it was warned at step 300 (as a
    tiny GPT-2 over 50,257 tokens warming up over 1,000 steps was). While a learning rate still rises the suspicion
    is held, not confirmed. The twin: labels shuffled against their inputs
    under a warm-up over 200 steps, named at step 300, the first judgement after the learning rate stopped rising."""
    model = Net(optimizer="adam", lr=1e-3, warmup=warmup, wrong_labels=10**6 if warmup == 200 else 0)
    events, _ = fit(tmp_path, model, steps=301, every=20)
    stalled = [(e["step"], e["details"]["cause"]) for e in events
               if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert stalled == ([(300, "loss_at_chance")] if warmup == 200 else []), warnings_of(events)


class Reinforce(pl.LightningModule):
    """REINFORCE on a bandit whose best arm (of 10) is the same in every state, a noisy reward and normalised
    advantages: the policy rightly answers alike for all states. Its gradient has ``cross_entropy``'s form at the
    sampled actions."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(32 * 310, 16, generator=g))
        self.policy = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 10))

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (states,) = batch
        logits = self.policy(states)
        actions = torch.distributions.Categorical(logits=logits.detach()).sample()
        reward = (actions == 3).float() + 0.5 * torch.randn(len(states))
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
        return (advantage * F.cross_entropy(logits, actions, reduction="none")).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.policy.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32, shuffle=True)


@pytest.mark.parametrize("program", ["reinforce", "smoothed_shuffled"])
def test_rows_are_held_against_their_average_only_where_the_loss_is_their_cross_entropy(tmp_path: Path,
                                                                                       program: str) -> None:
    """A policy gradient's loss is its rows' cross-entropy weighted by advantages, near 0: a policy that answers alike
    for every state pays its average's cost at the actions it sampled, and was warned at step 300; the loss against
    log C clears it. The twin: labels shuffled against unbalanced classes under ``label_smoothing=0.1`` (a
    loss 4% above its rows' cross-entropy) is still named."""
    model = (Reinforce() if program == "reinforce"
             else Net(optimizer="adam", lr=1e-3, order="majority", wrong_labels=10**6, loss="ce_smooth"))
    events, _ = fit(tmp_path, model, steps=301, every=20)
    stalled = [(e["step"], e["details"]["cause"], e["details"].get("measure")) for e in events
               if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert stalled == ([] if program == "reinforce" else [(300, "loss_at_chance", "rows_against_average")]), \
        warnings_of(events)


class WideVocabulary(pl.LightningModule):
    """A language model's head over 40,000 tokens, (B, T, V) logits, 128 tokens a step drawn by Zipf's law: the next
    token is a fixed map of the current one 15% of the time, another Zipf draw otherwise. By step 300 it has seen
    each token about once: too few to have learned its maps from its inputs yet."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        vocabulary, sequences, length = 40_000, 8 * 310, 16
        zipf = 1.0 / torch.arange(1, vocabulary + 1).float() ** 1.1
        x = torch.multinomial(zipf, sequences * length, replacement=True, generator=g).reshape(sequences, length)
        other = torch.multinomial(zipf, sequences * length, replacement=True, generator=g).reshape(sequences, length)
        mapped = torch.rand(sequences, length, generator=g) < 0.15
        self.data = TensorDataset(x, torch.where(mapped, torch.randperm(vocabulary, generator=g)[x], other))
        self.embed, self.head = nn.Embedding(vocabulary, 32), nn.Linear(32, vocabulary)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.embed(x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True)


class ManyClasses(pl.LightningModule):
    """100 classes drawn by Zipf's law (the first 9% of the samples, the last 0.1%), each with its own centre, labels
    shuffled against their inputs: seen 32 times per class by step 100, 64 by step 200."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        n, classes = 32 * 310, 100
        y = torch.multinomial(1.0 / torch.arange(1, classes + 1).float() ** 1.1, n, replacement=True, generator=g)
        x = 2.0 * torch.randn(classes, 16, generator=g)[y] + torch.randn(n, 16, generator=g)
        self.data = TensorDataset(x, y[torch.randperm(n, generator=g)])
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, classes))

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32, shuffle=True)


@pytest.mark.parametrize("program", ["wide_vocabulary", "many_classes_shuffled"])
def test_rows_no_better_than_their_average_confirm_once_each_class_was_seen_often(tmp_path: Path,
                                                                                  program: str) -> None:
    """A model over 40,000 tokens learns how often each comes long before it learns them from its inputs: at step 300
    its rows cost what their average does, and it was warned. Rows against their average confirm only once the model
    has trained on 50 rows per class; the twin, labels shuffled against 100 unbalanced classes (64 rows per class by
    step 200), is named at step 300."""
    events, _ = fit(tmp_path, WideVocabulary() if program == "wide_vocabulary" else ManyClasses(), steps=301, every=20)
    stalled = [(e["step"], e["details"]["cause"], e["details"]["measure"]) for e in events
               if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    expected = [] if program == "wide_vocabulary" else [(300, "loss_at_chance", "rows_against_average")]
    assert stalled == expected, warnings_of(events)


@pytest.mark.parametrize("labels", [0, 5_000])
def test_a_classifier_that_learns_from_the_start_or_late_is_not_at_chance(tmp_path: Path, labels: int) -> None:
    """The twins: the right labels from the start, and wrong ones for the first 5,000 samples (about 156 steps at
    chance, a fine-tune that learns late) then right: the loss leaves log 4 before the hold ends."""
    events, _ = fit(tmp_path, Net(optimizer="adam", lr=1e-3, wrong_labels=labels), steps=301, every=20)
    assert warnings_of(events) == []


@pytest.mark.parametrize("twin", ["nll_log", "mse_one_hot", "logits"])
def test_a_softmax_output_trained_with_a_loss_on_probabilities_and_plain_logits_are_quiet(tmp_path: Path,
                                                                                          twin: str) -> None:
    model = (Net(optimizer="adam", lr=1e-3) if twin == "logits"
             else Net(out_act=nn.Softmax(dim=-1), optimizer="adam", lr=1e-3, loss=twin))
    events, _ = fit(tmp_path, model, steps=201, every=20)
    assert warnings_of(events) == []


def test_a_log_softmax_over_the_batch_is_learning_stalled_above_its_floor(tmp_path: Path) -> None:
    """``nll_loss(log_softmax(logits, dim=0))``: the loss falls from log 32 (the batch) to above log(32 / 4), so it
    learns and nothing else is wrong; named at the second judgement, 100 steps after the first."""
    events, _ = fit(tmp_path / "buggy", Net(optimizer="adam", lr=1e-3, loss="batch_softmax"), steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "softmax_over_batch")], warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["head"] and (details["rows"], details["classes"], details["since_step"]) == (32, 4, 0)
    assert details["floor"] <= details["loss"] < 3.3 and details["batch_softmax_fit"] == 1.0
    assert "dim=0" in stalled[0]["message"]


class Contrastive(Net):
    """Two noisy views of each sample, their 4-wide embeddings compared by dot product over the batch
    (``cross_entropy(a @ b.T / 0.1, arange(N))``): a softmax over the batch on purpose, whose loss starts at log 32
    and stays above log(32 / 4) for the first hundred steps, as the planted bug's does; its gradient is not that of a
    softmax down the output's columns."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        a, b = self(x + 0.3 * torch.randn_like(x)), self(x + 0.3 * torch.randn_like(x))
        return F.cross_entropy(a @ b.T / 0.1, torch.arange(len(x)))


def test_a_contrastive_loss_over_the_batch_is_not_a_softmax_over_the_batch(tmp_path: Path) -> None:
    model = Contrastive(optimizer="adam", lr=1e-4)
    events, _ = fit(tmp_path, model, steps=201, every=20)
    assert warnings_of(events) == []


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_target_broadcast_against_the_output_is_learning_stalled_with_the_targets_mean(tmp_path: Path) -> None:
    """``mse_loss`` of an (N, 1) output and an (N,) target compares every output with every target: the model learns
    their mean (the twin's loss falls 100x, this one's stays at the targets' variance); named at the second
    judgement, the batch's mean target having moved since the first."""
    events, _ = fit(tmp_path / "buggy", Net(regress=True, loss="broadcast", optimizer="adam", lr=1e-3), steps=201,
                    every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "shared_target")], warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["head"] and details["since_step"] == 0 and details["misfit"] <= 1
    first, later = details["targets"]
    assert abs(first - later) > 1e-3 and "target.unsqueeze(-1)" in stalled[0]["message"]
    twin, _ = fit(tmp_path / "twin", Net(regress=True, optimizer="adam", lr=1e-3), steps=201, every=20)
    assert warnings_of(twin) == []


def test_a_least_squares_gan_scoring_its_outputs_against_a_constant_is_quiet(tmp_path: Path) -> None:
    """Fitting every output to one value on purpose (fakes scored against 0): the gradient has the broadcast's form,
    at the same value at every judgement."""
    events, _ = fit(tmp_path, Net(regress=True, loss="least_squares_gan", optimizer="adam", lr=1e-3), steps=201,
                    every=20)
    assert warnings_of(events) == []


def test_a_sigmoid_output_fed_to_bce_with_logits_is_learning_stalled_above_its_floor(tmp_path: Path) -> None:
    """``nn.Sigmoid`` as the last layer and ``BCEWithLogitsLoss``: the loss falls a little (0.84 to 0.70) and stays
    above what a label of 0 can reach through a second sigmoid; named at the second judgement from the form of the
    output's gradient, the labels at 1 read from its signs."""
    buggy = Net(out_act=nn.Sigmoid(), optimizer="adam", lr=1e-3, loss="bce_logits")
    events, _ = fit(tmp_path, buggy, steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_sigmoid")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["modules"] == ["out_act"] and details["since_step"] == 0 and details["sigmoid_fit"] == 1.0
    assert abs(details["positives"] - 0.25) < 0.1 and details["floor"] < details["loss"]
    assert "binary_cross_entropy (BCELoss)" in stalled[0]["message"]


def test_a_sigmoid_output_fed_to_bce_with_logits_weighted_by_class_is_named_with_its_weights(tmp_path: Path) -> None:
    """``pos_weight`` multiplies the gradient of the labels at 1 by their class's weight: the form holds with one
    constant for the labels at 0 and one per column for those at 1 (it printed "No problems found": one constant
    for all fitted only the labels at 0, 75% of the values, under the 90% needed)."""
    buggy = Net(out_act=nn.Sigmoid(), optimizer="adam", lr=1e-3, loss="bce_logits_pos_weight", module_loss=True)
    events, _ = fit(tmp_path, buggy, steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(100, "probabilities_into_sigmoid")], \
        warnings_of(events)
    details = stalled[0]["details"]
    assert details["sigmoid_fit"] == 1.0 and min(POS_WEIGHT) < details["positive_weight"] < max(POS_WEIGHT)
    assert "by pos_weight" in stalled[0]["message"] and details["floor"] < details["loss"]


@pytest.mark.parametrize(("out_act", "loss"), [(None, "bce_logits_pos_weight"), (nn.Sigmoid(), "bce_weight")],
                         ids=["logits-pos-weight", "sigmoid-bce-weight"])
def test_weighted_binary_losses_made_for_their_output_are_quiet(tmp_path: Path, out_act: nn.Module | None,
                                                                loss: str) -> None:
    """The twins: logits into the weighted ``BCEWithLogitsLoss``, and a sigmoid's output into ``BCELoss`` with one
    weight per class."""
    model = Net(out_act=out_act, optimizer="adam", lr=1e-3, loss=loss, module_loss=True)
    assert warnings_of(fit(tmp_path, model, steps=201, every=20)[0]) == []


@pytest.mark.parametrize("twin", ["logits", "bce", "mse_one_hot"])
def test_logits_into_bce_with_logits_and_a_sigmoid_into_bce_or_mse_are_quiet(tmp_path: Path, twin: str) -> None:
    """The twins: the same gradient form on logits (not all in [0, 1]), and a sigmoid's output with a loss made for
    probabilities (another form)."""
    model = (Net(optimizer="adam", lr=1e-3, loss="bce_logits") if twin == "logits"
             else Net(out_act=nn.Sigmoid(), optimizer="adam", lr=1e-3, loss=twin))
    events, _ = fit(tmp_path, model, steps=201, every=20)
    assert warnings_of(events) == []


def assert_output_judged(events: list[dict[str, Any]], cause: str | None, module: str) -> None:
    """Quiet when ``cause`` is None; else one ``learning_stalled`` warning, of that cause, naming ``module``."""
    if cause is None:
        assert warnings_of(events) == []
        return
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [e["details"]["cause"] for e in stalled] == [cause], warnings_of(events)
    assert stalled[0]["details"]["modules"] == [module]


@pytest.mark.parametrize(("out_act", "loss", "cause", "metric"), [
    (nn.Softmax(dim=-1), "ce", "probabilities_into_log_softmax", False),
    (nn.Softmax(dim=-1), "ce", "probabilities_into_log_softmax", True),
    (nn.Sigmoid(), "bce_logits", "probabilities_into_sigmoid", False), (None, "ce", None, False),
    (None, "ce", None, True), (None, "ce_per_sample", None, False), (None, "bce_logits", None, False),
    (nn.Sigmoid(), "bce", None, False), (nn.Sigmoid(), "mse_one_hot", None, False)])
def test_the_loss_as_a_module_leaves_the_model_output_to_the_call_before_it(
        tmp_path: Path, out_act: nn.Module | None, loss: str, cause: str | None, metric: bool) -> None:
    """``self.criterion = nn.CrossEntropyLoss()`` is a leaf the hooks see, called last with the loss as its output:
    the model's output is the call before it (the last with an output of a dimension or more), so a softmax before
    ``CrossEntropyLoss`` and a sigmoid before ``BCEWithLogitsLoss`` are named as with the functional losses (they
    printed "No problems found"), and the losses made for what the model gives are quiet (one per sample too). A
    torchmetrics metric called on the output before the loss is a leaf too, whose output has no graph: not the
    model's output either."""
    model = Net(out_act=out_act, optimizer="adam", lr=1e-3, loss=loss, module_loss=True, metric=metric)
    assert_output_judged(fit(tmp_path, model, steps=201, every=20)[0], cause, "out_act")


@pytest.mark.parametrize(("functional_out", "loss", "cause"), [
    ("softmax", "ce", "probabilities_into_log_softmax"), ("sigmoid", "bce_logits", "probabilities_into_sigmoid"),
    ("log_softmax", "nll", None)])
def test_an_output_written_in_forward_after_the_head_is_the_models_output(
        tmp_path: Path, functional_out: str, loss: str, cause: str | None) -> None:
    """``return F.softmax(self.head(x), dim=1)``: no module gives the probabilities, the module with children that
    returns them does (the LightningModule's ``forward``), so the softmax before ``cross_entropy`` and the sigmoid
    before ``binary_cross_entropy_with_logits`` are named from it as from an ``nn.Softmax`` (they printed "No problems
    found": the head's logits were judged); ``nll_loss`` of a ``log_softmax`` written the same way is quiet."""
    model = Net(functional_out=functional_out, optimizer="adam", lr=1e-3, loss=loss)
    assert_output_judged(fit(tmp_path, model, steps=201, every=20)[0], cause, "model")


@pytest.mark.parametrize("functional_out", ["relu", "softplus", None])
def test_a_relu_written_in_forward_on_the_logits_is_a_dead_output_unit(tmp_path: Path,
                                                                       functional_out: str | None) -> None:
    """``return F.relu(self.head(x))`` (a ReLU after every layer, the last included): no ReLU module gives the
    output, the LightningModule's ``forward`` does, and a class whose logit is below 0 for every sample gets no
    gradient; it printed "No problems found" where an ``nn.ReLU`` on the head was named. The twins: ``F.softplus``
    (non-negative, never 0) and the plain logits."""
    model = Net(functional_out=functional_out, optimizer="adam", lr=1e-3)
    events, _ = fit(tmp_path, model, steps=101, every=20)
    if functional_out != "relu":
        assert warnings_of(events) == []
        return
    dead = [e for e in events if e["kind"] == "dead_activation"]
    assert dead and dead[0]["step"] == 0 and dead[0]["details"]["modules"] == ["model"], warnings_of(events)
    assert dead[0]["details"]["output"] and 0 < dead[0]["details"]["dead_units"] < 4


class Autoencoder(pl.LightningModule):
    """An 8x8 image autoencoder with a ReLU on its output (images are non-negative), trained with ``mse_loss``. The
    images have a blank border (28 of 64 pixels always 0, as digits have): training drives the border units below 0,
    where they stay, at their target. ``alive``: the output layer's bias starts at 0.5, so no unit starts dead;
    otherwise PyTorch's init leaves about a third of the output units at 0 for every sample from the first step,
    the inner pixels among them stuck below targets they can never reach."""

    def __init__(self, alive: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU())
        if alive:
            nn.init.constant_(self.decoder[2].bias, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return F.mse_loss(self(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        images = torch.zeros(4096, 8, 8)
        inner = torch.rand(4096, 6, generator=g) @ torch.rand(6, 36, generator=g) / 3
        images[:, 1:7, 1:7] = inner.clamp(0, 1).view(-1, 6, 6)
        return DataLoader(TensorDataset(images.view(-1, 64)), batch_size=32, shuffle=True)


def test_an_autoencoders_relu_output_dead_at_its_blank_pixels_is_quiet_and_dead_below_its_targets_is_named(
        tmp_path: Path) -> None:
    """The output units that die at the border pixels sit at their target 0, where the loss's gradient is 0: no
    finding (named "dead_activation" before, at step 100). The same model from PyTorch's init has inner units dead
    too, whose gradient asks them to rise: named at the first measured step with how many the loss pushes."""
    events, _ = fit(tmp_path / "healthy", Autoencoder(alive=True), steps=201, every=100)
    assert warnings_of(events) == []
    events, _ = fit(tmp_path / "buggy", Autoencoder(alive=False), steps=21, every=100)
    dead = [e for e in events if e["kind"] == "dead_activation"]
    assert dead and dead[0]["step"] <= 1 and dead[0]["details"]["modules"] == ["decoder.3"], warnings_of(events)
    details = dead[0]["details"]
    assert 0 < details["dead_units_pushed"] < details["dead_units"], details
    assert f"{details['dead_units_pushed']} of them where the loss asks for a larger value" in dead[0]["message"]


class SparseAutoencoder(pl.LightningModule):
    """A sparse autoencoder (a wide ReLU dictionary under an L1 penalty) on vectors made of a few of 512 directions:
    each sample switches on a handful of its 4096 features, well over 99% of the layer's values are 0, and it
    reconstructs. ``l1`` 10x stronger switches every feature off for most samples: nothing reaches the encoder."""

    def __init__(self, l1: float = 3e-3) -> None:
        super().__init__()
        self.encoder, self.features, self.decoder = nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 64)
        self.l1 = l1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        f = self.features(self.encoder(x))
        return F.mse_loss(self.decoder(f), x) + self.l1 * f.abs().sum(-1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        directions = F.normalize(torch.randn(512, 64, generator=g), dim=1)
        x = ((torch.rand(8192, 512, generator=g) < 0.01) * torch.rand(8192, 512, generator=g)) @ directions
        return DataLoader(TensorDataset(x), batch_size=256, shuffle=True)


def test_a_sparse_autoencoders_features_are_sparse_not_dead_and_a_layer_off_for_most_samples_is_dead(
        tmp_path: Path) -> None:
    """Over 99% zeros was read as a dead layer: a sparse autoencoder's feature layer was named "dead_activation" at
    step 300. Most of its samples have a feature on and many features serve some sample: quiet. Ten times the L1
    switches every feature off for most samples (no gradient reaches the encoder for them): still named."""
    events, _ = fit(tmp_path / "healthy", SparseAutoencoder(), steps=301, every=100)
    assert warnings_of(events) == []
    events, _ = fit(tmp_path / "buggy", SparseAutoencoder(l1=3e-2), steps=301, every=100)
    dead = [e for e in events if e["kind"] == "dead_activation"]
    assert dead and dead[0]["details"]["modules"] == ["features"], warnings_of(events)
    assert dead[0]["details"]["zero_row_fraction"] >= 0.5


class GAN(pl.LightningModule):
    """A GAN on 8x8 images in [-1, 1] (manual optimization, a generator ending in Tanh): the discriminator's logits
    start around 0.5 (its last layer's weights scaled by 0.2, its bias 0.5) and stay within [0, 1] on the judged
    steps, and ``binary_cross_entropy_with_logits`` gives them the gradient a sigmoid applied twice gives.
    ``sigmoid_head``: the DCGAN tutorial's discriminator, which ends in ``nn.Sigmoid``, kept when the loss became
    ``binary_cross_entropy_with_logits``: its probabilities are squashed again."""

    def __init__(self, sigmoid_head: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh())
        head: list[nn.Module] = [nn.Sigmoid()] if sigmoid_head else []
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1), *head)
        if not sigmoid_head:
            with torch.no_grad():  # its logits start around 0.5, in [0, 1], where training keeps them for a while
                self.discriminator[2].weight.mul_(0.2)
                self.discriminator[2].bias.fill_(0.5)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()  # type: ignore[misc]
        fake = self.generator(torch.randn(len(real), 16))
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros))
        discriminator_optimizer.zero_grad()
        self.manual_backward(loss)
        discriminator_optimizer.step()
        loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        generator_optimizer.zero_grad()
        self.manual_backward(loss)
        generator_optimizer.step()

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        images = -torch.ones(4096, 8, 8)
        images[:, 2:6, 2:6] = (torch.rand(4096, 4, 4, generator=g) > 0.5).float() * 2 - 1
        return DataLoader(TensorDataset(images.view(-1, 64)), batch_size=64, shuffle=True)


def test_a_gans_discriminator_logits_in_0_1_are_not_probabilities_and_a_sigmoid_head_into_bce_with_logits_is(
        tmp_path: Path) -> None:
    """The discriminator's logits near equilibrium all lay in [0, 1] at steps 2 and 102, and the healthy GAN was
    named ``probabilities_into_sigmoid``: an output an affine map makes is logits whatever one batch's range. The
    discriminator ending in ``nn.Sigmoid`` under ``binary_cross_entropy_with_logits`` is still named."""
    events, _ = fit(tmp_path / "healthy", GAN(), steps=201, every=100)
    assert warnings_of(events) == []
    events, _ = fit(tmp_path / "buggy", GAN(sigmoid_head=True), steps=201, every=100)
    causes = {e["details"].get("cause") for e in events if e["kind"] == "learning_stalled" and e["step"] == 100}
    assert "probabilities_into_sigmoid" in causes, warnings_of(events)


def test_training_data_sorted_by_label_and_not_shuffled_is_single_class_batches(tmp_path: Path) -> None:
    """512 samples in label order, 128 of each class, not shuffled: the batch at step 0 is all class 0 and the batch
    at step 100 (the fifth of its epoch) all class 1; the loss looks healthy. Named at the second judgement."""
    events, _ = fit(tmp_path, Net(optimizer="adam", lr=1e-3, order="sorted"), steps=201, every=20)
    found = [e for e in events if e["kind"] == "single_class_batches" and e["severity"] == "warning"]
    assert [e["step"] for e in found] == [100], warnings_of(events)
    details = found[0]["details"]
    assert details["modules"] == ["head"] and details["since_step"] == 0 and details["labels"] == [[0, 0], [1, 1]]
    assert details["rows"] == 32 and details["labelled_share"] >= 0.9 and "shuffle=True" in found[0]["message"]
    assert warnings_of(events) == [("single_class_batches", 100)]


@pytest.mark.parametrize("timed", [False, True], ids=["gradients", "with_the_performance_callback"])
def test_sorted_data_whose_epoch_is_100_steps_is_judged_on_another_batch_the_second_time(tmp_path: Path,
                                                                                       timed: bool) -> None:
    """3,200 samples in label order: an epoch of exactly 100 batches, so the judged steps 0, 100 and 200 all see the
    batch of class 0 again and the hold never met a batch of another class ("No problems found"). A judgement that
    would see the batch at the same place in its epoch as the one before it moves on by half of what is left of the
    epoch: step 150, the batches of class 2. With the performance callback, which times the check steps (0, 100),
    each measurement moves one step on (1, 101): the batch is checked where it is measured, and 101 moves to 151."""
    model = Net(optimizer="adam", lr=1e-3, order="sorted", samples=3200)
    if timed:
        config = DebugConfig(print_summary=False, save_plots=False)
        trainer = fit_seeded(tmp_path, model, [GradientHealthCallback(config), PerformanceProfilerCallback(config)],
                             max_steps=201)
        events = read_events(debug_dir(trainer))
    else:
        events, _ = fit(tmp_path, model, steps=201, every=20)
    found = [e for e in events if e["kind"] == "single_class_batches" and e["severity"] == "warning"]
    assert [e["step"] for e in found] == [151 if timed else 150], warnings_of(events)
    details = found[0]["details"]
    assert details["since_step"] == (1 if timed else 0) and details["labels"] == [[0, 0], [2, 2]]


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_broadcast_target_whose_epoch_is_100_steps_is_judged_on_another_batch(tmp_path: Path) -> None:
    """The same epoch of 100 batches, not shuffled, under ``mse_loss`` of an (N, 1) output and an (N,) target: the
    same batch at steps 0 and 100 gives the same mean target, which reads as a constant target by design and cleared
    the run; judged half an epoch later (step 150), it is another batch's mean."""
    model = Net(regress=True, loss="broadcast", optimizer="adam", lr=1e-3, samples=3200)
    events, _ = fit(tmp_path, model, steps=201, every=20)
    stalled = [e for e in events if e["kind"] == "learning_stalled" and e["severity"] == "warning"]
    assert [(e["step"], e["details"]["cause"]) for e in stalled] == [(150, "shared_target")], warnings_of(events)


class FirstRowOnly(Net):
    """A loss over the batch's first row alone (``cross_entropy(z[:1], y[:1])``): one row of 32 has a gradient."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x)[:1], y[:1])


def test_a_loss_over_one_row_of_a_shuffled_batch_shows_no_batch_of_one_label(tmp_path: Path) -> None:
    """The rows without a gradient took the label of the one that had it, so each batch read as 32 rows of one label
    and the shuffled data was named ``single_class_batches`` ("the loader does not shuffle"). The share of the rows
    with ``cross_entropy``'s form is now over every row read. The twin is the sorted data above, named."""
    events, _ = fit(tmp_path, FirstRowOnly(optimizer="adam", lr=1e-3), steps=301, every=20)
    assert [e for e in events if e["kind"] == "single_class_batches"] == [], warnings_of(events)


@pytest.mark.parametrize("order", ["shuffled", "unbalanced"])
def test_the_same_data_shuffled_and_unbalanced_labels_are_not_single_class_batches(tmp_path: Path, order: str) -> None:
    """The twins: the sorted data with ``shuffle=True``, and labels 99.5% of class 0, whose batches are mostly of
    class 0 alone (at steps 0 and 100 of this run: named without the rule that a second batch of the same label drops
    the hold) but never of another class alone."""
    events, _ = fit(tmp_path, Net(optimizer="adam", lr=1e-3, order=order), steps=301, every=20)
    assert warnings_of(events) == []
