"""A run SIGKILLed in the middle, used by test_faults.py: the loss is NaN on every 5th optimizer step
(4, 9, 14, ...) up to step KILL_STEP - 4, and the process kills itself with SIGKILL at step KILL_STEP, as an
out-of-memory killer or a scheduler would: no hook, no report, no ``finally``.

Usage: python tests/workers/killed_worker.py OUT_DIR KILL_STEP

The TensorBoard writer is flushed just before the kill (a real kill loses its last unflushed points,
at most 10 of them or 2 minutes' worth); events.jsonl needs nothing, it is flushed per line.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_debug import DebugConfig, debug_callbacks  # noqa: E402
from tests.harness.toolkit import TinyRegressor, make_trainer  # noqa: E402

class NanEveryFifthStep(TinyRegressor):
    def __init__(self, kill_step: int) -> None:
        super().__init__()
        self.kill_step = kill_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if step == self.kill_step:
            self.logger.experiment.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        return loss + torch.log(torch.zeros(())) if step % 5 == 4 and step <= self.kill_step - 4 else loss


def main() -> None:
    out, kill_step = Path(sys.argv[1]), int(sys.argv[2])
    warnings.simplefilter("ignore")
    config = DebugConfig(mode="anomaly_detection", anomaly_detection_mode="warn", print_summary=False)
    trainer = make_trainer(out, debug_callbacks(config), max_steps=kill_step + 10,
                           logger=TensorBoardLogger(str(out), name="tb"))
    trainer.fit(NanEveryFifthStep(kill_step))


if __name__ == "__main__":
    main()
