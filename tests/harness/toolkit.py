"""Tiny models with plantable bugs and readers for the files a run leaves behind.

Shared by every test module; everything runs on CPU in seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_debug import DebugConfig
from lightning_debug.core.monitor import Monitor, RunContext
from lightning_debug.run import Run

REPO = Path(__file__).resolve().parents[2]


def regression_data(samples: int = 256, features: int = 8, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    targets = inputs @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


class TinyRegressor(pl.LightningModule):
    """An MLP whose bugs are planted by arguments.

    Args:
        log_zero_from_step: From this optimizer step on, the loss adds ``log(0)`` (a NaN/Inf loss).
        nan_layer_from_step: From this step on, ``hidden``'s output gets a NaN (a NaN in one layer).
        lr: Learning rate of plain SGD; a huge value blows the weights up.
        unused_layer: Add a layer that never takes part in the forward (missing gradients).
    """

    def __init__(self, features: int = 8, hidden: int = 16, lr: float = 0.01, log_zero_from_step: int | None = None,
                 nan_layer_from_step: int | None = None, unused_layer: bool = False,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)
        self.unused = nn.Linear(hidden, hidden) if unused_layer else None
        self.lr = lr
        self.log_zero_from_step = log_zero_from_step
        self.nan_layer_from_step = nan_layer_from_step
        self.optimizer_name = optimizer

    def _planted(self, start: int | None) -> bool:
        return start is not None and self.trainer.global_step >= start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.hidden(h)
        if self._planted(self.nan_layer_from_step):
            h = h + torch.log(-torch.ones_like(h[:, :1]))
        return self.head(torch.relu(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self._planted(self.log_zero_from_step):
            loss = loss + torch.log(torch.zeros((), device=loss.device))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(), batch_size=16, shuffle=True)


class Blobs(pl.LightningModule):
    """Four Gaussian blobs of 16 features (512 samples, shuffled) classified by an MLP of ``hidden`` ReLU layers of
    32, in batches of ``batch``; subclasses give the optimizer."""

    def __init__(self, hidden: int = 1, batch: int = 32) -> None:
        super().__init__()
        self.batch = batch
        torch.manual_seed(0)
        sizes = [16] + [32] * hidden
        layers = [module for a, b in zip(sizes[:-1], sizes[1:]) for module in (nn.Linear(a, b), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        labels = torch.randint(0, 4, (512,), generator=g)
        x = 2.0 * torch.randn(4, 16, generator=g)[labels] + torch.randn(512, 16, generator=g)
        return DataLoader(TensorDataset(x, labels), batch_size=self.batch, shuffle=True)


def make_trainer(root: Path, callbacks: list[pl.Callback], max_steps: int = 20, **kwargs: Any) -> pl.Trainer:
    from lightning.pytorch.loggers import TensorBoardLogger

    options: dict[str, Any] = dict(
        default_root_dir=str(root), max_steps=max_steps, accelerator="cpu", devices=1,
        logger=TensorBoardLogger(str(root), name="tb"), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, log_every_n_steps=1,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def all_four(config: DebugConfig | None = None) -> list[pl.Callback]:
    """The four debug callbacks, sharing one configuration (the defaults without one)."""
    from lightning_debug import (AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback,
                                 PerformanceProfilerCallback)

    settings = config if config is not None else DebugConfig()
    return [AnomalyDetectionCallback(settings), GradientHealthCallback(settings), MemoryProfilerCallback(settings),
            PerformanceProfilerCallback(settings)]


def fit_seeded(root: Path, model: pl.LightningModule, callbacks: list[pl.Callback], max_steps: int,
               **kwargs: Any) -> pl.Trainer:
    """:func:`make_trainer` and ``fit`` after ``seed_everything(0)``, Python warnings silenced (Lightning's own)."""
    import warnings

    pl.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(root, callbacks, max_steps=max_steps, **kwargs)
        trainer.fit(model)
    return trainer


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")
LAUNCH_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "ACCELERATE_", "PL_", "FSDP_")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a test's child processes: ours, one OpenMP thread, and no variable of a process
    group or launcher (``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, torchelastic's, Accelerate's, Lightning's).

    An earlier test, a fixture or the shell that started pytest can leave such variables behind; a child
    that inherits them joins another job's group, takes a port it did not choose or counts the wrong
    number of processes, in the whole suite only.
    """
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCH_VARIABLES and not key.startswith(LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def run_children(command: list[str], timeout_s: float, cwd: Path, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """Run a launcher and every process it starts in a session of their own, stdout and stderr together;
    past ``timeout_s`` the whole session is killed (no rank is left running into the next test) and the test
    fails with the end of the output."""
    import pytest

    launcher = subprocess.Popen(command, cwd=cwd, env=child_env() if env is None else env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        output, _ = launcher.communicate()
        pytest.fail(f"{Path(command[-1]).name if command else command} hung (killed after {timeout_s:.0f} s):\n"
                    f"{output[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signal.SIGKILL)  # a rank its launcher left behind
    return subprocess.CompletedProcess(command, launcher.returncode, output, "")


_FORKED_RANKS: list[int] = []


def fork_ranks(world_size: int = 2) -> int:
    """Start the other ranks of a worker's job as forks of this process and return this one's rank, each with the
    variables torchrun gives its processes (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``,
    ``LOCAL_RANK``, ``RANK``): Lightning then sees a job launched from outside, as under torchrun or SLURM, and
    starts no process of its own. Its subprocess launcher ran the script again for rank 1, which imported lightning
    (with torchmetrics, transformers and scipy, about 7 s of CPU on the 2-core machine) a second time, after rank 0
    had, in every two-rank test. Call it after the imports and before anything starts a thread; a process that a
    launcher started already (``LOCAL_RANK`` set) stays as it is. :func:`exit_worker` waits for the forks."""
    import socket

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), NODE_RANK="0")
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(1, world_size):
        pid = os.fork()
        if pid == 0:
            _FORKED_RANKS.clear()
            os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank))
            return rank
        _FORKED_RANKS.append(pid)
    os.environ.update(LOCAL_RANK="0", RANK="0")
    return 0


def exit_worker() -> None:
    """End a worker process once everything a test reads is written: destroy the default process group, flush the
    console, wait for the ranks :func:`fork_ranks` started (the exit status is the first that failed) and leave
    without the interpreter's finalization.

    A collective right before the interpreter exits (``trainer.log_dir`` broadcasts) can leave gloo's worker thread
    releasing that collective's tensors while Python finalizes; it then needs the GIL and the process aborts
    ("terminate called without an active exception", 2 of 10 two-rank runs with the debug callbacks). Finalizing
    the modules of lightning, torch and transformers also costs 1.5 s of CPU per process, which a two-rank test pays
    twice and the suite thirty times over.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in _FORKED_RANKS]
    os._exit(next((code for code in codes if code != 0), 0))


def debug_dir(trainer: pl.Trainer) -> Path:
    return Path(trainer.log_dir) / "debug_outputs"


def run_dir(directory: Path) -> Path:
    """The latest run's files under a ``debug_output_dir``: the directory itself when it holds them
    (a logger's version directory), else its most recently written ``<run id>`` subdirectory."""
    markers = ("events.jsonl", "report.json")
    if any((directory / marker).exists() for marker in markers):
        return directory
    runs = [path for path in directory.glob("*") if any((path / marker).exists() for marker in markers)]
    if not runs:
        return directory
    return max(runs, key=lambda path: max((path / m).stat().st_mtime_ns for m in markers if (path / m).exists()))


def read_events(directory: Path) -> list[dict[str, Any]]:
    path = directory / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_report(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "report.json").read_text())


def read_scalars(log_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the TensorBoard event files under ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def read_histogram_tags(log_dir: Path | str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"histograms": 0})
    accumulator.Reload()
    return list(accumulator.Tags()["histograms"])


class LoopContext(RunContext):
    """The context of a hand-written training loop: a model, files in a directory, a sink, ranks."""

    def __init__(self, output_dir: Path | None = None, module: nn.Module | None = None,
                 sink: Callable[[dict[str, float], int], None] | None = None,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None, world_size: int = 1,
                 is_global_zero: bool = True) -> None:
        self.output_dir, self._module, self._sink, self._all_gather = output_dir, module, sink, all_gather
        self.world_size, self.is_global_zero = world_size, is_global_zero

    def module(self) -> nn.Module | None:
        return self._module

    def metrics_sink(self) -> Callable[[dict[str, float], int], None] | None:
        return self._sink

    def all_gather(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._all_gather


def plain_run(monitors: list[Monitor], output_dir: Path | None = None, config: DebugConfig | None = None,
              **context: Any) -> Run:
    """A started :class:`Run` of ``monitors`` for a hand-written loop (no summary, no plots by default)."""
    config = config or DebugConfig(print_summary=False, save_plots=False)
    run = Run(config, LoopContext(output_dir, **context), monitors)
    run.start(0)
    return run


@contextlib.contextmanager
def console_lines(match: str | None = None) -> Iterator[list[str]]:
    """The lines the plugin shows on the console (records of the ``lightning_debug`` logger) while the block runs.

    With ``match``, at least one line must match it (``re.search``), as ``pytest.warns(match=...)`` checked when
    findings were Python warnings.
    """
    lines: list[str] = []
    listener = logging.Handler(logging.DEBUG)
    listener.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_debug")
    logger.addHandler(listener)
    try:
        yield lines
    finally:
        logger.removeHandler(listener)
    if match is not None:
        assert any(re.search(match, line) for line in lines), f"no console line matches {match!r}: {lines}"


@contextlib.contextmanager
def fresh_accelerate() -> Iterator[None]:
    """Accelerate's process-wide singletons reset before and after the block, so a test's Accelerator is its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def accelerate_regression(root: Path, model: nn.Module, optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                          after_backward: Callable[[Any, nn.Module, Any], None], epochs: int = 25
                          ) -> list[dict[str, Any]]:
    """``epochs`` of an Accelerate loop over :func:`regression_data` (16 batches an epoch) under an AccelerateDebugger
    with every area (no plots, no summary): ``after_backward(accelerator, model, optimizer)`` runs after each
    ``debugger.backward(loss)`` (the step, or the bug planted instead); the run's events."""
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    with fresh_accelerate():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, project_dir=str(root))
        prepared, built, loader = accelerator.prepare(
            model, optimizer(model), DataLoader(regression_data(), batch_size=16, shuffle=True))
        with AccelerateDebugger(accelerator, prepared, built, DebugConfig(save_plots=False, print_summary=False),
                                train_dataloader=loader) as debugger:
            for _ in range(epochs):
                for x, y in loader:
                    debugger.backward(nn.functional.mse_loss(prepared(x), y))
                    after_backward(accelerator, prepared, built)
    return read_events(run_dir(root / "debug_outputs"))


def as_on_an_accelerator(monkeypatch: Any) -> None:
    """Take the defaults' choice of a GPU on this CPU: no free replay of a NaN's step, its numbers read a step late
    (``pytest.MonkeyPatch``; lightning_debug.monitors.anomaly.replay.replays_for_free)."""
    monkeypatch.setattr("lightning_debug.monitors.anomaly.monitor.replays_for_free", lambda model: False)
