"""The smoke tier of the support matrix (scripts/matrix.sh): what a user does first, on the installed versions.

    python scripts/smoke.py WORKDIR            # every step
    python scripts/smoke.py WORKDIR cli demo   # some of them

Each step runs in a process of its own (a crash is a failed step, not a dead matrix) and checks the files
the run wrote: a planted NaN must be named in events.jsonl at its step, report.md must not say
"No problems found", and no check may have failed on these versions (report.json's ``failed_checks``).
Steps: ``fit`` (lightning.pytorch), ``pl_fit`` (the standalone ``pytorch_lightning`` package), ``demo``
(``lightning-debug demo``), ``cli`` (a LightningCLI run from a YAML file), ``cli_error`` (a bad value in that
file: exit 2 and a short error naming the key), ``exception`` (a shape mismatch explained with its module
and shapes), ``accelerate``
(examples/accelerate_loop.py). Exit status 0 when every step passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAN_STEP = 10
NAN_PREFIX = "nonfinite_"

FIT = textwrap.dedent('''
    import sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    if sys.argv[2] == "pytorch_lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.loggers import TensorBoardLogger
    else:
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import TensorBoardLogger
    from lightning_debug import debug_callbacks

    class Planted(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.global_step >= NAN_STEP:
                loss = loss - torch.log(torch.zeros_like(loss))
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = pl.Trainer(max_steps=24, accelerator="cpu", devices=1, log_every_n_steps=4, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False,
                         logger=TensorBoardLogger(sys.argv[1], name="fit"), callbacks=debug_callbacks())
    trainer.fit(Planted(), DataLoader(data, batch_size=8))
''').replace("NAN_STEP", str(NAN_STEP))

CLI = textwrap.dedent('''
    import sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    class Planted(pl.LightningModule):
        def __init__(self, nan_step: int = 1000, hidden: int = 16):
            super().__init__()
            self.nan_step = nan_step
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if self.global_step >= self.nan_step:
                loss = loss - torch.log(torch.zeros_like(loss))
            self.log("train_loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)
        def train_dataloader(self):
            torch.manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=8)

    from lightning_debug.callbacks.cli import CompactCLI

    class CLI(CompactCLI, LightningCLI):  # short usage errors on every Lightning version (parser_class: 2.5.1+)
        pass

    CLI(Planted, args=sys.argv[1:], save_config_kwargs={"overwrite": True})
''')

CLI_YAML = textwrap.dedent('''
    trainer:
      accelerator: cpu
      devices: 1
      max_steps: 24
      log_every_n_steps: 4
      enable_checkpointing: false
      enable_model_summary: false
      enable_progress_bar: false
      logger:
        class_path: lightning.pytorch.loggers.TensorBoardLogger
        init_args:
          save_dir: {save_dir}
          name: cli
      callbacks:
        - class_path: lightning_debug.AnomalyDetectionCallback
          init_args:
            anomaly_detection_mode: warn
            anomaly_check_frequency: 1
        - class_path: lightning_debug.GradientHealthCallback
          init_args:
            gradient_checking_frequency: 4
    model:
      nan_step: {nan_step}
''')


def run(command: list[str], cwd: Path, log: Path) -> None:
    """Run ``command``; its output goes to ``log``; a non-zero exit (a crash included) fails the step."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        code = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise AssertionError(f"{' '.join(command[:3])} ... exited {code}; last lines of {log}:\n{tail}")


def check_run(root: Path, nan_step: int | None) -> str:
    """The one debug_outputs under ``root``: the planted NaN named at its step, no "No problems found", and no
    check that failed. Returns a one-line summary."""
    found = sorted(root.rglob("events.jsonl"))
    assert len(found) == 1, f"expected one events.jsonl under {root}, found {[str(p) for p in found]}"
    outputs = found[0].parent
    events = [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]
    report = json.loads((outputs / "report.json").read_text())
    markdown = (outputs / "report.md").read_text()
    assert not report.get("failed_checks"), f"checks failed on these versions: {report['failed_checks']}"
    if nan_step is not None:
        steps = sorted({event["step"] for event in events if str(event.get("kind", "")).startswith(NAN_PREFIX)})
        assert steps and steps[0] == nan_step, f"planted NaN at step {nan_step}; NaN events at steps {steps}"
        assert "No problems found" not in markdown, "report.md says 'No problems found' for a NaN run"
    kinds = sorted({event.get("kind") for event in events})
    return f"{outputs.relative_to(root)}: kinds {kinds}"


def step_fit(work: Path, package: str = "lightning") -> str:
    script = work / "fit.py"
    script.write_text(FIT)
    run([sys.executable, str(script), str(work / "logs"), package], work, work / "output.log")
    return check_run(work / "logs", NAN_STEP)


def step_pl_fit(work: Path) -> str:
    return step_fit(work, "pytorch_lightning")


def step_demo(work: Path) -> str:
    command = [sys.executable, "-m", "lightning_debug", "demo", "--output", str(work / "out"), "--steps", "24",
               "--nan-step", str(NAN_STEP)]
    run(command, work, work / "output.log")
    return check_run(work / "out", NAN_STEP)


def step_cli(work: Path) -> str:
    (work / "cli.py").write_text(CLI)
    (work / "config.yaml").write_text(CLI_YAML.format(save_dir=work / "logs", nan_step=NAN_STEP))
    run([sys.executable, "cli.py", "fit", "--config", "config.yaml"], work, work / "output.log")
    return check_run(work / "logs", NAN_STEP)


def step_cli_error(work: Path) -> str:
    """A bad value in the YAML: a usage error (exit 2) of a few lines that names the key, on these versions'
    jsonargparse and LightningCLI."""
    (work / "cli.py").write_text(CLI)
    bad = CLI_YAML.format(save_dir=work / "logs", nan_step=NAN_STEP).replace("gradient_checking_frequency: 4",
                                                                             "gradient_checking_frequency: 0")
    (work / "bad.yaml").write_text(bad)
    log = work / "output.log"
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "cli.py", "fit", "--config", "bad.yaml"], cwd=work, stdout=out,
                              stderr=subprocess.STDOUT, timeout=300).returncode
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2, f"exit {code}, expected 2; output:\n" + "\n".join(lines[-25:])
    assert errors and "gradient_checking_frequency" in errors[0] and len(lines) - lines.index(errors[0]) <= 8, \
        "expected a short error naming the key; output:\n" + "\n".join(lines[-25:])
    return errors[0][:100]


SHAPE_ERROR = textwrap.dedent('''
    import sys, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lightning_debug import debug_callbacks

    class Mismatched(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(12, 1))
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=sys.argv[1],
                         callbacks=debug_callbacks())
    trainer.fit(Mismatched(), DataLoader(data, batch_size=8))
''')


def step_exception(work: Path) -> str:
    """A shape mismatch: the user's RuntimeError propagates (exit 1) and events.jsonl explains it, naming the
    module and the shape it got (read from the traceback's frames, which each Python version exposes its way)."""
    (work / "mismatch.py").write_text(SHAPE_ERROR)
    log = work / "output.log"
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "mismatch.py", str(work / "root")], cwd=work, stdout=out,
                              stderr=subprocess.STDOUT, timeout=300).returncode
    output = log.read_text(errors="replace")
    assert code == 1 and "RuntimeError" in output, f"exit {code}; output:\n{output[-2000:]}"
    found = sorted((work / "root").rglob("events.jsonl"))
    events = [json.loads(line) for path in found for line in path.read_text().splitlines() if line.strip()]
    explained = [event for event in events if event.get("kind") == "exception"]
    assert explained, f"no exception event in {found}"
    message = explained[0]["message"]
    assert "in module `net.2`" in message and "[8, 16]" in message, message
    return message[:100]


def step_accelerate(work: Path) -> str:
    command = [sys.executable, str(ROOT / "examples" / "accelerate_loop.py"), "--plant", "nan", "--anomaly-mode",
               "warn", "--steps", "40", "--project-dir", str(work / "runs")]
    run(command, work, work / "output.log")
    return check_run(work / "runs", 30)


STEPS = {"fit": step_fit, "pl_fit": step_pl_fit, "demo": step_demo, "cli": step_cli, "cli_error": step_cli_error,
         "exception": step_exception, "accelerate": step_accelerate}


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__)
        return 2
    work = Path(argv[0]).resolve()
    names = argv[1:] or list(STEPS)
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        print(f"unknown step(s) {unknown}; known: {list(STEPS)}")
        return 2
    failed = []
    for name in names:
        step_dir = work / name
        if step_dir.exists():
            subprocess.run(["rm", "-rf", str(step_dir)], check=True)
        step_dir.mkdir(parents=True)
        started = time.monotonic()
        try:
            summary = STEPS[name](step_dir)
            print(f"smoke {name}: ok ({time.monotonic() - started:.0f} s) {summary}", flush=True)
        except Exception as error:  # noqa: BLE001 - a failed step is reported and the others still run
            failed.append(name)
            print(f"smoke {name}: FAILED ({time.monotonic() - started:.0f} s) {error}", flush=True)
    print(f"smoke: {len(names) - len(failed)} of {len(names)} steps ok" + (f", failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
