"""Two-process CPU DDP run used by test_distributed.py: a NaN loss on one rank only.

Usage: python tests/workers/ddp_worker.py MODE OUT_DIR NAN_RANK NAN_STEP [STRATEGY] [--all-four] [--level LEVEL]
                                  [--lightning-launcher]
                                  [--unused-layer] [--fail-writes-rank0] [--fail-check-rank1-step STEP]
                                  [--gather-in-step [--sync-grads]] [--nan-in-backward] [--nan-batch]
                                  [--nan-sample-batchnorm]
                                  [--fail-rank1 {replay,rows,origin,performance}]
                                  [--nan-last STEP] [--max-steps N] [--inject NAME@STEP ...]
                                  [--sweep [--sweep-targets FILE]]

Under ``ddp`` rank 1 is a fork of this process (:func:`~tests.harness.toolkit.fork_ranks`), or with
``--lightning-launcher`` a process Lightning starts by running this script again. ``--all-four`` runs every
callback of ``debug_callbacks`` with every check on every step; otherwise only AnomalyDetectionCallback; both at
``LEVEL`` (default basic). ``--unused-layer`` adds a layer that forward never uses, which DDP (without
``find_unused_parameters``) rejects at the second step. Faults:
``--fail-writes-rank0`` makes every write of rank 0 fail (events, the logger, TensorBoard text, warnings
turned into errors); ``--fail-check-rank1-step`` makes rank 1's own measurement raise at that step;
``--gather-in-step`` calls ``self.all_gather`` inside ``training_step`` (as contrastive losses do),
a collective that a replay of the step must not desynchronise. ``--nan-sample-batchnorm`` puts a
BatchNorm1d after ``inp`` and, instead of the NaN loss, one NaN sample in the batch of NAN_STEP on
NAN_RANK only (its forward poisons that rank's running statistics). Each rank writes
OUT_DIR/result_<rank>.json with how its training ended, the decision it took at each optimizer
step, the steps at which it entered the plugin's collectives, a checksum of its weights and where
its debug session writes (None on the ranks that must not write). Under ``ddp_spawn`` the ranks
write it from inside the spawned processes (the launching process only starts them).

Issue 43: ``--nan-last`` ends the NaN at that step; ``--inject Class.method@STEP`` makes that method raise
once on rank 1 at STEP; ``--sweep`` finds every method of the Run and of the monitors that runs during a step
(:mod:`tests.harness.injection`) and injects each on rank 1, once at each kind of step it runs at (NaN,
healthy), one per step from step 0, in one fit of epochs of 7 batches (NaN on rank 1 at odd steps from 3 in
skip mode, so that every other epoch starts at a NaN step; in warn mode from the first step after the healthy
injections, or half the fit, since the weights stay NaN). The result then lists the injections that fired,
the steps each method was called at, what they cover (:func:`~tests.harness.injection.coverage`) and the
collectives the gate made (step, name). ``--sweep-targets`` limits the injections to the (method, NaN step)
pairs listed in that JSON file, each with the steps at which the first fit called it: a second fit for what the
first left.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_debug import AnomalyDetectionCallback, DebugConfig, debug_callbacks  # noqa: E402
from lightning_debug.callbacks.base import RUN_ATTRIBUTE  # noqa: E402
from tests.harness.toolkit import TinyRegressor, exit_worker, fork_ranks, make_trainer  # noqa: E402

MAX_STEPS = 12
SWEEP_EPOCH = 7  # batches per epoch under --sweep: odd, so that epochs start at NaN steps too in skip mode


class NaNOnOneRank(TinyRegressor):
    """A NaN/Inf loss on ``nan_rank`` from ``nan_step`` on; records each step's decision on this rank."""

    def __init__(self, nan_rank: int, nan_step: int, out_dir: str = "", write_in_teardown: bool = False,
                 unused_layer: bool = False, fail_writes_rank0: bool = False,
                 fail_check_rank1_step: int | None = None, gather_in_step: bool = False,
                 nan_sample_batchnorm: bool = False, sync_grads: bool = False,
                 nan_in_backward: bool = False, fail_rank1: str | None = None,
                 nan_batch: bool = False, nan_last: int | None = None, inject: list[str] | None = None,
                 sweep: str | None = None) -> None:
        super().__init__(unused_layer=unused_layer)
        self.nan_last, self.inject, self.sweep = nan_last, inject or [], sweep
        self.injector: Any = None
        self.schedule: Any = None
        self.nan_from: int | None = None  # warn-mode sweep: the first NaN step
        self.during = False
        self.sync_grads, self.nan_in_backward, self.fail_rank1 = sync_grads, nan_in_backward, fail_rank1
        self.nan_batch = nan_batch
        self.norm = torch.nn.BatchNorm1d(16) if nan_sample_batchnorm else None
        self.nan_rank, self.nan_step = nan_rank, nan_step
        self.out_dir, self.write_in_teardown = out_dir, write_in_teardown
        self.fail_writes_rank0, self.fail_check_rank1_step = fail_writes_rank0, fail_check_rank1_step
        self.gather_in_step = gather_in_step
        self.decisions: list[list[Any]] = []
        self.gather_steps: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return super().forward(x)
        return self.head(torch.relu(self.hidden(torch.relu(self.norm(self.inp(x))))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.norm is not None:
            x, y = batch
            if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step:
                x = x.clone()
                x[0, 0] = float("nan")
            return torch.nn.functional.mse_loss(self(x), y)
        loss = super().training_step(batch, batch_idx)
        if self.gather_in_step:  # every rank's features, as a contrastive loss gathers them
            features = torch.relu(self.inp(batch[0]))
            features = self.all_gather(features, sync_grads=True) if self.sync_grads else self.all_gather(
                features.detach())
            loss = loss + 0.0 * features.mean()
        if self.nan_in_backward and self.global_rank == self.nan_rank and self.trainer.global_step >= self.nan_step:
            # finite forward (sqrt(0) = 0), NaN backward (inf * 0), upstream of the gather's own backward if any
            z = features if self.gather_in_step else self.inp.weight
            return loss + torch.sqrt((z - z.detach()).pow(2).sum())
        if self.nan_batch:
            return loss
        if self.global_rank == self.nan_rank and self.is_nan_step(self.trainer.global_step):
            loss = loss + torch.log(torch.zeros(()))
        return loss

    def is_nan_step(self, step: int) -> bool:
        if self.sweep == "skip":  # with 7 batches an epoch, every other epoch starts at a NaN step
            return step >= 3 and step % 2 == 1
        if self.sweep == "warn":
            return self.nan_from is not None and step >= self.nan_from
        return step >= self.nan_step and (self.nan_last is None or step <= self.nan_last)

    def on_train_start(self) -> None:
        """Count the plugin's collectives (every rank must enter them at the same steps); plant the faults."""
        self.during = True
        if self.injector is not None:
            self.arm_next()
        strategy = self.trainer.strategy
        strategy.all_gather = self._counted(strategy.all_gather)  # type: ignore[method-assign]
        torch.distributed.all_reduce = self._counted(torch.distributed.all_reduce)

    def _counted(self, collective: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.gather_steps.append(self.trainer.global_step)
            return collective(*args, **kwargs)

        return counted

    def on_fit_start(self) -> None:
        run = getattr(self.trainer, RUN_ATTRIBUTE)
        if self.fail_writes_rank0 and self.global_rank == 0:
            def disk_full(*args: Any, **kwargs: Any) -> None:
                raise OSError(28, "No space left on device")

            run.session.emit = disk_full  # every event write
            for callback in self.trainer.callbacks:  # the debug scalars, handed to the loggers' rows
                if getattr(callback, "_rows", None) is not None:
                    callback._rows.hold = disk_full
            for logger in self.trainer.loggers:
                logger.experiment.add_text = disk_full  # TensorBoard text
            warnings.filterwarnings("error", message="lightning-debug")  # a user's -W error
        if self.fail_check_rank1_step is not None and self.global_rank == 1:
            from lightning_debug.core.numerics import ParameterIndex

            local_grads, at, trainer = ParameterIndex.local_grads, self.fail_check_rank1_step, self.trainer

            def failing(index: ParameterIndex) -> Any:
                if trainer.global_step == at:
                    raise RuntimeError("planted failure of this rank's measurement")
                return local_grads(index)

            ParameterIndex.local_grads = failing  # type: ignore[method-assign]
        if self.fail_rank1 is not None:
            self.plant_failure_on_rank1(self.fail_rank1)

    def arm_next(self) -> None:
        """On rank 1, before step ``global_step`` starts: note what fired at the last step, arm this one's."""
        step, injector, schedule = self.trainer.global_step, self.injector, self.schedule
        if self.sweep:
            if injector.step >= 0:
                schedule.result(injector.fired, injector.step, self.is_nan_step(injector.step))
            if self.sweep == "warn" and self.nan_from is None and step >= 6 and (
                    schedule.finished(injector.seen, False) or step >= self.trainer.max_steps // 2):
                self.nan_from = step
            nan = self.is_nan_step(step)
            injector.arm(schedule.next(step, nan, injector.calls), step)
            return
        wanted = {name for name, _, at in (spec.partition("@") for spec in self.inject) if int(at) == step}
        injector.arm((lambda called: called in wanted) if wanted else None, step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.injector is not None:  # after the callbacks' batch end: the next step's injection
            self.arm_next()

    def on_train_end(self) -> None:
        self.during = False

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.nan_batch and self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step:
            x, y = batch
            x = x.clone()
            x[0, 0] = float("nan")
            return x, y
        return batch

    def plant_failure_on_rank1(self, place: str) -> None:
        """Make one part of the plugin raise on rank 1 only (issue 27): its collectives must still match."""
        if self.global_rank != 1:
            return
        from lightning_debug.monitors.anomaly import forensics, inputs, replay
        from lightning_debug.monitors.performance.slow_step import SlowStepRule

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"planted failure in {place} on rank 1")

        if place == "replay":
            replay.replay_each = failing  # type: ignore[assignment]
        elif place == "rows":
            inputs.nonfinite_samples = failing  # type: ignore[assignment]
        elif place == "origin":
            forensics.WeightHistory.origin = failing  # type: ignore[method-assign]
        elif place == "performance":
            SlowStepRule.judge = failing  # type: ignore[method-assign]
        else:
            raise ValueError(place)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Runs after the callbacks' hook of the same name: a skipped step has no gradients left.
        skipped = all(p.grad is None for group in optimizer.param_groups for p in group["params"])
        decision = "skip" if skipped else "step"
        if self.trainer.should_stop:
            decision += "+stop"
        self.decisions.append([self.trainer.global_step, decision])

    def teardown(self, stage: str) -> None:
        # After the callbacks' teardown, where the debug run finished: its report, plot and failures are final.
        if self.write_in_teardown:
            write_outcome(self.trainer, self, Path(self.out_dir), {"exception": None})


def write_outcome(trainer: pl.Trainer, model: NaNOnOneRank, out_dir: Path, outcome: dict[str, Any]) -> None:
    session = getattr(getattr(trainer, RUN_ATTRIBUTE, None), "session", None)
    output_dir = getattr(session, "output_dir", None)
    events_path = getattr(getattr(session, "events", None), "path", None)
    anomaly = next((c for c in trainer.callbacks if isinstance(c, AnomalyDetectionCallback)), None)
    run = getattr(trainer, RUN_ATTRIBUTE, None)
    outcome.update(
        failed_checks=sorted(run.failed_checks()) if run is not None else [],
        rank=trainer.global_rank, world_size=trainer.world_size, global_step=trainer.global_step,
        should_stop=trainer.should_stop,
        params_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        buffers_finite=all(bool(torch.isfinite(b.float()).all()) for b in model.buffers()),
        batches_tracked=int(model.norm.num_batches_tracked) if model.norm is not None else None,
        param_checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
        decisions=model.decisions, gather_steps=model.gather_steps,
        skipped_steps=anomaly.monitor.skipped_steps if anomaly is not None else None,
        output_dir=str(output_dir) if output_dir is not None else None,
        events_path=str(events_path) if events_path is not None else None,
        is_global_zero=trainer.is_global_zero, finished_at=time.time(),
        gate_log=[list(entry) for entry in run.gate.log] if run is not None else [],
        failures=run.failures.summary() if run is not None else {},
        report_failed_checks=run.failed_checks() if run is not None else {},
    )
    if model.injector is not None:
        model.injector.remove()
        outcome.update(fired=model.injector.fired, nan_from=model.nan_from, seen=model.injector.seen,
                       calls=model.injector.calls)
        if model.sweep:
            from tests.harness.injection import coverage

            nan_steps = sorted(step for step in range(trainer.global_step + 1) if model.is_nan_step(step))
            outcome.update(nan_steps=nan_steps, coverage=coverage([(model.injector.calls, model.injector.fired,
                                                                    set(nan_steps))]))
    (out_dir / f"result_{trainer.global_rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a stuck rank waits
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("nan_rank", type=int)
    parser.add_argument("nan_step", type=int)
    parser.add_argument("strategy", nargs="?", default="ddp")
    parser.add_argument("--all-four", action="store_true")
    parser.add_argument("--lightning-launcher", action="store_true",
                        help="under ddp, Lightning starts rank 1 (it runs this script again) instead of a fork")
    parser.add_argument("--level", default="basic")
    parser.add_argument("--unused-layer", action="store_true", help="a layer forward never uses (DDP fails at step 1)")
    parser.add_argument("--fail-writes-rank0", action="store_true")
    parser.add_argument("--fail-check-rank1-step", type=int, default=None)
    parser.add_argument("--gather-in-step", action="store_true")
    parser.add_argument("--nan-sample-batchnorm", action="store_true")
    parser.add_argument("--sync-grads", action="store_true", help="with --gather-in-step: all_gather(sync_grads=True)")
    parser.add_argument("--nan-in-backward", action="store_true",
                        help="a NaN only in the backward (before the gather's backward with --gather-in-step)")
    parser.add_argument("--nan-batch", action="store_true", help="a NaN in the batch itself, at NAN_STEP only")
    parser.add_argument("--nan-last", type=int, default=None, help="the last NaN step (default: to the end)")
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument("--inject", action="append", default=[], help="Class.method@STEP: raise there on rank 1")
    parser.add_argument("--sweep", action="store_true", help="inject into every step-time method, one per step")
    parser.add_argument("--sweep-targets", type=Path, default=None,
                        help="a JSON list of [method, at a NaN step, steps it ran at before]: inject only those")
    parser.add_argument("--fail-rank1", default=None, choices=["replay", "rows", "origin", "performance"],
                        help="make that part of the plugin raise on rank 1 only")
    args = parser.parse_args()
    if args.strategy == "ddp" and not args.lightning_launcher:
        fork_ranks()
    if args.all_four:
        config = DebugConfig(anomaly_detection_mode=args.mode, anomaly_check_frequency=1, gradient_checking_frequency=1,
                             memory_profiling_frequency=1, performance_profiling_frequency=1, log_gradients=True,
                             log_weights=True, level=args.level)
        callbacks = debug_callbacks(config)
    else:
        callbacks = [AnomalyDetectionCallback(anomaly_detection_mode=args.mode, level=args.level)]
    spawned = args.strategy == "ddp_spawn"
    epochs = {"limit_train_batches": SWEEP_EPOCH} if args.sweep else {}
    trainer = make_trainer(args.out_dir / "run", callbacks, max_steps=args.max_steps, devices=2, strategy=args.strategy,
                           **epochs)
    model = NaNOnOneRank(args.nan_rank, args.nan_step, str(args.out_dir), write_in_teardown=spawned,
                         unused_layer=args.unused_layer, fail_writes_rank0=args.fail_writes_rank0,
                         fail_check_rank1_step=args.fail_check_rank1_step, gather_in_step=args.gather_in_step,
                         nan_sample_batchnorm=args.nan_sample_batchnorm, sync_grads=args.sync_grads,
                         nan_in_backward=args.nan_in_backward, fail_rank1=args.fail_rank1,
                         nan_batch=args.nan_batch, nan_last=args.nan_last, inject=args.inject,
                         sweep=args.mode if args.sweep else None)
    if (args.inject or args.sweep) and os.environ.get("LOCAL_RANK") == "1":  # rank 1, before the run binds
        from tests.harness.injection import Injector, Schedule

        listed = [] if args.sweep_targets is None else json.loads(args.sweep_targets.read_text())
        targets = {(name, nan) for name, nan, _ in listed} if listed else None
        hints = {(name, nan): set(steps) for name, nan, steps in listed}
        model.injector, model.schedule = Injector(lambda: model.during), Schedule(targets=targets, hints=hints)
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
    exit_worker()
