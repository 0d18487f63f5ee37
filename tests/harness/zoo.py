"""A zoo of models nobody here wrote, each in a minimal LightningModule with synthetic data, and the
bugs a user plants in them.

The models are Hugging Face ``transformers`` models built from tiny configs (no weights downloaded),
Lightning's own ``lightning.pytorch.demos`` models, a deep MLP with LayerNorm+GELU, a two-optimizer
GAN in the form of Lightning's manual-optimization example, and the demos' LSTM language model. Each
trains on CPU in about a second for a few dozen steps. ``transformers`` is a test dependency only: it
is imported when a model of it is built, so this module imports without it.

A :class:`Plant` describes the bug: ``log(0)`` in the loss at one step, a NaN sample in one batch, a
learning rate far too high, a layer that is never used, losses kept with their graph, a dataset
that sleeps in ``__getitem__``, a ``training_step`` that returns ``None``. :func:`build` gives the
module with the plant in it; :func:`fit` trains it with the debug callbacks and reads back what the
run wrote.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_debug import DebugConfig, debug_callbacks
from tests.harness.toolkit import debug_dir, make_trainer, read_events, read_report

SERIOUS = ("warning", "error", "critical")


# --- the plants -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plant:
    """One bug a user would make; the default is a healthy run.

    Args:
        log_zero_at: At this optimizer step the loss adds ``log(0 * loss)``: the loss is -inf and the
            gradients NaN (the derivative of log at 0 times 0), as when a probability underflows to 0
            under a ``log``.
        nan_input_at: The batch of this step (shuffle off) holds NaN in sample ``nan_sample``.
        nan_sample: Index of the poisoned sample within its batch.
        lr: AdamW with this learning rate instead of the model's own optimizer (``lr=10`` diverges).
        unused_layer: The module gets a layer ``unused_layer`` that ``forward`` never calls.
        keep_graph: Every loss is appended to a list with its graph (``losses.append(loss)``): a leak.
        data_sleep_s: The dataset sleeps this long per sample in ``__getitem__`` (``num_workers=0``).
        return_none_every: ``training_step`` returns ``None`` (Lightning skips the step) on every
            N-th batch; not a bug, a documented Lightning feature.
        lr_zero_after: A ``LambdaLR`` (stepped every optimizer step) keeps the learning rate until this
            step and sets it to 0 from then on: the common schedule bug that silently stops learning.
        sleep_every: ``training_step`` sleeps ``sleep_s`` on every N-th step (the shape of a synchronous
            checkpoint save, a logging flush or a GC pause).
        inplace_nan_at: At this step the loss adds ``z /= z.std()`` of a constant feature (no gradient, like
            an input normalised in place in ``training_step``): an in-place division 0/0 that makes the NaN.
        masked_softmax_at: At this step the loss adds ``softmax`` of a row that ``masked_fill(-inf)``
            masked entirely (a fully masked attention row): the softmax makes the NaN.
        sqrt_zero_at: At this step the loss adds ``sqrt`` of a squared distance that is 0 (a triplet loss
            of identical embeddings): finite forward, NaN gradient.
        bad_label_at: The batch of this step gets a label out of range in sample 0 (the number of
            classes, or the vocabulary size for token labels), passed to the model's own loss.
    """

    log_zero_at: int | None = None
    nan_input_at: int | None = None
    nan_sample: int = 1
    lr: float | None = None
    unused_layer: bool = False
    keep_graph: bool = False
    data_sleep_s: float = 0.0
    return_none_every: int | None = None
    lr_zero_after: int | None = None
    sleep_every: int | None = None
    sleep_s: float = 0.2
    inplace_nan_at: int | None = None
    masked_softmax_at: int | None = None
    sqrt_zero_at: int | None = None
    bad_label_at: int | None = None


HEALTHY = Plant()


class DictDataset(Dataset):
    """Samples as dicts of tensors (what a Hugging Face model takes as keyword arguments)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.length = len(next(iter(tensors.values())))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}


class PlantedDataset(Dataset):
    """A dataset with the data plants: a NaN in one sample, a sleep per sample."""

    def __init__(self, base: Dataset, poisoned_index: int | None, sleep_s: float) -> None:
        self.base, self.poisoned_index, self.sleep_s = base, poisoned_index, sleep_s

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        sample = self.base[index]
        if index == self.poisoned_index:
            sample = _poison(sample)
        return sample

    @staticmethod
    def wrap(base: Dataset, plant: Plant, batch_size: int) -> Dataset:
        if plant.nan_input_at is None and not plant.data_sleep_s:
            return base
        poisoned = None if plant.nan_input_at is None else plant.nan_input_at * batch_size + plant.nan_sample
        return PlantedDataset(base, poisoned, plant.data_sleep_s)


def _poison(sample: Any) -> Any:
    """The sample with its first floating tensor's first element set to NaN."""
    if isinstance(sample, torch.Tensor):
        if sample.is_floating_point():
            sample = sample.clone()
            sample.view(-1)[0] = float("nan")
        return sample
    if isinstance(sample, dict):
        key = next(k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        return dict(sample, **{key: _poison(sample[key])})
    if isinstance(sample, (tuple, list)):
        index = next(i for i, v in enumerate(sample) if isinstance(v, torch.Tensor) and v.is_floating_point())
        items = list(sample)
        items[index] = _poison(items[index])
        return type(sample)(items)
    raise TypeError(f"no floating tensor to poison in {type(sample).__name__}")


class Planted:
    """Mixin (before the LightningModule) that puts a :class:`Plant` into a module's own training step."""

    plant: Plant

    def setup_plant(self, plant: Plant) -> None:
        self.plant = plant
        self.kept_losses: list[torch.Tensor] = []
        if plant.unused_layer:
            self.unused_layer = nn.Linear(8, 8)

    def planted_loss(self, loss: torch.Tensor) -> torch.Tensor:
        step = self.trainer.global_step  # type: ignore[attr-defined]
        plant = self.plant
        if plant.log_zero_at is not None and step == plant.log_zero_at:
            loss = loss + torch.log(loss * 0.0)
        if plant.inplace_nan_at == step:
            z = (loss.detach() * 0.0).expand(4).clone()  # a constant feature, normalised in place: 0/0
            z /= z.std()
            loss = loss + z.sum()
        if plant.masked_softmax_at == step:
            scores = torch.stack([loss, loss, loss]).unsqueeze(0)
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))
            loss = loss + scores.softmax(dim=-1).sum()
        if plant.sqrt_zero_at == step:
            anchor = loss.expand(4)
            loss = loss + (anchor - anchor).pow(2).sum().sqrt()
        if plant.sleep_every is not None and step % plant.sleep_every == plant.sleep_every - 1:
            time.sleep(plant.sleep_s)
        if self.plant.keep_graph:
            self.kept_losses.append(loss)
        return loss

    def skips(self, batch_idx: int) -> bool:
        every = self.plant.return_none_every
        return every is not None and batch_idx % every == every - 1

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.skips(batch_idx):
            return None
        out = super().training_step(batch, batch_idx)  # type: ignore[misc]
        if isinstance(out, dict):
            return dict(out, loss=self.planted_loss(out["loss"]))
        return self.planted_loss(out)

    def planted_optimizer(self, default: Callable[[], Any]) -> Any:
        optimizer = (torch.optim.AdamW(self.parameters(), lr=self.plant.lr)  # type: ignore[attr-defined]
                     if self.plant.lr is not None else default())
        after = self.plant.lr_zero_after
        if after is not None and isinstance(optimizer, (tuple, list)):  # ([optimizers], [schedulers])
            optimizer = optimizer[0][0]
        if after is None or not isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < after else 0.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_optimizers(self) -> Any:
        return self.planted_optimizer(super().configure_optimizers)  # type: ignore[misc]


# --- Hugging Face transformers from tiny configs -------------------------------------------------------------


class HFModule(Planted, pl.LightningModule):
    """A ``transformers`` model trained the way its docs show: ``model(**batch).loss``, AdamW."""

    def __init__(self, model: nn.Module, data: DictDataset, lr: float = 1e-3, batch_size: int = 8,
                 plant: Plant = HEALTHY, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model, self.data, self.lr, self.batch_size, self.optimizer_name = model, data, lr, batch_size, optimizer
        self.setup_plant(plant)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if self.skips(batch_idx):
            return None
        if self.plant.bad_label_at == self.trainer.global_step and "labels" in batch:
            labels = batch["labels"].clone()
            config = self.model.config
            if labels.dim() > 1:  # token labels (a causal LM shifts them: the last position is always used)
                labels[0, -1] = config.vocab_size
            else:
                labels[0] = config.num_labels
            batch = dict(batch, labels=labels)
        return self.planted_loss(self.model(**batch).loss)

    def configure_optimizers(self) -> Any:
        def default() -> torch.optim.Optimizer:
            if self.optimizer_name == "sgd":
                return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return self.planted_optimizer(default)

    def train_dataloader(self) -> DataLoader:
        shuffle = self.plant.nan_input_at is None
        return DataLoader(PlantedDataset.wrap(self.data, self.plant, self.batch_size), batch_size=self.batch_size,
                          shuffle=shuffle, num_workers=0)


def _tokens(samples: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab, (samples, length), generator=torch.Generator().manual_seed(seed))


def bert(plant: Plant = HEALTHY) -> HFModule:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    ids = _tokens(256, 16, 128, seed=1)
    labels = (ids[:, 0] > 64).long()
    data = DictDataset({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return HFModule(BertForSequenceClassification(config), data, lr=1e-3, plant=plant)


def gpt2(plant: Plant = HEALTHY) -> HFModule:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    ids = _tokens(256, 16, 128, seed=2)
    return HFModule(GPT2LMHeadModel(config), DictDataset({"input_ids": ids, "labels": ids}), lr=1e-3, plant=plant)


def resnet(plant: Plant = HEALTHY) -> HFModule:
    """A ResNet of basic blocks (ResNet-18's layout, narrower and with one block per stage), SGD lr 0.05."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=4)
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (256,), generator=generator)
    patterns = torch.randn(4, 3, 32, 32, generator=generator)
    pixels = torch.randn(256, 3, 32, 32, generator=generator) + patterns[labels]  # learnable: a pattern per class
    return HFModule(ResNetForImageClassification(config), DictDataset({"pixel_values": pixels, "labels": labels}),
                    lr=0.05, batch_size=16, plant=plant, optimizer="sgd")


def t5(plant: Plant = HEALTHY) -> HFModule:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ids = _tokens(256, 16, 128, seed=4)
    return HFModule(T5ForConditionalGeneration(config), DictDataset({"input_ids": ids, "labels": ids.flip(1)}),
                    lr=1e-3, plant=plant)


# --- lightning.pytorch.demos -----------------------------------------------------------------------------------


def demo_transformer(plant: Plant = HEALTHY) -> pl.LightningModule:
    """``LightningTransformer`` as shipped (its model, ``training_step`` and SGD lr 0.1), on synthetic
    WikiText2-like blocks: 35 tokens and the same 35 shifted by one, from a small vocabulary."""
    from lightning.pytorch.demos import LightningTransformer

    class ZooTransformer(Planted, LightningTransformer):
        def __init__(self) -> None:
            super().__init__(vocab_size=256)
            self.setup_plant(plant)

        def prepare_data(self) -> None:
            """No download: the data is synthetic."""

        def train_dataloader(self) -> DataLoader:
            stream = _tokens(1, 64 * 36, 256, seed=5).view(-1)
            blocks = [(stream[i * 35:(i + 1) * 35], stream[i * 35 + 1:(i + 1) * 35 + 1]) for i in range(64)]
            return DataLoader(blocks, batch_size=4, shuffle=plant.nan_input_at is None)

    torch.manual_seed(0)
    return ZooTransformer()


def boring(plant: Plant = HEALTHY) -> pl.LightningModule:
    """``BoringModel`` as shipped (SGD lr 0.1 with StepLR), batches of 4 random 32-vectors."""
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    class ZooBoring(Planted, BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.setup_plant(plant)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(PlantedDataset.wrap(RandomDataset(32, 256), plant, 4), batch_size=4)

    torch.manual_seed(0)
    return ZooBoring()


def lstm(plant: Plant = HEALTHY) -> pl.LightningModule:
    """``LightningLSTM`` as shipped (hidden state carried and detached across batches, SGD lr 20), with a
    smaller ``SimpleLSTM`` (2 layers of 64) on synthetic tokens; trained as PyTorch's word language model
    example trains it, with gradients clipped at 0.25 (see :data:`TRAINER_OPTIONS`)."""
    from lightning.pytorch.demos.lstm import LightningLSTM, SequenceSampler, SimpleLSTM

    class ZooLSTM(Planted, LightningLSTM):
        def __init__(self) -> None:
            super().__init__(vocab_size=256)
            self.model = SimpleLSTM(vocab_size=256, ninp=64, nhid=64, nlayers=2)
            self.setup_plant(plant)

        def prepare_data(self) -> None:
            """No download: the data is synthetic."""

        def train_dataloader(self) -> DataLoader:
            stream = _tokens(1, 400 * 36, 256, seed=6).view(-1)
            blocks = [(stream[i * 35:(i + 1) * 35], stream[i * 35 + 1:(i + 1) * 35 + 1]) for i in range(400)]
            return DataLoader(blocks, batch_sampler=SequenceSampler(blocks, batch_size=8))

    torch.manual_seed(0)
    return ZooLSTM()


# --- a deep MLP, a GAN ---------------------------------------------------------------------------------------------


class DeepMLP(Planted, pl.LightningModule):
    """24 blocks of Linear -> LayerNorm -> GELU (pre-activation residual-free, as in many tabular nets),
    Adam lr 1e-4, regression on 32 features."""

    def __init__(self, plant: Plant = HEALTHY, depth: int = 24, width: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(32, width)]
        for _ in range(depth - 1):
            layers += [nn.LayerNorm(width), nn.GELU(), nn.Linear(width, width)]
        layers += [nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers)
        self.setup_plant(plant)
        generator = torch.Generator().manual_seed(7)
        inputs = torch.randn(512, 32, generator=generator)
        self.data = (inputs, (inputs[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(512, 1, generator=generator)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.skips(batch_idx):
            return None
        x, y = batch
        return self.planted_loss(nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return self.planted_optimizer(lambda: torch.optim.Adam(self.parameters(), lr=1e-4))

    def train_dataloader(self) -> DataLoader:
        dataset = torch.utils.data.TensorDataset(*self.data)
        return DataLoader(PlantedDataset.wrap(dataset, self.plant, 16), batch_size=16,
                          shuffle=self.plant.nan_input_at is None)


def mlp24(plant: Plant = HEALTHY) -> DeepMLP:
    torch.manual_seed(0)
    return DeepMLP(plant)


class GAN(pl.LightningModule):
    """Lightning's manual-optimization GAN example: a generator and a discriminator, one Adam each,
    both stepped in every ``training_step`` (generator first), on 2-D points from a ring.

    ``toggle=False`` leaves out ``toggle_optimizer``/``untoggle_optimizer``, as many GAN loops do: the
    generator's backward then also fills the discriminator's gradients, which its ``zero_grad`` clears.
    """

    def __init__(self, latent: int = 8, toggle: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent, self.toggle = latent, toggle
        self.generator = nn.Sequential(nn.Linear(latent, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2),
                                       nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2),
                                           nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.size(0), self.latent, device=real.device)
        bce = nn.functional.binary_cross_entropy_with_logits

        if self.toggle:
            self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), torch.ones(real.size(0), 1, device=real.device))
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        real_loss = bce(self.discriminator(real), torch.ones(real.size(0), 1, device=real.device))
        fake_loss = bce(self.discriminator(fake.detach()), torch.zeros(real.size(0), 1, device=real.device))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        d_opt.step()
        d_opt.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(d_opt)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self) -> Any:
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        d_opt = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [g_opt, d_opt]

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(8)
        angle = 2 * math.pi * torch.rand(512, generator=generator)
        points = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(512, 2, generator=generator)
        return DataLoader(torch.utils.data.TensorDataset(points), batch_size=32, shuffle=True)


def gan(plant: Plant = HEALTHY) -> GAN:
    if plant != HEALTHY:
        raise ValueError("the GAN takes no plant")
    torch.manual_seed(0)
    return GAN()


def gan_untoggled(plant: Plant = HEALTHY) -> GAN:
    if plant != HEALTHY:
        raise ValueError("the GAN takes no plant")
    torch.manual_seed(0)
    return GAN(toggle=False)


BUILDERS: dict[str, Callable[[Plant], pl.LightningModule]] = {
    "bert": bert, "gpt2": gpt2, "resnet": resnet, "t5": t5, "demo_transformer": demo_transformer,
    "boring": boring, "mlp24": mlp24, "gan": gan, "gan_untoggled": gan_untoggled, "lstm": lstm,
}
TRANSFORMERS_MODELS = frozenset({"bert", "gpt2", "resnet", "t5"})
# What the model's own recipe sets on the Trainer (PyTorch's word language model clips at 0.25).
TRAINER_OPTIONS: dict[str, dict[str, Any]] = {"lstm": {"gradient_clip_val": 0.25}}
# What the kept graph of each model's loss is: the leak explanation must name it.
LOSS_GRAD_FN = {"mlp24": "MseLossBackward0", "gpt2": "NllLossBackward0", "bert": "NllLossBackward0",
                "demo_transformer": "NllLossBackward0", "lstm": "NllLossBackward0", "boring": "MseLossBackward0"}


def build(name: str, plant: Plant = HEALTHY) -> pl.LightningModule:
    return BUILDERS[name](plant)


# --- running and reading back ------------------------------------------------------------------------------------


def every_check(**overrides: Any) -> DebugConfig:
    """Every callback, every check run often: anomaly and performance every step, gradients every
    2nd, memory every 5th optimizer step."""
    options: dict[str, Any] = dict(anomaly_check_frequency=1, gradient_checking_frequency=2,
                                   memory_profiling_frequency=5, performance_profiling_frequency=1,
                                   print_summary=False, save_plots=False)
    options.update(overrides)
    return DebugConfig(**options)


def defaults(**overrides: Any) -> DebugConfig:
    """The defaults a new user gets (no summary printed, no plot drawn: output only, no check changes)."""
    return DebugConfig(**dict(dict(print_summary=False, save_plots=False), **overrides))


@dataclasses.dataclass
class Result:
    """What a zoo run wrote: events.jsonl, report.json, and the wall time of ``fit``."""

    events: list[dict[str, Any]]
    report: dict[str, Any]
    seconds: float
    module: pl.LightningModule

    def nonfinite_state(self) -> list[str]:
        """The module's parameters and buffers that hold NaN/Inf after the run."""
        state = list(self.module.named_parameters()) + list(self.module.named_buffers())
        return [name for name, tensor in state
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]

    def starts(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind and e.get("episode") != "end"]

    def first_step(self, kind: str) -> int | None:
        steps = [e["step"] for e in self.starts(kind)]
        return min(steps) if steps else None

    def serious(self) -> list[dict[str, Any]]:
        """Every finding of severity warning or above (events, then report kinds no event shows)."""
        found = [e for e in self.events if e.get("severity") in SERIOUS and e.get("episode") != "end"]
        kinds = {e["kind"] for e in found}
        found += [dict(entry, kind=kind, step=entry.get("first_step"), message=entry.get("first_message"))
                  for kind, entry in self.report.get("findings", {}).items()
                  if entry.get("severity") in SERIOUS and kind not in kinds]
        return found

    def alarms(self) -> str:
        """One line per serious finding, for assertion messages: ``kind@step: message``."""
        lines = [f"{e['kind']}@{e.get('step')}: {str(e.get('message'))[:300]}" for e in self.serious()]
        lines += [f"failed check {name}: {entry}" for name, entry in self.report.get("failed_checks", {}).items()]
        return "\n".join(lines) or "none"

    def findings_order(self) -> list[str]:
        """The kinds in the order report.json (and report.md) lists them."""
        return list(self.report.get("findings", {}))


def fit(name: str, plant: Plant, config: DebugConfig, root: Path, max_steps: int, **trainer_options: Any) -> Result:
    """Train zoo model ``name`` with ``plant`` under every callback ``config`` enables, on CPU."""
    module = build(name, plant)
    options = dict(TRAINER_OPTIONS.get(name, {}), limit_val_batches=0)
    options.update(trainer_options)
    trainer = make_trainer(root, debug_callbacks(config), max_steps=max_steps, **options)
    started = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - started
    directory = debug_dir(trainer)
    return Result(read_events(directory), read_report(directory), seconds, module)
