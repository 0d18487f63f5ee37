"""Two-process CPU DDP run used by test_distributed.py: a NaN loss on one rank only.

Usage: python tests/ddp_worker.py MODE OUT_DIR NAN_RANK NAN_STEP [STRATEGY]
Each rank writes OUT_DIR/result_<rank>.json with how its training ended.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_debug import AnomalyDetectionCallback  # noqa: E402
from tests.toolkit import TinyRegressor, make_trainer  # noqa: E402


class NaNOnOneRank(TinyRegressor):
    def __init__(self, nan_rank: int, nan_step: int) -> None:
        super().__init__()
        self.nan_rank, self.nan_step = nan_rank, nan_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == self.nan_rank and self.trainer.global_step >= self.nan_step:
            loss = loss + torch.log(torch.zeros(()))
        return loss


def main() -> None:
    mode, out_dir, nan_rank, nan_step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    strategy = sys.argv[5] if len(sys.argv) > 5 else "ddp"
    trainer = make_trainer(out_dir / "run", [AnomalyDetectionCallback(anomaly_detection_mode=mode)], max_steps=12,
                           devices=2, strategy=strategy)
    model = NaNOnOneRank(nan_rank, nan_step)
    outcome: dict[str, Any] = {"exception": None}
    try:
        trainer.fit(model)
    except Exception as error:  # recorded for the test to compare across ranks
        outcome["exception"] = type(error).__name__
        outcome["exception_step"] = getattr(error, "step", None)
    outcome.update(rank=trainer.global_rank, global_step=trainer.global_step, should_stop=trainer.should_stop,
                   params_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                   log_dir=trainer.log_dir if outcome["exception"] is None else None)
    (out_dir / f"result_{trainer.global_rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
