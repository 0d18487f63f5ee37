"""Memory and performance bugs, re-created in Lightning: what the memory and performance callbacks are for.

Each is a subclass of :class:`~benchmarks.faults.programs.FaultProgram` with the user's mistake; with
``Program(fixed=True)`` the same subclass runs the corrected code. Written from the published descriptions,
not from anyone's code:

- memory, the PyTorch FAQ ("My model reports cuda runtime error(2): out of memory": *don't accumulate history
  across your training loop*, ``total_loss += loss``), Lightning 2.0's migration of ``training_epoch_end``
  (outputs are no longer collected and freed by the trainer: the module appends them and must ``clear()`` the
  list itself), a memory bank of negatives that only grows (MoCo's queue is bounded), a running statistic carried
  across steps with its graph and ``retain_graph=True`` added to silence "Trying to backward through the graph a
  second time" (the PyTorch forum's recurring thread), and out-of-memory, a failure category of its own in Zhang
  et al., ICSE 2020 ("An Empirical Study on Program Failures of Deep Learning Jobs", 4960 failures of Microsoft's
  platform; GPU out of memory is the most common deep-learning-specific one), here from one record far longer than
  the rest fed to a quadratic attention, and a Dataset whose cache only grows in its DataLoader workers
  (pytorch/pytorch#62066);
- performance, the PyTorch performance tuning guide (load data asynchronously: ``num_workers=0`` with a costly
  ``__getitem__`` runs every transform on the training loop's thread) and Cao et al., FSE 2022
  ("Understanding Performance Problems in Deep Learning Systems": slow data preparation, blocking work in the
  training loop), here a blocking write every N steps.

Blocking I/O (a disk or network read per sample, a synchronous upload) is ``time.sleep``: it is what such a
call costs the loop, whatever the machine. ``host_sync`` is not here: it is judged on CUDA at level EXPERT only
(on a CPU a ``.item()`` waits for nothing), and ``memory_high`` would need the machine's memory filled to 90%.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from benchmarks.faults.programs import FaultProgram, Program, data


class _Hidden(FaultProgram):
    """A program whose training step also has the last hidden layer (the embeddings a user keeps)."""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer, act in zip(self.layers, self.acts):
            h = act(layer(h))
        return h


# --- memory ---------------------------------------------------------------------------------------------
class LossHistory(FaultProgram):
    """The PyTorch FAQ's ``total_loss += loss``: the run's mean training loss summed from the loss tensor, so each
    step's autograd graph stays reachable from the sum (its nodes; the saved tensors go with the backward). The twin
    sums ``loss.item()``."""

    running: Any = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.running = self.running + (loss.item() if self.program.fixed else loss)
        return loss


class OutputsKept(_Hidden):
    """Lightning 2.0's ``training_epoch_end`` migrated by hand: each step's embeddings appended to
    ``self.training_step_outputs`` for an epoch-level metric, never cleared (and kept with their graph); the twin
    appends ``h.detach()`` and clears the list in ``on_train_epoch_end`` as the migration guide does."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.training_step_outputs: list[torch.Tensor] = []
        self.epoch_norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.features(x)
        self.training_step_outputs.append(h.detach() if self.program.fixed else h)
        return self.loss_of(self.head(h), y)

    def on_train_epoch_end(self) -> None:
        kept = torch.cat(self.training_step_outputs[-4:])
        self.epoch_norms.append(float(kept.detach().norm(dim=1).mean()))  # the epoch-level metric
        if self.program.fixed:
            self.training_step_outputs.clear()


class UnboundedBank(_Hidden):
    """A memory bank of negatives (each step's embeddings, detached) of which the loss uses the last ``period``
    batches, kept in a list that only grows; the twin drops what is older (MoCo's bounded queue)."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.bank: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.features(x)
        loss = self.loss_of(self.head(h), y)
        if self.bank:
            negatives = torch.cat(self.bank[-self.program.period:])
            loss = loss + 1e-4 * F.normalize(h, dim=1).matmul(F.normalize(negatives, dim=1).T).pow(2).mean()
        self.bank.append(h.detach())
        if self.program.fixed:
            del self.bank[:-self.program.period]
        return loss


class HooksPerStep(FaultProgram):
    """A forward hook that keeps the first layer's output for inspection, registered in ``training_step`` and never
    removed: every step adds one, so every forward runs all of them and keeps one output per hook (a growth that
    speeds up); the twin registers the hook once and keeps the latest output."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.kept: list[torch.Tensor] = []
        if program.fixed:
            self.layers[0].register_forward_hook(self._keep_latest)

    def _keep(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        self.kept.append(output.detach().clone())

    def _keep_latest(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        self.kept[:] = [output.detach().clone()]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self.program.fixed:
            self.layers[0].register_forward_hook(self._keep)
        return super().training_step(batch, batch_idx)


class RetainedCenter(FaultProgram):
    """A running mean of the first layer's output, subtracted from it (a hand-written centering, as BatchNorm's running
    mean), updated with autograd on: each step's mean hangs on the last one, the second backward raises "Trying to
    backward through the graph a second time", and the user adds ``retain_graph=True``. Every step's graph back to the
    first stays alive and each backward runs through all of them. The twin updates the mean under ``torch.no_grad()``
    and needs no ``retain_graph``."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self.center = torch.zeros(program.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.acts[0](self.layers[0](x))
        if self.training:
            if self.program.fixed:
                with torch.no_grad():
                    self.center = 0.9 * self.center + 0.1 * h.mean(0)
            else:
                self.center = 0.9 * self.center + 0.1 * h.mean(0)
        h = h - self.center
        for layer, act in zip(self.layers[1:], self.acts[1:]):
            h = act(layer(h))
        return self.head(h)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=not self.program.fixed)


class _Decoded(Dataset):
    """Each record decoded (into ``DECODED`` floats) when served and kept, in a cache that only grows in each worker
    process; the twin keeps the last ``period`` (``functools.lru_cache(maxsize=...)``'s bound)."""

    def __init__(self, program: Program) -> None:
        self.inputs, self.targets = data(program).tensors
        self.bound = program.period if program.fixed else None
        self.cache: dict[tuple[int, int], torch.Tensor] = {}
        self.served = 0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        decoded = self.inputs[index].repeat(DECODED // self.inputs.shape[1])
        self.served += 1
        self.cache[(self.served, index)] = decoded  # keyed by each serving: every epoch's copy stays too
        if self.bound is not None and len(self.cache) > self.bound:
            del self.cache[next(iter(self.cache))]
        return decoded[:self.inputs.shape[1]], self.targets[index]


DECODED = 16384
"""Floats of a decoded record (64 KB): a batch of 16 keeps 1 MB."""


class WorkerCache(FaultProgram):
    """A Dataset that keeps every record it decoded (pytorch/pytorch#62066: "Memory Leak Found in Persistent
    DataLoader"; #5902: the training process's own resident set stays flat), read by two persistent workers: the
    cache grows in each worker, where the training process's readings and its tensor census do not look."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Decoded(self.program), batch_size=self.program.batch, num_workers=2, persistent_workers=True)


LONG_RECORD = 200_000
"""Elements of the one long record: padded to it, a batch of 8 asks attention for 8 x 200k x 200k floats (1.3 TB)."""


class _Records(Dataset):
    """Variable-length records of 16-dimensional tokens (8 each), one of them ``LONG_RECORD`` long (a log or document
    nobody filtered); the twin truncates each record to 64 tokens, as a tokenizer's ``max_length`` would."""

    def __init__(self, program: Program) -> None:
        inputs, self.targets = data(program).tensors
        self.records = [row.repeat(8, 1) + 0.1 * torch.randn(8, row.numel()) for row in inputs]
        long_one = program.fault_step * program.batch + 3
        self.records[long_one] = inputs[long_one].repeat(LONG_RECORD, 1)
        if program.fixed:
            self.records = [record[:64] for record in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.records[index], self.targets[index]


def _pad(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_sequence([record for record, _ in items], batch_first=True), torch.stack([y for _, y in items])


class LongRecord(FaultProgram):
    """Self-attention pooling over each record's tokens (scores of every pair of tokens), then the MLP: a batch padded
    to one record of ``LONG_RECORD`` tokens runs out of memory at its step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y = batch
        scores = tokens.matmul(tokens.transpose(1, 2)) / tokens.shape[-1] ** 0.5
        pooled = scores.softmax(-1).matmul(tokens).mean(1)
        return self.loss_of(self(pooled), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Records(self.program), batch_size=self.program.batch, collate_fn=_pad)


# --- performance ----------------------------------------------------------------------------------------
SIGNAL = 1024
"""Samples per feature of a raw record: a record of 16 features is a 16k-sample signal."""


def _decode(signal: torch.Tensor, features: int) -> torch.Tensor:
    """A low-pass filter (FFT, keep the lowest frequencies) and a block average back to ``features`` values: the
    per-record preprocessing (a resampling, a spectrogram) that costs ~0.4 ms a record on one core."""
    spectrum = torch.fft.rfft(signal, dim=-1)
    spectrum[..., signal.shape[-1] // 8:] = 0
    smooth = torch.fft.irfft(spectrum, n=signal.shape[-1], dim=-1)
    return smooth.reshape(*signal.shape[:-1], features, -1).mean(-1)


class _RawRecords(Dataset):
    """Records stored raw (each feature a block of ``SIGNAL`` noisy samples), decoded in ``__getitem__`` and, where
    ``stall_ms`` is set, each read with a blocking call of that many milliseconds (a file on a network disk). The
    twin decodes and reads the whole set once when it is made."""

    def __init__(self, program: Program) -> None:
        inputs, self.targets = data(program).tensors
        g = torch.Generator().manual_seed(program.seed)
        self.raw = inputs.repeat_interleave(SIGNAL, dim=1) + 0.1 * torch.randn(len(inputs), inputs.shape[1] * SIGNAL,
                                                                             generator=g)
        self.features, self.stall = inputs.shape[1], program.stall_ms / 1000
        self.decoded = _decode(self.raw, self.features) if program.fixed else None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decoded is not None:
            return self.decoded[index], self.targets[index]
        if self.stall:
            time.sleep(self.stall)
        return _decode(self.raw[index], self.features), self.targets[index]


class SlowLoader(FaultProgram):
    """Every record decoded (and read) in ``__getitem__`` with ``num_workers=0``: the training loop does the data
    loader's work between steps. The twin decodes once up front (a cached, preprocessed data set)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RawRecords(self.program), batch_size=self.program.batch, shuffle=False, num_workers=0)


class PeriodicWrite(FaultProgram):
    """Every ``period`` steps the training step writes its metrics with a blocking call of ``stall_ms`` (a
    synchronous upload to a tracking server, a file flushed and fsynced); the twin hands the same call to a
    background thread."""

    def __init__(self, program: Program) -> None:
        super().__init__(program)
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        step = self.trainer.global_step
        if step and step % self.program.period == 0:
            seconds = self.program.stall_ms / 1000
            if self.program.fixed:
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(1)
                self._writer.submit(time.sleep, seconds)
            else:
                time.sleep(seconds)
        return loss

    def on_train_end(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)


RESOURCES: dict[str, type[FaultProgram]] = {
    "loss_history": LossHistory, "outputs_kept": OutputsKept, "unbounded_bank": UnboundedBank,
    "retained_center": RetainedCenter, "worker_cache": WorkerCache, "hooks_per_step": HooksPerStep,
    "long_record": LongRecord, "slow_loader": SlowLoader, "periodic_write": PeriodicWrite,
}


def build_resource(program: Program) -> FaultProgram:
    return RESOURCES[str(program.resource)](program)


__all__ = ["RESOURCES", "build_resource"]
