"""Two-process CPU DDP run (gloo) for the straggler tests: all four callbacks, TensorBoard, every check every step.

Usage: python tests/workers/straggler_worker.py OUT_DIR SLEEP_RANK SLEEP_MS [LOG_EVERY_N_STEPS]

Rank ``SLEEP_RANK`` sleeps ``SLEEP_MS`` milliseconds in every ``training_step`` (a slow rank); ``-1``
plants nothing (a healthy run, where rank 0 still does all the logging and writing: with
``LOG_EVERY_N_STEPS`` 1, Lightning's logging row, which carries every debug scalar, on every step).
Rank 0 writes OUT_DIR/log_dir.txt with where the debug files are.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_debug import DebugConfig, debug_callbacks  # noqa: E402
from tests.harness.toolkit import TinyRegressor, exit_worker, fork_ranks, make_trainer  # noqa: E402

MAX_STEPS = 30


class SlowOnOneRank(TinyRegressor):
    def __init__(self, sleep_rank: int, sleep_ms: float) -> None:
        super().__init__()
        self.sleep_rank, self.sleep_ms = sleep_rank, sleep_ms

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.sleep_rank:
            time.sleep(self.sleep_ms / 1000)
        return super().training_step(batch, batch_idx)


def main() -> None:
    out_dir, sleep_rank, sleep_ms = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    log_every_n_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    warnings.simplefilter("ignore")
    config = DebugConfig(anomaly_check_frequency=1, gradient_checking_frequency=1, memory_profiling_frequency=1,
                         performance_profiling_frequency=1, log_gradients=True, log_weights=True)
    trainer = make_trainer(out_dir / "run", debug_callbacks(config), max_steps=MAX_STEPS, devices=2, strategy="ddp",
                           limit_val_batches=0, log_every_n_steps=log_every_n_steps)
    trainer.fit(SlowOnOneRank(sleep_rank, sleep_ms))
    log_dir = trainer.log_dir
    if trainer.is_global_zero:
        (out_dir / "log_dir.txt").write_text(str(log_dir))


if __name__ == "__main__":
    fork_ranks()
    main()
    exit_worker()
