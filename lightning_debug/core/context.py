"""What a training framework tells a run: where files go, who writes, how to reach the model and loggers. Each
adapter subclasses :class:`RunContext`; a hand-written loop or a test overrides only what it has.

Example::

    >>> import torch
    >>> class Loop(RunContext):
    ...     def module(self): return torch.nn.Linear(2, 1)
    >>> [name for name, _ in Loop().named_parameters()], RunContext().world_size, RunContext().all_reduce()
    (['weight', 'bias'], 1, None)
"""

from __future__ import annotations

import contextlib
import math
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_debug.core.ledger import RunLedger
from lightning_debug.core.metrics import MetricsSink
from lightning_debug.core.numerics import AllGather, AllReduce
from lightning_debug.core.session import Where
from lightning_debug.core.strenum import StrEnum

HistogramWriter = Callable[[str, dict[str, Any], int], None]
Replay = Callable[[Any], "torch.Tensor | None"]


SIGNAL_EXITS = frozenset({0, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM})


def exit_code(error: BaseException | None) -> int | None:
    """The process exit status a ``SystemExit`` asks for (``sys.exit("message")`` is 1); None for other errors."""
    if not isinstance(error, SystemExit):
        return None
    code = error.code
    return 0 if code is None else int(code) if isinstance(code, int) else 1


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper(s) (Accelerate's ``AcceleratedOptimizer``), where its step
    hooks fire::

        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> class Wrapper:
        ...     optimizer = sgd
        >>> torch_optimizer(Wrapper()) is sgd, torch_optimizer(sgd) is sgd
        (True, True)
    """
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class RunStatus(StrEnum):
    """How a run ended (``status`` of report.json); ``UNKNOWN``: a report rebuilt offline from a run that wrote none.

        >>> RunStatus.of(None), RunStatus.of(KeyboardInterrupt()), RunStatus.of(ValueError("x"))
        (<RunStatus.FINISHED: 'finished'>, <RunStatus.INTERRUPTED: 'interrupted'>, <RunStatus.FAILED: 'failed'>)
        >>> RunStatus.of(SystemExit(143)), RunStatus.of(SystemExit(3)), exit_code(SystemExit(3))
        (<RunStatus.INTERRUPTED: 'interrupted'>, <RunStatus.FAILED: 'failed'>, 3)
        >>> RunStatus.parse("failed") is RunStatus.FAILED, str(RunStatus.FINISHED)
        (True, 'finished')
    """

    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    UNKNOWN = "unknown"

    @classmethod
    def of(cls, error: BaseException | None) -> "RunStatus":
        """The status of a run that ended with ``error`` (None: finished). Ctrl-C, SIGTERM (Lightning's
        ``SIGTERMException``) and an exit with no code or a signal's are interruptions; any other error failed."""
        if error is None:
            return cls.FINISHED
        if isinstance(error, KeyboardInterrupt):
            return cls.INTERRUPTED
        if isinstance(error, SystemExit):
            asked = any(kind.__name__ == "SIGTERMException" for kind in type(error).__mro__)
            return cls.INTERRUPTED if asked or exit_code(error) in SIGNAL_EXITS else cls.FAILED
        return cls.FAILED

    @classmethod
    def parse(cls, value: "RunStatus | str") -> "RunStatus":
        """A status given as the enum or its string."""
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            allowed = ", ".join(status.value for status in cls)
            raise ValueError(f"a run status is one of {allowed}, got {value!r}") from None


def epoch_end(step: int, batch: Any, batches: Any, accumulate: int) -> int | None:
    """The last optimizer step of ``step``'s epoch, from its first micro-batch's index ``batch``, the epoch's
    ``batches`` and the micro-batches per step (None when either is unknown).

        >>> epoch_end(12, batch=2, batches=10, accumulate=1), epoch_end(3, batch=4, batches=8, accumulate=2)
        (19, 4)
    """
    if not isinstance(batches, int) or batches <= 0 or not isinstance(batch, int) or batch < 0:
        return None
    accumulate = max(1, accumulate)
    return step + max(0, math.ceil(batches / accumulate) - 1 - batch // accumulate)


class RunContext:
    """What a training framework tells a run; the defaults: a single process that writes no files and logs nowhere."""

    output_dir: Path | None = None
    output_problem: str | None = None  # why output_dir is None although files were asked for
    run_id: str | None = None
    is_global_zero: bool = True
    world_size: int = 1
    rank: int = 0
    # Plain (non-DTensor) parameters are per-rank shards: FSDP1 flat parameters, DeepSpeed ZeRO.
    grads_sharded: bool = False
    uses_grad_scaler: bool = False
    log_every_n_steps: int | None = None  # the framework's logging cadence (None: every check step; 0: none)
    logs_rows: bool = False
    """Whether the adapter logs the scalars on the framework's own rows (``MetricsWriter.take``), not the sink."""
    ledger: RunLedger | None = None  # set by the run that uses this context: where the loop is

    @property
    def optimizer_index(self) -> int | None:
        """With several optimizers, the position of the one being stepped (events carry it); None otherwise."""
        return self.ledger.record.optimizer_index if self.ledger is not None else None

    def device(self) -> torch.device | None:
        return None

    def module(self) -> nn.Module | None:
        return None

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        module = self.module()
        return module.named_parameters() if module is not None else iter(())

    def trainable_before_start(self) -> list[nn.Parameter] | None:
        """The parameters that had ``requires_grad=True`` when the run first saw the model, before the framework
        built the optimizer (Lightning: the callbacks' ``setup``); None when the run first sees the model at its
        start (Accelerate: it arrives prepared). A parameter frozen since then but still in a param group is a
        freeze left over; one its module built frozen (a sinusoidal position table) is frozen by design."""
        return None

    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of every optimizer of the run."""
        return [group for optimizer in self.optimizers() for group in optimizer.param_groups]

    def optimizers(self) -> list[Any]:
        """The run's optimizers, in the user's order (with several, each step is judged on the one stepped)."""
        return []

    def where(self) -> Where:
        """The position events are labelled with (epoch, batch index)."""
        return {"epoch": 0, "batch": 0}

    def metrics_sink(self) -> MetricsSink | None:
        return None

    def console_printer(self) -> Callable[[str], None] | None:
        """Where console lines go while the run is live (the progress bar's ``print``); None: ``stderr``."""
        return None

    def exposed_metrics_sink(self) -> Callable[[dict[str, float]], None] | None:
        """Where ``DebugConfig.expose_callback_metrics`` puts a few debug values (Lightning: ``callback_metrics``)."""
        return None

    def artifact_stores(self) -> list[tuple[str, Any, str | None]]:
        """The loggers' runs that take the report files: ``("wandb", run, None)``, ``("mlflow", client, run_id)``."""
        return []

    def all_gather(self) -> AllGather | None:
        """Gathers a 1-d tensor from every rank (``[world, n]``); None on one process."""
        return None

    def all_reduce(self) -> AllReduce | None:
        """Sums a tensor over every process in place (the WORLD group); None on one process."""
        if self.world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return lambda tensor: dist.all_reduce(tensor)
        return None

    def histogram_writer(self) -> tuple[HistogramWriter | None, str]:
        """A writer of raw histograms (TensorBoard), or None and the names of the loggers that cannot."""
        return None, "no logger"

    def tensorboard_writers(self) -> list[tuple[Any, str | None]]:
        """TensorBoard ``SummaryWriter`` objects to receive the layout and the events, with their log dirs."""
        return []

    def grad_scale(self) -> torch.Tensor | None:
        """The loss scale the gradients still carry at the optimizer step (None once unscaled)."""
        return None

    def gradient_clipping(self) -> tuple[float, str] | None:
        """The clipping applied after the checks saw the gradients: ``(value, "norm" | "value")``, or None."""
        return None

    def schedule(self) -> tuple[int | None, list[str]]:
        """The run's length in optimizer steps (None: unknown) and its schedulers' class names: what tells a
        schedule that ends at 0 from one that stops training early."""
        return None, []

    def epoch_end_step(self, step: int, where: Where) -> int | None:
        """The last optimizer step of ``step``'s epoch (None: unknown, as for an iterable dataset)."""
        return None

    def loss_divisor(self) -> int:
        """How many times smaller the loss handed to ``before_backward`` is than the one the user's step computed:
        the rules that hold the loss against a bound of its own (``log C`` at chance, a softmax's floor) multiply it
        back. 1 where the loop passes the loss it computed."""
        return 1

    def backward_divisor(self) -> int:
        """How many times smaller the loss the backward differentiates is than the one handed to ``before_backward``:
        what the output's gradient is read against. 1 where the loss handed is the one differentiated."""
        return 1

    def train_loader(self) -> Any:
        return None

    def muted(self) -> contextlib.AbstractContextManager[Any]:
        """A block in which the model runs again for a check: what it logs is dropped (a ``self.log`` in
        ``forward`` must not log the check's rows)."""
        return contextlib.nullcontext()

    def forward_call(self, captured: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None:
        """The model's forward call a micro-batch's ``captured`` stands for, where the adapter captured one (an
        Accelerate loop's); None where the step's first module call is watched instead (a ``training_step``)."""
        return None

    def profiler_in_use(self) -> str | None:
        """Who else records this run with torch.profiler, in a sentence (None: nobody). torch runs one profiler at a
        time, so the ``profile_steps`` window is then skipped and says this sentence once."""
        return None

    def replay(self) -> Replay | None:
        """Recomputes the loss of a captured micro-batch (``level=ADVANCED`` localization), or None."""
        return None

    def replay_scope(self) -> str | None:
        """What the last replay could not recompute (None: it recomputed the loss): a replay that reproduces nothing
        then points there instead of at non-determinism."""
        return None
