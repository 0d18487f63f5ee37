"""Two-process CPU DDP run used by test_distributed.py: a NaN loss on one rank only.

Usage: python tests/ddp_worker.py MODE OUT_DIR NAN_RANK NAN_STEP [STRATEGY] [--all-four [--level LEVEL]]

``--all-four`` runs every callback of ``debug_callbacks`` with every check on every step (at
``LEVEL``, default basic); otherwise only AnomalyDetectionCallback. Each rank writes
OUT_DIR/result_<rank>.json with how its training ended, the decision it took at each optimizer
step, the steps at which it entered the plugin's collectives, a checksum of its weights and where
its debug session writes (None on the ranks that must not write). Under ``ddp_spawn`` the ranks
write it from inside the spawned processes (the launching process only starts them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_debug import AnomalyDetectionCallback, DebugConfig, debug_callbacks  # noqa: E402
from lightning_debug.callbacks.base import SESSION_ATTRIBUTE  # noqa: E402
from tests.toolkit import TinyRegressor, make_trainer  # noqa: E402

MAX_STEPS = 12


class NaNOnOneRank(TinyRegressor):
    """A NaN/Inf loss on ``nan_rank`` from ``nan_step`` on; records each step's decision on this rank."""

    def __init__(self, nan_rank: int, nan_step: int, out_dir: str = "", write_in_fit_end: bool = False) -> None:
        super().__init__()
        self.nan_rank, self.nan_step = nan_rank, nan_step
        self.out_dir, self.write_in_fit_end = out_dir, write_in_fit_end
        self.decisions: list[list[Any]] = []
        self.gather_steps: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.nan_rank and self.trainer.global_step >= self.nan_step:
            loss = loss + torch.log(torch.zeros(()))
        return loss

    def on_train_start(self) -> None:
        """Count the plugin's collectives: every rank must enter them at the same steps."""
        strategy = self.trainer.strategy
        all_gather = strategy.all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.gather_steps.append(self.trainer.global_step)
            return all_gather(*args, **kwargs)

        strategy.all_gather = counted  # type: ignore[method-assign]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Runs after the callbacks' hook of the same name: a skipped step has no gradients left.
        skipped = all(p.grad is None for group in optimizer.param_groups for p in group["params"])
        decision = "skip" if skipped else "step"
        if self.trainer.should_stop:
            decision += "+stop"
        self.decisions.append([self.trainer.global_step, decision])

    def on_fit_end(self) -> None:
        if self.write_in_fit_end:
            write_outcome(self.trainer, self, Path(self.out_dir), {"exception": None})


def write_outcome(trainer: pl.Trainer, model: NaNOnOneRank, out_dir: Path, outcome: dict[str, Any]) -> None:
    session = getattr(trainer, SESSION_ATTRIBUTE, None)
    output_dir = getattr(session, "output_dir", None)
    events_path = getattr(getattr(session, "events", None), "path", None)
    anomaly = next((c for c in trainer.callbacks if isinstance(c, AnomalyDetectionCallback)), None)
    outcome.update(
        rank=trainer.global_rank, world_size=trainer.world_size, global_step=trainer.global_step,
        should_stop=trainer.should_stop,
        params_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        param_checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
        decisions=model.decisions, gather_steps=model.gather_steps,
        skipped_steps=anomaly.anomalies.skipped_steps if anomaly is not None else None,
        output_dir=str(output_dir) if output_dir is not None else None,
        events_path=str(events_path) if events_path is not None else None,
        is_global_zero=trainer.is_global_zero,
    )
    (out_dir / f"result_{trainer.global_rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("nan_rank", type=int)
    parser.add_argument("nan_step", type=int)
    parser.add_argument("strategy", nargs="?", default="ddp")
    parser.add_argument("--all-four", action="store_true")
    parser.add_argument("--level", default="basic")
    args = parser.parse_args()
    if args.all_four:
        config = DebugConfig(anomaly_detection_mode=args.mode, anomaly_check_frequency=1, gradient_checking_frequency=1,
                             memory_profiling_frequency=1, performance_profiling_frequency=1, log_gradients=True,
                             log_weights=True, level=args.level)
        callbacks = debug_callbacks(config)
    else:
        callbacks = [AnomalyDetectionCallback(anomaly_detection_mode=args.mode)]
    spawned = args.strategy == "ddp_spawn"
    trainer = make_trainer(args.out_dir / "run", callbacks, max_steps=MAX_STEPS, devices=2, strategy=args.strategy)
    model = NaNOnOneRank(args.nan_rank, args.nan_step, str(args.out_dir), write_in_fit_end=spawned)
    outcome: dict[str, Any] = {"exception": None}
    try:
        trainer.fit(model)
    except Exception as error:  # recorded for the test to compare across ranks
        outcome["exception"] = type(error).__name__
        outcome["exception_step"] = getattr(error, "step", None)
        outcome["exception_message"] = str(error)
    if spawned:
        return  # the spawned ranks wrote their results; this process only launched them
    # trainer.log_dir broadcasts (a collective), so it is read only after a clean end
    outcome["log_dir"] = trainer.log_dir if outcome["exception"] is None else None
    write_outcome(trainer, model, args.out_dir, outcome)


if __name__ == "__main__":
    main()
