"""The user's side: example configs through LightningCLI, the planted-bug examples, the end-of-fit
report, plots and console summary, the TensorBoard layout, and the ``lightning-debug`` verbs on
real run directories (malformed ones included).

Everything trains for real on CPU, in this process, with few steps.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

from lightning_debug import DebugConfig
from lightning_debug.config import SETTINGS
from lightning_debug.cli import main as cli
from lightning_debug.core.timeline import Series, Timeline
from lightning_debug.report.offline import read_events_file, read_timeline, tensorboard_files
from lightning_debug.report.summary import PLOT_MIN_STEPS
from lightning_debug.report.tensorboard import LAYOUT_CATEGORIES
from lightning_debug.run import Run
from tests.harness.toolkit import LoopContext, read_report, read_scalars

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "configs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUIET = ["--trainer.enable_progress_bar=false"]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def example_cli(args: list[str]) -> Any:
    """``python examples/train.py ARGS``, in this process."""
    train = load_module(EXAMPLES / "train.py")
    with mock.patch.object(sys, "argv", ["examples/train.py"]):
        return train.cli_main(args)


def run_config(name: str, root: Path, *extra: str) -> Path:
    """``examples/train.py fit --config examples/configs/<name>.yaml`` in this process; returns the log dir."""
    cli_run = example_cli(["fit", "--config", str(CONFIGS / f"{name}.yaml"),
                           f"--trainer.logger.init_args.save_dir={root}", *QUIET, *extra])
    return Path(cli_run.trainer.log_dir)


def started(debug_dir: Path, kind: str) -> list[dict[str, Any]]:
    events = read_events_file(debug_dir / "events.jsonl").records
    return [e for e in events if e["kind"] == kind and e.get("episode") != "end"]


def read_layout(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    config = accumulator.Tensors("custom_scalars__config__")
    return layout_pb2.Layout.FromString(config[-1].tensor_proto.string_val[0]), accumulator


# --- every example config through LightningCLI ------------------------------------------------------------------


EXPECTED_BY_CONFIG = {
    "anomaly": ("nonfinite_activation", lambda e: e["step"] == 20 and e["callback"] == "AnomalyDetectionCallback"
                and "`torch.log`" in e["message"]),
    "gradients": ("missing_grad", lambda e: e["details"]["parameters"] == ["unused.weight", "unused.bias"]),
    "memory": ("memory_growth", lambda e: any(t["grad_fn"] for t in e["details"]["tensors"])),
    "performance": ("dataloader_bottleneck", lambda e: e["details"]["num_workers"] == 0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BY_CONFIG))
def test_example_config_runs_as_is_and_reports_its_planted_bug(name: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    log_dir = run_config(name, tmp_path)
    debug_dir = log_dir / "debug_outputs"
    kind, check = EXPECTED_BY_CONFIG[name]
    events = started(debug_dir, kind)
    assert events and check(events[0]), events
    report = read_report(debug_dir)
    assert report["status"] == "finished" and next(iter(report["findings"])) == kind
    assert f"### 1. `{kind}`" in (debug_dir / "report.md").read_text()
    assert (debug_dir / "debug_analysis.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(150)
def test_example_config_runs_from_the_command_line_exactly_as_documented(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    completed = subprocess.run([sys.executable, str(EXAMPLES / "train.py"), "fit", "--config",
                                str(CONFIGS / "anomaly.yaml")], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    debug_dir = tmp_path / "lightning_logs" / "anomaly" / "version_0" / "debug_outputs"
    assert started(debug_dir, "nonfinite_loss")[0]["step"] == 20
    assert "nonfinite_loss" in completed.stdout and str(Path("lightning_logs/anomaly/version_0")) in completed.stdout


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``full.yaml`` (all four callbacks, NaN loss from step 30), with its console output."""
    root = tmp_path_factory.mktemp("full")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        log_dir = run_config("full", root)
    return {"log_dir": log_dir, "debug_dir": log_dir / "debug_outputs", "stdout": output.getvalue(), "root": root}


def test_full_config_runs_all_four_areas_and_names_the_planted_nan(full_run: dict[str, Any]) -> None:
    debug_dir = full_run["debug_dir"]
    report = read_report(debug_dir)
    assert list(report["findings"])[:2] == ["nonfinite_activation", "nonfinite_loss"]
    assert report["findings"]["nonfinite_loss"]["first_step"] == 30
    assert {"anomaly", "gradients", "memory", "performance"} <= set(report["sections"])
    scalars = read_scalars(full_run["log_dir"])
    for tag in ("debug/loss_finite", "debug/grad/global_norm", "debug/memory/cpu_rss_mb", "debug/perf/step_ms"):
        assert scalars.get(tag), tag
    markdown = (debug_dir / "report.md").read_text()
    first = markdown.index("### 1. `nonfinite_activation` (error)")
    assert "**Where**: steps 30-" in markdown[first:] and "**What to do**" in markdown[first:]


def test_the_plot_is_a_png_with_five_panels_worth_of_data(full_run: dict[str, Any]) -> None:
    png = full_run["debug_dir"] / "debug_analysis.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 1200)


def test_console_summary_is_printed_once_with_the_findings_and_files(full_run: dict[str, Any]) -> None:
    stdout = full_run["stdout"]
    assert stdout.count("lightning-debug: run finished at step 60") == 1, stdout
    assert re.search(r"error\s+nonfinite_loss\s+steps 30-", stdout), stdout
    assert str(full_run["debug_dir"] / "report.md") in stdout
    assert "debug_analysis.png" in stdout and f"tensorboard --logdir {full_run['log_dir']}" in stdout


def test_tensorboard_groups_every_debug_chart_and_has_findings_as_text(full_run: dict[str, Any]) -> None:
    layout, accumulator = read_layout(full_run["log_dir"])
    assert [category.title for category in layout.category] == list(LAYOUT_CATEGORIES)
    charts = {chart.title for category in layout.category for chart in category.chart}
    assert "global gradient norm" in charts and "step phases (ms)" in charts
    assert "CUDA memory (MB)" not in charts and "weight norms" not in charts  # no data on CPU / without log_weights
    first = accumulator.Tensors("custom_scalars__config__")[0]
    assert b"CUDA memory (MB)" in first.tensor_proto.string_val[0]  # the full layout while the run went on
    regexes = {category.title: [tag for chart in category.chart for tag in chart.multiline.tag]
               for category in layout.category}
    tags = [tag for tag in accumulator.Tags()["scalars"] if tag.startswith("debug/")]
    assert len(tags) > 10
    for tag in tags:  # every debug scalar of the run is on a chart of the right group
        groups = [title for title, patterns in regexes.items() if any(re.match(p, tag) for p in patterns)]
        area = {"grad": "gradients", "weight": "gradients", "activation": "activations", "memory": "memory",
                "perf": "performance"}.get(
            tag.split("/")[1], "anomalies")
        assert groups == [f"lightning-debug: {area}"], (tag, groups)
    texts = accumulator.Tensors("debug/events/nonfinite_loss/text_summary")
    assert texts[0].step == 30
    assert b"**nonfinite_loss** (error, started) at step 30" in texts[0].tensor_proto.string_val[0]


# --- LightningCLI: --print_config and help text ----------------------------------------------------------------


def test_print_config_is_short_and_shows_every_callback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        example_cli(["fit", "--config", str(CONFIGS / "full.yaml"), "--print_config=skip_unset"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    for name in ("AnomalyDetectionCallback", "GradientHealthCallback", "MemoryProfilerCallback",
                 "PerformanceProfilerCallback"):
        assert printed.count(f"class_path: lightning_debug.{name}") == 1
    assert "gradient_checking_frequency: 5" in printed and "anomaly_detection_mode: WARN" in printed
    assert "null" not in printed and "config:" not in printed, "no repeated config block, no null overrides"
    callbacks = printed[printed.index("  callbacks:"):]
    callbacks = callbacks[:callbacks.index("\n  fast_dev_run")]
    assert len(callbacks.splitlines()) <= 16, callbacks
    assert len(printed.splitlines()) < 70


@pytest.mark.parametrize("callback", ["AnomalyDetectionCallback", "GradientHealthCallback", "MemoryProfilerCallback",
                                      "PerformanceProfilerCallback"])
def test_every_keyword_override_has_help_text(callback: str, capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    import lightning_debug

    with pytest.raises(SystemExit):
        example_cli(["fit", "--trainer.callbacks.help", f"lightning_debug.{callback}"])
    help_text = " ".join(capsys.readouterr().out.split())
    docs = {name: declared.doc for name, declared in SETTINGS.items()}
    parameters = [p for p in inspect.signature(getattr(lightning_debug, callback)).parameters if p in docs]
    assert parameters
    for parameter in parameters:
        assert " ".join(docs[parameter].split()[:4]) in help_text, parameter


# --- the planted-bug examples -----------------------------------------------------------------------------------


BUGS = {
    "nan_log_zero": (10, lambda first, d: first["kind"] == "nonfinite_loss"
                     and first["callback"] == "AnomalyDetectionCallback"
                     and "classifier.weight" in started(d, "nonfinite_grad")[0]["details"]["parameters"]),
    "exploding_gradients": (3, lambda first, d: first["kind"] == "exploding_grad"
                            and "layers.0.weight" in first["details"]["parameters"]),
    "vanishing_gradients": (3, lambda first, d: first["kind"] == "vanishing_grad"
                            and first["details"]["parameters"][0] == "layers.0.weight"),
    "unused_layer": (6, lambda first, d: first["kind"] == "missing_grad"
                     and first["details"]["parameters"] == ["aux_head.weight", "aux_head.bias"]),
    "memory_leak_kept_graphs": (120, lambda first, d: first["kind"] == "memory_growth"
                                and any(t["grad_fn"] for t in first["details"]["tensors"])),
    "slow_dataloader": (8, lambda first, d: first["kind"] == "dataloader_bottleneck"
                        and first["details"]["num_workers"] == 0),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_example_reports_its_planted_bug(bug: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    steps, check = BUGS[bug]
    gc.collect()  # earlier tests' garbage, collected during the 120-step leak run, would move the heap by megabytes
    first = load_module(EXAMPLES / "bugs" / f"{bug}.py").main(tmp_path, steps=steps)
    debug_dir = next(tmp_path.glob("*/version_0/debug_outputs"))
    assert first and check(first, debug_dir), first
    printed = capsys.readouterr().out
    assert f"lightning-debug reported `{first['kind']}`" in printed


# --- the lightning-debug command ----------------------------------------------------------------------------


def copy_run(full_run: dict[str, Any], tmp_path: Path) -> Path:
    log_dir = tmp_path / "run"
    shutil.copytree(full_run["log_dir"], log_dir)
    for name in ("report.json", "report.md", "debug_analysis.png"):
        (log_dir / "debug_outputs" / name).unlink()
    return log_dir


def test_report_rebuilds_report_and_plot_from_events_and_tensorboard(full_run: dict[str, Any], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = copy_run(full_run, tmp_path)
    assert cli(["report", str(log_dir)]) == 0
    debug_dir = log_dir / "debug_outputs"
    report = read_report(debug_dir)
    assert report["status"] == "unknown" and list(report["findings"])[:2] == ["nonfinite_activation", "nonfinite_loss"]
    assert report["findings"]["nonfinite_loss"]["first_step"] == 30
    live = read_report(full_run["debug_dir"])
    assert set(report["findings"]) == set(live["findings"])
    norms = read_scalars(full_run["log_dir"])["debug/grad/global_norm"]
    assert report["stats"]["gradient_norm"]["count"] == len(norms)
    assert report["stats"]["gradient_norm"]["max"] == pytest.approx(max(v for _, v in norms))
    assert (debug_dir / "debug_analysis.png").read_bytes()[:8] == PNG_MAGIC
    assert "### 1. `nonfinite_activation`" in (debug_dir / "report.md").read_text()
    captured = capsys.readouterr()
    assert "rebuilt" in captured.out and "nonfinite_loss" in captured.out
    assert "read" in captured.err and "debug scalars" in captured.err  # progress


def test_report_keeps_what_only_the_live_report_knows(full_run: dict[str, Any], tmp_path: Path) -> None:
    debug_dir = tmp_path / "debug_outputs"
    shutil.copytree(full_run["debug_dir"], debug_dir)
    assert cli(["report", str(debug_dir), "--no-plots", "--quiet"]) == 0
    report, live = read_report(debug_dir), read_report(full_run["debug_dir"])
    assert report["status"] == "finished" and report["config"] == live["config"]
    assert report["findings"] == live["findings"] and set(report["sections"]) == set(live["sections"])
    assert report["rebuilt"]["tensorboard"] == []  # only the debug directory was copied


def test_report_tolerates_and_says_a_truncated_last_line(full_run: dict[str, Any], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = copy_run(full_run, tmp_path)
    events = log_dir / "debug_outputs" / "events.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    events.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert cli(["report", str(log_dir), "--no-plots"]) == 0
    assert "last line of events.jsonl was cut off" in capsys.readouterr().out
    report = read_report(log_dir / "debug_outputs")
    assert report["rebuilt"]["truncated_last_line"] is True
    assert report["rebuilt"]["events_read"] == len(lines) - 1


@pytest.mark.parametrize("damage, message", [
    (lambda lines: lines[:1] + ["{not json\n"] + lines[1:], r"events.jsonl:2: not valid JSON"),
    (lambda lines: lines[:1] + ["[1, 2]\n"] + lines[1:], r"events.jsonl:2: not a lightning-debug event"),
    (lambda lines: lines[:1] + ['{"kind": "nonfinite_loss"}\n'] + lines[1:], r"events.jsonl:2: 'step' is not an int"),
    (lambda lines: lines[:1] + ['{"kind": "x", "step": 3, "details": "oops"}\n'] + lines[1:],
     r"events.jsonl:2: 'details' is not an object"),
])
def test_report_skips_and_counts_malformed_lines(full_run: dict[str, Any], tmp_path: Path, damage: Any,
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = copy_run(full_run, tmp_path)
    events = log_dir / "debug_outputs" / "events.jsonl"
    events.write_text("".join(damage(events.read_text().splitlines(keepends=True))))
    assert cli(["report", str(log_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"note: skipped 1 malformed line\(s\) of events.jsonl, e.g. " + message, out), out
    report = read_report(log_dir / "debug_outputs")
    assert report["rebuilt"]["bad_lines"] == 1 and report["findings"]["nonfinite_loss"]["first_step"] == 30


def test_report_on_nothing_usable_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    debug_dir = tmp_path / "debug_outputs"
    debug_dir.mkdir()
    (debug_dir / "events.jsonl").write_text('{not json\n[1, 2]\n{"kind": "x", "step": -1}\n')
    assert cli(["report", str(debug_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-debug: error: nothing usable in"), err
    assert "3 malformed line(s), e.g. events.jsonl:1: not valid JSON" in err[0]
    assert not (debug_dir / "report.json").exists()


def test_report_errors_for_missing_and_empty_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"lightning-debug: error: no such directory: {tmp_path / 'nowhere'}\n"
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert cli(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no events.jsonl under" in err
    (tmp_path / "file.txt").write_text("x")
    assert cli(["report", str(tmp_path / "file.txt")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_report_on_a_parent_directory_rebuilds_every_run(full_run: dict[str, Any], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        copy_run(full_run, tmp_path / name)
    assert cli(["report", str(tmp_path), "--no-plots"]) == 0
    assert "[2/2] rebuilt" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*/run/debug_outputs/report.json"))) == 2


def test_report_without_matplotlib_says_how_to_install_it(full_run: dict[str, Any], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = copy_run(full_run, tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    assert cli(["report", str(log_dir)]) == 0
    assert "needs matplotlib, which is not installed: pip install matplotlib" in capsys.readouterr().out
    assert not (log_dir / "debug_outputs" / "debug_analysis.png").exists()
    assert (log_dir / "debug_outputs" / "report.md").exists()


def test_offline_progress_is_reported_while_reading(full_run: dict[str, Any]) -> None:
    said: list[str] = []
    events = read_events_file(full_run["debug_dir"] / "events.jsonl")
    files = tensorboard_files([full_run["log_dir"]])
    timeline, notes = read_timeline(events, files, said.append, progress_every_s=0.0)
    assert not notes and len(said) > 5 and "debug scalars so far" in said[0]
    assert timeline.values("debug/perf/step_ms")[0]


def test_demo_output_is_what_the_quickstart_quotes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The demo at its defaults (80 steps, level ADVANCED, NaN from step 40) prints the lines
    docs/quickstart.md quotes, the times (and the data-wait share, a timing) aside."""
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    quoted = quickstart[quickstart.index("```\nTraining 80 steps") + 4:]
    quoted = quoted[:quoted.index("```")].replace("demo_output", str(tmp_path)).splitlines()
    assert cli(["demo", "--output", str(tmp_path)]) == 0
    # the demo's own lines are printed; the plugin's findings go through the `lightning_debug` logger (to stderr in
    # a terminal, to pytest's log capture here, where the root logger has a handler)
    lines = capsys.readouterr().out.splitlines() + [r.getMessage() for r in caplog.records if r.name == "lightning_debug"]
    printed = [" ".join(line.split()) for line in lines]

    def without_time(line: str) -> str:
        return re.sub(r"\s+[\d.]+ s$", "", " ".join(line.split()))

    def shown(quoted_line: str) -> bool:
        wanted = without_time(quoted_line)
        if wanted.startswith("lightning-debug: run finished"):  # timing findings may add to the count
            wanted = wanted[:wanted.index(",")]
        elif wanted.endswith("…"):  # a cut table cell: where it is cut depends on the other rows
            wanted = wanted[:-15]
        return any(without_time(line).startswith(wanted) for line in printed)

    for line in quoted:
        assert shown(line), f"quoted but not printed: {line!r}\n" + "\n".join(printed)
    report = json.loads(next(tmp_path.glob("demo/version_0/debug_outputs/report.json")).read_text())
    assert report["findings"]["nonfinite_loss"]["first_step"] == 40
    assert report["findings"]["nonfinite_activation"]["first_message"].startswith("At step 40, `torch.log` at demo.py:")


# --- pieces ----------------------------------------------------------------------------------------------------


def test_series_stays_bounded_and_keeps_a_spike() -> None:
    series = Series(max_points=64)
    for step in range(10_000):
        series.add(step, 1000.0 if step == 7_777 else 1.0)
    steps, values = series.values()
    assert len(steps) <= 65 and steps == sorted(steps) and steps[0] == 0 and steps[-1] > 9_000
    assert max(values) == 1000.0


def test_plain_text_summary_without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_debug.report.summary import print_summary

    monkeypatch.setitem(sys.modules, "rich.console", None)
    report = {"status": "failed", "last_step": 7, "findings": {"oom": {
        "severity": "critical", "first_step": 7, "last_step": 7, "episodes": 1, "steps": 1,
        "first_message": "CUDA out of memory at step 7. See oom_step7.md."}}}
    stream = io.StringIO()
    print_summary(report, {"report": "x/report.md"}, stream)
    assert stream.getvalue().splitlines() == [
        "lightning-debug: run failed at step 7, 1 kind(s) of finding",
        "  severity  finding                where        what",
        "  critical  oom                    step 7       CUDA out of memory at step 7.",
        "  report:   x/report.md",
    ]


def test_only_global_zero_prints_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank_zero in (False, True):
        directory = tmp_path / str(rank_zero)
        run = Run(DebugConfig(), LoopContext(directory, is_global_zero=rank_zero))
        run.session.metrics.add(0, "debug/perf/step_ms", 5.0)
        run.batch_start(0, None)
        run.batch_end()
        run.finish("finished", PLOT_MIN_STEPS)  # long enough to chart
        run.finish("finished", PLOT_MIN_STEPS)  # later calls of the same run print nothing more
        assert (directory / "debug_analysis.png").exists() is rank_zero
    assert capsys.readouterr().out.count("lightning-debug: run finished") == 1


def test_a_short_healthy_fit_draws_no_plot_and_says_how_to_draw_it(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = Run(DebugConfig(), LoopContext(tmp_path))
    run.session.metrics.add(0, "debug/perf/step_ms", 5.0)
    run.finish("finished", 20)
    assert (tmp_path / "report.json").exists() and not (tmp_path / "debug_analysis.png").exists()
    assert "not drawn (a healthy run of 20 steps" in capsys.readouterr().out
    assert cli(["report", str(tmp_path)]) == 0 and (tmp_path / "debug_analysis.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_settings_turn_the_end_of_run_output_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Run(DebugConfig(save_plots=False, print_summary=False), LoopContext(tmp_path)).finish("finished", 1)
    assert (tmp_path / "report.json").exists() and not (tmp_path / "debug_analysis.png").exists()
    assert capsys.readouterr().out == ""


def test_timeline_findings_follow_episodes(tmp_path: Path) -> None:
    timeline = Timeline()
    timeline.observe_event({"step": 4, "kind": "nonfinite_loss", "severity": "error", "message": "m",
                            "episode": "start"})
    timeline.observe_event({"step": 9, "kind": "nonfinite_loss", "severity": "info", "message": "ended",
                            "episode": "end", "details": {"first_step": 4, "last_step": 9, "steps": 6}})
    timeline.observe_event({"step": 12, "kind": "nonfinite_loss", "severity": "error", "message": "again",
                            "episode": "start"})
    timeline.observe_metrics({"debug/perf/step_ms": 3.0}, 20)
    entry = timeline.findings()["nonfinite_loss"]
    assert (entry["episodes"], entry["steps"], entry["first_step"], entry["last_step"]) == (2, 7, 4, 20)
    assert entry["severity"] == "error" and entry["first_message"] == "m"
