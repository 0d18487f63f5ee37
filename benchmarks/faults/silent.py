"""Silent training errors of TrainCheck (OSDI 2025) that run on one CPU process, re-created in Lightning, and two
misuses of autograd (class ``autograd_misuse``: a loss rebuilt from its value, manual optimization out of order, a
``detach`` left in the forward) and of the API (class ``api_misuse``: log_softmax over the batch, a target broadcast
against the output, the model left in eval mode, a step decay registered per step, a layer built in ``forward``,
``opt.step()`` forgotten under manual optimization, a ``training_step`` that does not return its loss).

Each is a subclass of :class:`~benchmarks.faults.programs.FaultProgram` with the user's mistake; with
``Program(fixed=True)`` the same subclass runs the corrected line. Written from the issues' descriptions
(TrainCheck-Evaluation-Workloads ``silent-issue-detection``: pytorch-forum-84911 and
stackoverflow-60335387, and the classes the paper lists), not from their code.

The distributed ones (replicas drifting apart after a lost sync, clipping on one rank only, the DDP
wrapper bypassed) need two processes and are not here; AMP/GradScaler misconfiguration needs a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from benchmarks.faults.programs import FaultProgram, Program, data


class OptimizerOnCopy(FaultProgram):
    """The optimizer is built over a copy of the layers (a model re-created after the optimizer, a
    ``deepcopy`` for an EMA swapped the wrong way): the trained module's parameters get gradients and
    never move."""

    def configure_optimizers(self) -> Any:
        if self.program.fixed:
            return super().configure_optimizers()
        ghost = copy.deepcopy(torch.nn.ModuleList([self.layers, self.head]))
        return torch.optim.SGD(ghost.parameters(), lr=self.program.lr)


class ClipBeforeBackward(FaultProgram):
    """Gradient clipping called where there are no gradients yet (before the backward), so it clips
    nothing and the run it was meant to protect blows up; the twin clips where Lightning does."""

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if not self.program.fixed:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        if self.program.fixed:
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")


class SchedulerPerEpoch(FaultProgram):
    """A linear warm-up from 0 written per step but registered with ``interval: "epoch"``: the run
    ends inside its first epoch, so the learning rate stays 0 and nothing is learnt."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.program.lr)
        warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 10))
        interval = "step" if self.program.fixed else "epoch"
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warm_up, "interval": interval}}


class LearningRateZeroed(FaultProgram):
    """User code sets every param group's learning rate to 0 at step 15 (a freeze meant for one group,
    a pause left in): the optimizer keeps stepping and nothing changes."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.program.fixed and self.trainer.global_step == 15:
            for group in self.trainer.optimizers[0].param_groups:
                group["lr"] = 0.0


class DropoutAtEval(FaultProgram):
    """Dropout written ``F.dropout(h, 0.5, training=True)``: it stays on in validation, so every
    evaluation is a noisy sub-network."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for index, layer in enumerate(self.layers):
            h = self.acts[index](layer(h))
            h = F.dropout(h, 0.5, training=self.training if self.program.fixed else True)
        return self.head(h)


class _RandomSampleDataset(Dataset):
    """Draws a random record (with noise) from a NumPy generator made once: forked workers copy it."""

    def __init__(self, base: Any) -> None:
        self.inputs, self.targets = base.tensors
        self.rng = np.random.RandomState(0)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = int(self.rng.randint(len(self.targets)))
        noise = torch.from_numpy(self.rng.normal(0, 0.1, self.inputs.shape[1]).astype("float32"))
        return self.inputs[pick] + noise, self.targets[pick]


def _reseed(worker: int) -> None:
    info = torch.utils.data.get_worker_info()
    if info is not None:
        info.dataset.rng = np.random.RandomState(info.seed % 2**32)


class WorkersShareSeed(FaultProgram):
    """Two data-loader workers each copy one NumPy generator: both draw the same records, so every batch
    is seen twice and half the data never; the twin reseeds each worker."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RandomSampleDataset(data(self.program)), batch_size=self.program.batch, num_workers=2,
                          worker_init_fn=_reseed if self.program.fixed else None, persistent_workers=True)


class NoZeroGrad(FaultProgram):
    """``optimizer_zero_grad`` overridden to do nothing (the ``zero_grad()`` line missing of
    stackoverflow-60335387): every update is the sum of all past gradients."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self.program.fixed:
            optimizer.zero_grad()


class FrozenInOptimizer(FaultProgram):
    """Every Linear but the head frozen with ``requires_grad_(False)`` while the optimizer still holds
    them (pytorch-forum-84911: only the normalisation layers were left trainable)."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        if not program.fixed:
            self.layers.requires_grad_(False)


class LossFromNumber(FaultProgram):
    """The loss rebuilt from its value, ``torch.tensor(loss.item(), requires_grad=True)`` (what silences "element 0
    of tensors does not require grad" after the graph was cut): every backward reaches no parameter."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss if self.program.fixed else torch.tensor(loss.item(), requires_grad=True)


class ManualOptimization(FaultProgram):
    """The program under Lightning's manual optimization: its ``training_step`` calls the optimizer itself, the one
    :meth:`stepper` gives."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.automatic_optimization = False

    def stepper(self) -> Any:
        return self.optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.stepper()
        loss = self.loss_of(self(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class StepBeforeBackward(ManualOptimization):
    """Manual optimization in the wrong order, ``step()``, ``manual_backward(loss)``, ``zero_grad()``: every step
    finds the gradients cleared; the twin calls ``zero_grad()``, ``manual_backward(loss)``, ``step()``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.loss_of(self(batch[0]), batch[1])
        if self.program.fixed:
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        else:
            optimizer.step()
            self.manual_backward(loss)
            optimizer.zero_grad()
        return loss


class SoftmaxOverTheBatch(FaultProgram):
    """``nll_loss(log_softmax(logits, dim=0))``: normalised over the batch, not the classes; the loss falls from
    log(batch) to a floor near log(batch / classes) and the classifier learns a ranking of samples."""

    def loss_of(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z, y) if self.program.fixed else F.nll_loss(F.log_softmax(z, dim=0), y)


class TargetBroadcast(FaultProgram):
    """``mse_loss(output, target.squeeze(-1))`` on an output of shape (N, 1): the (N,) target broadcasts to (N, N),
    every output is fitted to every target, and the model learns their mean (PyTorch warns once)."""

    def loss_of(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(z, y) if self.program.fixed else F.mse_loss(z, y.squeeze(-1))


class EvalModeInTraining(FaultProgram):
    """``self.eval()`` in ``on_train_batch_start`` (meant for a frozen part): BatchNorm uses its running statistics
    and dropout is off for the whole run."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self.program.fixed:
            self.eval()


class StepDecayPerStep(FaultProgram):
    """``StepLR(step_size=30, gamma=0.1)``, a decay meant per epoch, registered with ``interval: "step"``: the
    learning rate is a millionth of its base by step 180 and training stops far from the end; the twin steps it per
    epoch."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.program.lr)
        decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
        interval = "epoch" if self.program.fixed else "step"
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": interval}}


class DetachedHidden(FaultProgram):
    """``h = h.detach()`` left after the first layer (a stop-gradient from an experiment, or ``.data``): the layer
    before it never gets a gradient and never learns; the twin keeps the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for index, layer in enumerate(self.layers):
            h = self.acts[index](layer(h))
            if index == 0 and not self.program.fixed:
                h = h.detach()
        return self.head(h)


class LayerInForward(FaultProgram):
    """The head built inside ``forward`` (``self.head = nn.Linear(...)`` on every call): a new random layer each step,
    registered on the module but in no optimizer, so the model never learns; the twin builds it in ``__init__``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.program.fixed:
            self.head = torch.nn.Linear(self.program.width, self.program.classes)
        return super().forward(x)


class StepForgotten(ManualOptimization):
    """Manual optimization without ``opt.step()``: ``zero_grad()``, ``manual_backward(loss)`` and nothing more, so the
    weights never move and Lightning's step counter stays at 0 (the run ends on its epochs); the twin steps."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = self.loss_of(self(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.program.fixed:
            optimizer.step()
        return loss


class OptimizerUnwrapped(ManualOptimization):
    """Manual optimization stepping ``self.optimizers(use_pl_optimizer=False)``, the torch optimizer inside Lightning's
    wrapper (Lightning issues 16143 and 17281): the model learns and Lightning's step counter stays at 0, so
    ``max_steps`` is never reached and step checkpoints are never saved (the run ends on its epochs); the twin steps
    the wrapper."""

    def stepper(self) -> Any:
        return self.optimizers(use_pl_optimizer=self.program.fixed)


class OptimizerInStep(ManualOptimization):
    """Manual optimization with a torch optimizer made in ``training_step`` (plain SGD, so it learns as the configured
    one would): no optimizer Lightning holds steps and its step counter stays at 0; the twin steps the configured
    optimizer through ``self.optimizers()``."""

    def stepper(self) -> Any:
        return self.optimizers() if self.program.fixed else torch.optim.SGD(self.parameters(), lr=self.program.lr)


class LossNotReturned(FaultProgram):
    """A ``training_step`` that computes and logs its loss and never returns it: Lightning skips the backward of every
    batch and steps the optimizer on no gradient, so nothing is learnt; the twin returns it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss_of(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss if self.program.fixed else None


class RoundInLoss(FaultProgram):
    """``mse_loss(output.round(), y)`` (a rounding meant for the metric put in the loss): ``round`` has a zero
    gradient, so every gradient of the model is exactly zero under a loss that is not; the twin rounds nothing."""

    def loss_of(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().loss_of(z if self.program.fixed else z.round(), y)


class LayersInList(FaultProgram):
    """The hidden layers kept in a Python list, not an ``nn.ModuleList`` (the most asked PyTorch forum question on a
    model that does not learn): the forward uses them, ``self.parameters()`` lists the head alone, so only the head
    trains, on random features; the twin registers them."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        if not program.fixed:
            layers = list(self.layers)
            del self.layers
            self.layers = layers  # type: ignore[assignment]


class ClipToZero(FaultProgram):
    """``clip_grad_norm_(self.parameters(), max_norm)`` in ``on_before_optimizer_step`` with a ``max_norm`` of 0 (a
    setting read as "no clipping" elsewhere): every gradient is scaled to 0 before the step, so the weights never
    move; the twin clips at 1."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0 if self.program.fixed else 0.0)


class SortedUnshuffled(FaultProgram):
    """The training data in label order and ``shuffle=False`` (Humbatova et al., ICSE 2020: data shuffling): each
    batch holds one class, the model learns one at a time and forgets the others; the twin shuffles."""

    def train_dataloader(self) -> DataLoader:
        inputs, labels = data(self.program).tensors
        order = torch.argsort(labels, stable=True)
        return DataLoader(torch.utils.data.TensorDataset(inputs[order], labels[order]), batch_size=self.program.batch,
                          shuffle=self.program.fixed)


class WarmUpEndless(FaultProgram):
    """A linear warm-up given a length of a million steps where a thousand were meant (samples or epochs for steps,
    a total computed wrongly): the learning rate stays near 0 for the whole run; the twin warms up over 50 steps."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.program.lr)
        length = 50 if self.program.fixed else 1e6
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / length))
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class PlateauWatchingARise(FaultProgram):
    """``ReduceLROnPlateau(mode="max")`` stepped on the training loss: a falling loss never "improves", so the lr is
    halved at every patience, to 2e-7 of its base by step 120; the twin watches it with ``mode="min"``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.program.lr)
        schedule = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min" if self.program.fixed else "max",
                                                              patience=5, factor=0.5)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step", "monitor": "train_loss"}}


class SchedulerSteppedTwice(FaultProgram):
    """``self.lr_schedulers().step()`` in ``training_step`` of a scheduler Lightning already steps every step: a
    linear decay to 0 over the run ends at its middle and the lr stays 0 for the second half; the twin leaves the
    stepping to Lightning."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.program.fixed:
            self.lr_schedulers().step()
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.program.lr)
        total = self.program.steps
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total))
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class HeadReplacedLate(FaultProgram):
    """A head swapped for a fresh one in the module's ``on_train_start``, after ``configure_optimizers`` built the
    optimizer over the old one: the new head gets gradients and never moves (the layers below learn around it); the
    twin swaps it in ``setup``, before the optimizer is built."""

    def _swap(self) -> None:
        torch.manual_seed(self.program.seed + 1)
        self.head = torch.nn.Linear(self.head.in_features, self.head.out_features)

    def setup(self, stage: str) -> None:
        if self.program.fixed:
            self._swap()

    def on_train_start(self) -> None:
        if not self.program.fixed:
            self._swap()


class WeightDecayHuge(FaultProgram):
    """``SGD(lr=0.05, momentum=0.9, weight_decay=0.5)``, a percentage's value or ``5e-4`` mistyped: decay takes a
    quarter of every weight a step and holds the weights near 0, the loss at log C; the twin decays by 5e-4."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.program.lr, momentum=0.9,
                               weight_decay=5e-4 if self.program.fixed else 0.5)


class AdamEpsLarge(FaultProgram):
    """``Adam(lr=1e-3, eps=1.0)``, another library's convention or a typo for 1e-8: every update is divided by
    ``eps``, not the gradient's scale, so Adam runs as SGD at ``lr / eps``; the twin keeps the default eps."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.program.lr, eps=1e-8 if self.program.fixed else 1.0)


class _Sequences(FaultProgram):
    """The 16 features of a record read as a sequence of 4 steps of 4, by a recurrent layer; the loader shuffles."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        del self.layers, self.acts
        torch.manual_seed(program.seed)
        self.rnn = self._recurrent(program)

    def _recurrent(self, program: Program) -> torch.nn.Module:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(self.program), batch_size=self.program.batch, shuffle=True)

    def sequences(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 4, self.program.features // 4)


class RnnBatchFirst(_Sequences):
    """``nn.LSTM(..)`` built without ``batch_first=True`` and fed (batch, time, features) (PyTorch forum, "LSTM
    batch_first"): the recurrence runs across the samples of the batch and each "sequence" is one time step of every
    sample, so the model learns from a mixture of records; the twin passes ``batch_first=True``."""

    def _recurrent(self, program: Program) -> torch.nn.Module:
        return torch.nn.LSTM(program.features // 4, program.width, batch_first=program.fixed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.sequences(x))
        return self.head(out[:, -1])


class ViewForTranspose(_Sequences):
    """``x.view(T, B, F)`` where ``x.transpose(0, 1)`` was meant, to put time first for a sequence-first GRU (the
    classic "view is not permute"): every sequence the GRU reads is made of steps of other samples; the twin
    transposes."""

    def _recurrent(self, program: Program) -> torch.nn.Module:
        return torch.nn.GRU(program.features // 4, program.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = self.sequences(x)
        batch, time, features = steps.shape
        first = steps.transpose(0, 1) if self.program.fixed else steps.view(time, batch, features)
        out, _ = self.rnn(first)
        return self.head(out[-1])


SILENT: dict[str, type[FaultProgram]] = {
    "optimizer_on_copy": OptimizerOnCopy, "clip_before_backward": ClipBeforeBackward,
    "scheduler_per_epoch": SchedulerPerEpoch, "lr_zeroed": LearningRateZeroed, "dropout_at_eval": DropoutAtEval,
    "workers_share_seed": WorkersShareSeed, "no_zero_grad": NoZeroGrad, "frozen_in_optimizer": FrozenInOptimizer,
    "loss_from_number": LossFromNumber, "step_before_backward": StepBeforeBackward,
    "softmax_over_the_batch": SoftmaxOverTheBatch, "target_broadcast": TargetBroadcast,
    "eval_mode_in_training": EvalModeInTraining, "step_decay_per_step": StepDecayPerStep,
    "detached_hidden": DetachedHidden, "layer_in_forward": LayerInForward, "sorted_unshuffled": SortedUnshuffled,
    "step_forgotten": StepForgotten, "loss_not_returned": LossNotReturned, "round_in_loss": RoundInLoss,
    "layers_in_list": LayersInList, "clip_to_zero": ClipToZero, "rnn_batch_first": RnnBatchFirst,
    "view_for_transpose": ViewForTranspose, "warm_up_endless": WarmUpEndless, "adam_eps_large": AdamEpsLarge,
    "plateau_watching_a_rise": PlateauWatchingARise, "head_replaced_late": HeadReplacedLate,
    "scheduler_stepped_twice": SchedulerSteppedTwice, "weight_decay_huge": WeightDecayHuge,
    "gradient_clip_tiny": FaultProgram,
    "optimizer_unwrapped": OptimizerUnwrapped, "optimizer_in_step": OptimizerInStep,
}


def build_silent(program: Program) -> FaultProgram:
    return SILENT[str(program.silent)](program)


__all__ = ["SILENT", "build_silent"]
