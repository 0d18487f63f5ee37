"""Files that survive a full disk and a hostile reader, decisions no write can change, callbacks reused (issue 17).

The two-process tests of the same issue (a write failure on rank 0 only, a measurement failing on
one rank, an ADVANCED replay with a collective in ``training_step``) are in test_distributed.py.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_debug import AnomalyDetectionCallback, DebugConfig
from lightning_debug.cli import main as cli
from lightning_debug.config import Area
from lightning_debug.core.session import Session
from lightning_debug.monitors.anomaly import AnomalyMonitor
from lightning_debug.report import document
from lightning_debug.run import Run
from tests.harness.toolkit import console_lines, LoopContext, TinyRegressor, debug_dir, make_trainer, read_report

pytestmark = pytest.mark.timeout(240)


# --- a full disk ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_disk(tmp_path: Path, size: str = "1m") -> Iterator[tuple[Path, bool]]:
    """A small tmpfs of its own when this process may mount one (root), else a plain directory; says which."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True).returncode == 0
    try:
        yield mount, mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], capture_output=True)


def fill(directory: Path) -> None:
    """Fill the file system of ``directory`` up to its last byte."""
    for name, chunk in (("ballast", 4096), ("ballast_tail", 1)):
        with open(directory / name, "wb", buffering=0) as handle, contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * chunk)


def finish_a_run(directory: Path, nan_step: int | None) -> tuple[dict[str, Any] | None, list[str]]:
    """A short hand-written run writing into ``directory``; its report and the lightning-debug warnings."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DebugConfig(print_summary=True, save_plots=True)

    class Loop(LoopContext):
        run_id = f"nan{nan_step}"

    run = Run(config, Loop(directory, module=model), [AnomalyMonitor(config, "loop")])
    run.start(0)
    output = io.StringIO()
    with console_lines() as caught, contextlib.redirect_stdout(output):
        for step in range(4):
            run.batch_start(step, None)
            loss = model(torch.ones(4, 2)).pow(2).mean() + (torch.log(torch.zeros(())) if step == nan_step else 0)
            run.before_backward(step, loss)
            loss.backward()
            run.before_optimizer_step(step, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            run.after_optimizer_step(step + 1)
            run.batch_end()
        report = run.finish("finished", 4)
    return report, [line for line in caught if "lightning-debug" in line] + [output.getvalue()]


def test_a_full_disk_leaves_the_previous_report_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with small_disk(tmp_path) as (disk, mounted):
        directory = disk / "debug_outputs"
        first, _ = finish_a_run(directory, nan_step=1)
        assert first is not None and read_report(directory)["findings"]["nonfinite_loss"]["first_step"] == 1
        previous = {name: (directory / name).read_bytes() for name in ("report.json", "report.md")}
        if mounted:
            fill(disk)
        else:  # no tmpfs here: the disk fills up in the middle of writing the new files
            real_fdopen = os.fdopen

            def nearly_full(fd: int, *args: Any, **kwargs: Any) -> Any:
                stream = real_fdopen(fd, *args, **kwargs)
                write = stream.write

                def partial(data: bytes) -> int:
                    write(data[:100])
                    raise OSError(errno.ENOSPC, "No space left on device")

                stream.write = partial  # type: ignore[method-assign]
                return stream

            monkeypatch.setattr(document.os, "fdopen", nearly_full)
        second, said = finish_a_run(directory, nan_step=None)
        assert second is not None and second["findings"] == {}
        assert {name: (directory / name).read_bytes() for name in previous} == previous, \
            "report.json and report.md of the previous run are left whole"
        assert json.loads(previous["report.json"])["run"] == "nan1"
        leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
        assert leftovers == [], f"no temporary files left behind: {leftovers}"
        warned = [m for m in said if "writing the report failed" in m]
        assert len(warned) == 1 and "No space left on device" in warned[0]
        assert "previous complete version, if any, is left as it was" in warned[0]
        summary = said[-1]
        assert "writing the report" in summary, "the summary says the report was not written"
        for line in summary.splitlines():
            if line.strip().startswith(("report:", "json:", "plots:", "events:")):
                path = Path(line.split(":", 1)[1].strip())
                assert path.is_file() and path.read_bytes() != b"", f"the summary lists only files that exist: {line}"


def test_a_symlinked_report_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.md"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"step": 2, "kind": "nonfinite_loss", "severity": "error",
                                                  "message": "nan", "episode": "start"}) + "\n")
    (run / "report.md").symlink_to(outside)
    (run / "report.json").symlink_to(tmp_path / "outside.json")
    assert cli(["report", str(run), "--no-plots", "--quiet"]) == 0
    assert outside.read_text() == "precious\n" and not (tmp_path / "outside.json").exists()
    assert not (run / "report.md").is_symlink() and "nonfinite_loss" in (run / "report.md").read_text()


# --- a hostile reader's files ------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
EVENT_FIELDS = st.fixed_dictionaries({}, optional={
    "step": st.one_of(st.integers(-5, 10**6), st.text(max_size=3), st.floats(), st.booleans(), st.none()),
    "kind": st.one_of(st.sampled_from(["nonfinite_loss", "slow_step", "made_up"]), st.text(max_size=120), JSON_VALUES),
    "severity": st.one_of(st.sampled_from(["error", "warning", "info", "critical", "bogus"]), JSON_VALUES),
    "message": st.one_of(st.text(max_size=50), JSON_VALUES),
    "details": st.one_of(st.dictionaries(st.sampled_from(["first_step", "last_step", "steps", "key", "cause"]),
                                         JSON_VALUES, max_size=4), JSON_VALUES),
    "episode": st.sampled_from(["start", "end", "middle", None]),
    "epoch": JSON_VALUES, "batch": JSON_VALUES, "run": st.one_of(st.sampled_from(["a", "b"]), JSON_VALUES),
})
LINES = st.one_of(
    EVENT_FIELDS.map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.integers(1, 20_000).map(lambda depth: "[" * depth + "]" * depth),  # nested too deep
    st.integers(1, 20_000).map(lambda depth: '{"step": 1, "kind": "x", "details": ' + '{"a": ' * depth + "1"
                               + "}" * depth + "}"),
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
    st.text(max_size=40),
)
REPORTS = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({}, optional={
        "status": JSON_VALUES | st.sampled_from(["finished", "failed"]), "last_step": JSON_VALUES,
        "error": JSON_VALUES, "config": JSON_VALUES, "run": JSON_VALUES,
        "findings": st.dictionaries(st.text(max_size=10), JSON_VALUES | st.fixed_dictionaries({
            "episodes": JSON_VALUES, "steps": st.integers(), "first_step": st.integers(), "last_step": st.integers(),
            "severity": st.text(max_size=8), "first_message": JSON_VALUES}), max_size=3),
        "stats": st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3),
        "sections": st.dictionaries(st.text(max_size=10), JSON_VALUES | st.fixed_dictionaries(
            {"markdown": st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=2)}), max_size=3),
        "failed_checks": st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3)}),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=st.lists(LINES, max_size=12), cut_last=st.booleans(), report=st.none() | REPORTS,
       huge_line=st.booleans())
def test_report_on_hostile_files_is_a_report_or_one_line_and_exit_2(lines: list[str], cut_last: bool,
                                                                    report: Any, huge_line: bool) -> None:
    with tempfile.TemporaryDirectory() as directory:
        run = Path(directory) / "debug_outputs"
        run.mkdir()
        text = "".join(line.replace("\n", " ") + "\n" for line in lines)
        if huge_line:
            text += '{"step": 1, "kind": "slow_step", "message": "' + "x" * (1 << 20) + '"}\n'
        (run / "events.jsonl").write_text(text[:-1] if cut_last and text else text, encoding="utf-8",
                                          errors="surrogatepass")
        if report is not None:
            (run / "report.json").write_text(json.dumps(report))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli(["report", str(run), "--no-plots"])
        assert code in (0, 2)
        if code == 2:
            assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("lightning-debug: error: "), \
                err.getvalue()
        else:
            rebuilt = json.loads((run / "report.json").read_text())
            assert isinstance(rebuilt["findings"], dict) and (run / "report.md").read_text().startswith("# ")
            assert rebuilt["rebuilt"]["events_read"] + rebuilt["rebuilt"]["bad_lines"] <= len(lines) + int(huge_line)


# --- decisions that no write can change, in one process ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["skip", "stop", "raise"])
def test_a_failing_write_changes_no_decision(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Session, "emit", disk_full)
    callback = AnomalyDetectionCallback(anomaly_detection_mode=mode)
    trainer = make_trainer(tmp_path, [callback], max_steps=10)
    model = TinyRegressor(nan_layer_from_step=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "raise":
            with pytest.raises(Exception, match=r"non-finite activation, loss, grad at step 4 .*Cause: `torch\.log`"):
                trainer.fit(model)
        else:
            trainer.fit(model)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "the NaN update was dropped"
    if mode == "skip":
        assert trainer.global_step == 10 and callback.monitor.skipped_steps == 6
    if mode == "stop":
        assert trainer.global_step == 5 and trainer.should_stop
    report = read_report(debug_dir(trainer))
    assert "writing an event" in report["failed_checks"]


# --- reused callbacks -----------------------------------------------------------------------------------------------


def test_a_reused_callback_starts_clean_in_a_new_trainer(tmp_path: Path) -> None:
    callback = AnomalyDetectionCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = make_trainer(tmp_path / "a", [callback], max_steps=8)
        first.fit(TinyRegressor(log_zero_from_step=3))
        second = make_trainer(tmp_path / "b", [callback], max_steps=8)
        second.fit(TinyRegressor())
    assert "nonfinite_loss" in read_report(debug_dir(first))["findings"]
    report = read_report(debug_dir(second))
    assert report["findings"] == {} and report["sections"]["anomaly"]["anomaly_count"] == 0
    assert callback.monitor.anomaly_count == 0 and callback.run is None
    assert getattr(second, "_lightning_debug_run").monitor(Area.ANOMALY) is callback.monitor


def test_callbacks_that_do_not_lead_answer_no_batch_hooks_and_get_them_back(tmp_path: Path) -> None:
    """Lightning calls a callback's batch hook, inside a profiler context, whenever it is callable: during a
    fit the callbacks that do not lead (and Lightning's no-op hooks of the leader) answer None, a hook a
    subclass overrides still runs, and after the fit every callback has its methods back (and leads again
    when reused alone)."""
    from lightning.pytorch import Callback

    from lightning_debug import GradientHealthCallback, MemoryProfilerCallback

    class Counting(MemoryProfilerCallback):
        calls = 0

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            Counting.calls += 1

    seen: dict[str, list[Any]] = {}

    class Probe(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                seen.update({type(cb).__name__: [cb.on_train_batch_start, cb.on_after_backward]
                             for cb in trainer.callbacks if type(cb).__module__ != __name__ or cb is counting})

    leader, gradients, counting = AnomalyDetectionCallback(), GradientHealthCallback(), Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = make_trainer(tmp_path / "a", [Probe(), leader, gradients, counting], max_steps=4)
        first.fit(TinyRegressor())
    serious = {kind for kind, entry in read_report(debug_dir(first))["findings"].items()
               if entry["severity"] in ("warning", "error", "critical")}
    assert not serious, serious
    assert seen["AnomalyDetectionCallback"][0] is not None and seen["AnomalyDetectionCallback"][1] is None
    assert seen["GradientHealthCallback"] == [None, None]
    assert seen["Counting"][0] is None and seen["Counting"][1] is not None and Counting.calls == 4
    assert all(callable(cb.on_train_batch_start) and callable(cb.on_after_backward)
               for cb in (leader, gradients, counting))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = make_trainer(tmp_path / "b", [gradients], max_steps=4)
        second.fit(TinyRegressor())
    assert read_report(debug_dir(second))["sections"]["gradients"]["checks"] >= 1
