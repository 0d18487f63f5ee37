"""Every bad value of every DebugConfig field given through LightningCLI is a parse error (issue 26).

The constraints are in the annotations jsonargparse reads (``PositiveInt``, ``UnitFraction``, ...,
lightning_debug/config_types.py), so a bad value stops the parser with exit code 2 and a message naming the
field, before any callback is built, given flat (the callback's keyword) or nested (its ``config:`` block).
With ``parser_class=CompactArgumentParser`` (lightning_debug/callbacks/cli.py) that message is at most 10
lines: the key with its whole path, the value and what is allowed, instead of about 80.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from lightning_debug import (AnomalyDetectionCallback, DebugConfig, GradientHealthCallback, MemoryProfilerCallback,
                             PerformanceProfilerCallback)

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
CALLBACKS = (AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback, PerformanceProfilerCallback)
BAD_VALUES: dict[str, Any] = {
    "mode": "everything", "level": "deep", "anomaly_detection_mode": "ignore",
    "anomaly_check_frequency": 0, "gradient_checking_frequency": -5, "memory_profiling_frequency": 0,
    "performance_profiling_frequency": 2.5, "gradient_explosion_threshold": -1.0,
    "gradient_vanishing_threshold": -1e-6, "save_debug_info": "maybe", "debug_output_dir": " ",
    "log_gradients": "maybe", "log_activations": "maybe", "log_weights": "maybe", "log_memory": "maybe",
    "log_performance": "maybe", "memory_high_fraction": 1.5, "slow_step_factor": 1.0,
    "dataloader_bottleneck_share": 0.0, "profile_steps": [2, 500], "save_plots": "maybe", "print_summary": "maybe",
    "follow_log_cadence": "maybe", "expose_callback_metrics": "maybe",
}
ALLOWED_WORDS: dict[str, str] = {  # what the short error says is allowed, for the bad value above
    "mode": "FULL_DEBUG", "level": "advanced", "anomaly_detection_mode": "warn, raise, skip, stop",
    "anomaly_check_frequency": "an integer >= 1", "gradient_checking_frequency": "an integer >= 1",
    "memory_profiling_frequency": "an integer >= 1", "performance_profiling_frequency": "an integer >= 1",
    "gradient_explosion_threshold": "a finite number >= 0", "gradient_vanishing_threshold": "a finite number >= 0",
    "save_debug_info": "true or false", "debug_output_dir": "a string that is not blank",
    "log_gradients": "true or false", "log_activations": "true or false", "log_weights": "true or false",
    "log_memory": "true or false", "log_performance": "true or false", "memory_high_fraction": "a number in (0, 1]",
    "slow_step_factor": "a finite number > 1", "dataloader_bottleneck_share": "a number in (0, 1]",
    "profile_steps": "an integer in [0, 50]", "save_plots": "true or false", "print_summary": "true or false",
    "follow_log_cadence": "true or false", "expose_callback_metrics": "true or false",
}
MAX_LINES = 10


def test_every_field_has_a_bad_value_here() -> None:
    assert set(BAD_VALUES) == set(ALLOWED_WORDS) == {field.name for field in dataclasses.fields(DebugConfig)}
    for field, value in BAD_VALUES.items():  # each one is also rejected from Python, naming the field
        with pytest.raises(ValueError, match=field):
            DebugConfig(**{field: value})


@pytest.fixture(scope="module")
def parsers() -> dict[bool, Any]:
    """The parser of a LightningCLI (``run=False``), plain (False) and compact (True), built once: the walks below
    parse each file with it as ``LightningCLI.parse_arguments`` does (``parser.parse_args``); a bad value stops
    there, before anything is instantiated. Building a LightningCLI per case cost twice the time."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_debug.callbacks.cli import CompactArgumentParser
    from tests.harness.toolkit import TinyRegressor

    built = {}
    for compact in (False, True):
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            built[compact] = LightningCLI(
                TinyRegressor, run=False, save_config_callback=None, args=["--trainer.logger=false"],
                **({"parser_class": CompactArgumentParser} if compact else {})).parser
    return built


def _parse(directory: Path, callback: type, init_args: dict[str, Any], parser: Any) -> tuple[int | None, str]:
    document = {"trainer": {"logger": False, "enable_checkpointing": False, "callbacks": [
        {"class_path": f"lightning_debug.{callback.__name__}", "init_args": init_args}]}}
    path = directory / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    return _printed(lambda: parser.parse_args(["--config", str(path)]))


def _printed(parse: Callable[[], Any]) -> tuple[int | None, str]:
    """The exit code of ``parse`` (None: it returned) and everything it printed, warnings ignored."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parse()
    except SystemExit as exit_info:
        return int(exit_info.code or 0), printed.getvalue()
    return None, printed.getvalue()


def _run_cli(directory: Path, document: dict[str, Any], args: tuple[str, ...] = (), subcommand: bool = False,
             cli: type | None = None, parser: type | None = None) -> tuple[int | None, str]:
    """A compact LightningCLI built on ``document`` as a config file (``fit`` first when ``subcommand``): the exit
    code and everything printed. A parse error exits before anything is built or trained."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_debug.callbacks.cli import CompactArgumentParser
    from tests.harness.toolkit import TinyRegressor

    path = directory / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    return _printed(lambda: (cli or LightningCLI)(
        TinyRegressor, run=subcommand, save_config_callback=None, parser_class=parser or CompactArgumentParser,
        args=[*(["fit"] if subcommand else []), "--config", str(path), *args]))


def _cases() -> list[tuple[str, type, bool]]:
    cases = [(field, AnomalyDetectionCallback, False) for field in BAD_VALUES]
    for callback in CALLBACKS:
        flat = [name for name in inspect.signature(callback.__init__).parameters if name in BAD_VALUES]
        cases += [(field, callback, True) for field in flat]
    return cases


def _case_id(value: Any) -> str:
    return value.__name__ if isinstance(value, type) else "flat" if value is True else "nested" if value is False \
        else str(value)


@pytest.mark.parametrize("field, callback, flat", _cases(), ids=_case_id)
def test_a_bad_value_is_a_parse_error_naming_the_field(tmp_path: Path, parsers: dict[bool, Any], field: str,
                                                       callback: type, flat: bool) -> None:
    """A plain LightningCLI's parser: jsonargparse's message names the field (the compact walk below shortens it)."""
    value = BAD_VALUES[field]
    code, printed = _parse(tmp_path, callback, {field: value} if flat else {"config": {field: value}}, parsers[False])
    assert code == 2, printed[-1500:]
    error = printed[printed.index("error:"):]
    assert f'"{field}"' in error or f"'{field}'" in error or f".{field}" in error, error
    assert "Traceback" not in printed


@pytest.mark.parametrize("field, callback, flat", _cases(), ids=_case_id)
def test_a_bad_value_through_the_compact_parser_is_a_few_lines_with_the_key_and_what_is_allowed(
        tmp_path: Path, parsers: dict[bool, Any], field: str, callback: type, flat: bool) -> None:
    value = BAD_VALUES[field]
    code, printed = _parse(tmp_path, callback, {field: value} if flat else {"config": {field: value}}, parsers[True])
    lines = printed.splitlines()
    assert code == 2 and len(lines) <= MAX_LINES, printed
    key = f"trainer.callbacks[0] (lightning_debug.{callback.__name__}).{'' if flat else 'config.'}{field}: "
    assert lines[0].startswith(f"error: {key}"), printed
    assert any(line.startswith("  allowed: ") and ALLOWED_WORDS[field].lower() in line.lower() for line in lines), \
        printed
    assert lines[-1].startswith("tip: ") and "--help" in lines[-1]
    assert "usage:" not in printed and "Traceback" not in printed


def test_out_of_range_from_the_command_line_exits_2_in_a_few_lines(tmp_path: Path) -> None:
    """As a user runs the example CLI: the range check used to run in ``__post_init__``, after parsing (exit 1, a
    traceback); then it was a usage error of about 80 lines; the example's ``CompactArgumentParser`` makes it 4."""
    document = {"trainer": {"logger": False, "max_steps": 1, "callbacks": [
        {"class_path": "lightning_debug.MemoryProfilerCallback", "init_args": {"memory_high_fraction": 1.5}}]}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(document))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "fit", "--config", "bad.yaml"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    printed = completed.stdout + completed.stderr
    assert completed.returncode == 2, printed[-2000:]
    assert len(printed.splitlines()) <= MAX_LINES, printed
    assert "Traceback" not in printed
    assert "trainer.callbacks[0] (lightning_debug.MemoryProfilerCallback).memory_high_fraction" in printed
    assert "given: 1.5" in printed and "allowed: a number in (0, 1]" in printed


@pytest.mark.parametrize("document, args, subcommand, key, words", [
    ({"trainer": {"max_stepz": 3}}, (), False, "trainer.max_stepz", "no such option"),
    ({"trainer": {"max_stepz": 3}}, (), True, "trainer.max_stepz", "no such option"),
    ({"trainer": {"max_steps": "many"}}, (), True, "trainer.max_steps", "allowed: an integer"),
    ({}, ("--trainer.max_stepz", "3"), False, "--trainer.max_stepz", "unrecognized arguments"),
    ({}, ("--trainer.max_steps", "many"), True, "trainer.max_steps", "given: many"),
    ({"trainer": {"callbacks": [{"class_path": "lightning_debug.AnomalyDetectionCallback"},
                                {"class_path": "lightning_debug.MemoryProfilerCallback",
                                 "init_args": {"memory_high_fractio": 0.5}}]}}, (), False,
     "trainer.callbacks[1] (lightning_debug.MemoryProfilerCallback).memory_high_fractio", "no such option"),
    ({"trainer": {"callbacks": [{"class_path": "lightning_debug.MemoryProfilerCallbak"}]}}, (), True,
     "trainer.callbacks[0] (lightning_debug.MemoryProfilerCallbak)", "has no attribute"),
], ids=["yaml-typo", "fit-yaml-typo", "fit-yaml-type", "argv-typo", "fit-argv-type", "init-arg-typo",
        "fit-class-path-typo"])
def test_an_error_not_about_a_debug_field_is_as_short_and_names_the_key(
        tmp_path: Path, document: dict[str, Any], args: tuple[str, ...], subcommand: bool, key: str,
        words: str) -> None:
    code, printed = _run_cli(tmp_path, document, args, subcommand=subcommand)
    assert code == 2 and len(printed.splitlines()) <= MAX_LINES, printed
    assert key in printed.splitlines()[0] and words in printed, printed
    assert ("fit --help" in printed) is subcommand and "usage:" not in printed and "Traceback" not in printed


def test_the_plain_lightning_cli_still_prints_jsonargparse_usage_and_the_whole_explanation(
        tmp_path: Path, parsers: dict[bool, Any]) -> None:
    """What docs/configuration.md says a plain LightningCLI prints (the walk above checks the exit code and key)."""
    code, printed = _parse(tmp_path, MemoryProfilerCallback, {"memory_high_fraction": 1.5}, parsers[False])
    assert code == 2 and printed.startswith("usage:") and len(printed.splitlines()) > 30
    assert 'Parser key "memory_high_fraction"' in printed and "Not of type UnitFraction" in printed


def test_a_user_cli_subclass_and_parser_class_get_the_short_error_and_exit_on_error_still_raises(
        tmp_path: Path) -> None:
    from jsonargparse import ArgumentError
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    from lightning_debug.callbacks.cli import CompactErrors
    from tests.harness.toolkit import TinyRegressor

    class MyParser(CompactErrors, LightningArgumentParser):
        pass

    class MyCLI(LightningCLI):
        def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
            parser.add_argument("--tag", type=int, default=0)

    document = {"tag": 1, "trainer": {"callbacks": [
        {"class_path": "lightning_debug.GradientHealthCallback", "init_args": {"gradient_checking_frequency": 0}}]}}
    code, printed = _run_cli(tmp_path, document, subcommand=True, cli=MyCLI, parser=MyParser)
    assert code == 2 and len(printed.splitlines()) <= MAX_LINES, printed
    assert printed.startswith("error: trainer.callbacks[0] (lightning_debug.GradientHealthCallback)"
                              ".gradient_checking_frequency: ") and "allowed: an integer >= 1" in printed
    with pytest.raises(ArgumentError, match='(?s)Parser key "trainer.callbacks".*Not of type PositiveInt'), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MyCLI(TinyRegressor, run=False, save_config_callback=None, parser_class=MyParser,
              parser_kwargs={"exit_on_error": False}, args=["--config", str(tmp_path / "bad.yaml")])
    code, printed = _run_cli(tmp_path, {"tag": "x"}, cli=MyCLI, parser=MyParser)
    assert code == 2 and printed.startswith("error: tag: ") and "allowed: an integer" in printed, printed


def test_the_compact_cli_mixin_gives_every_parser_the_short_error_without_parser_class(tmp_path: Path) -> None:
    """``class CLI(CompactCLI, LightningCLI)``: the route for Lightning 2.2-2.5.0, which has no ``parser_class``
    (the matrix's lowest combination runs it on 2.2.5). Subcommand parsers too, and a project's own parser class
    keeps its own methods."""
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    from lightning_debug.callbacks.cli import CompactCLI, CompactErrors
    from tests.harness.toolkit import TinyRegressor

    class CLI(CompactCLI, LightningCLI):
        pass

    bad = {"trainer": {"callbacks": [
        {"class_path": "lightning_debug.GradientHealthCallback", "init_args": {"gradient_checking_frequency": 0}}]}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    for args in (["fit", "--config", str(path)], ["--config", str(path)]):
        code, printed = _printed(lambda: CLI(TinyRegressor, run=args[0] == "fit", save_config_callback=None,
                                             args=args))
        assert code == 2 and len(printed.splitlines()) <= MAX_LINES, printed
        assert printed.startswith("error: trainer.callbacks[0] (lightning_debug.GradientHealthCallback)"
                                  ".gradient_checking_frequency: ") and "allowed: an integer >= 1" in printed

    class OwnParser(LightningArgumentParser):
        def marker(self) -> str:
            return "own"

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        parser = CLI(TinyRegressor, run=False, save_config_callback=None, args=["--trainer.logger=false"],
                     **({"parser_class": OwnParser} if "parser_class" in inspect.signature(LightningCLI).parameters
                        else {})).parser
    assert isinstance(parser, CompactErrors) and isinstance(parser, LightningArgumentParser)
    if "parser_class" in inspect.signature(LightningCLI).parameters:
        assert isinstance(parser, OwnParser) and parser.marker() == "own"


# --- run-wide settings on any callback -----------------------------------------------------------------------------


def test_run_wide_settings_on_any_callback_are_honoured(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from tests.harness.toolkit import TinyRegressor

    callbacks = [AnomalyDetectionCallback(), GradientHealthCallback(),
                 MemoryProfilerCallback(DebugConfig(debug_output_dir="third_callback_dir", save_plots=False,
                                                    print_summary=False))]
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(TinyRegressor())
    written = list((tmp_path / "third_callback_dir").glob("*/report.json"))
    assert len(written) == 1, "the directory set on the third callback is the run's"
    assert not list(written[0].parent.glob("*.png")), "save_plots=False from the third callback"


def test_two_callbacks_that_disagree_on_a_run_wide_setting_are_an_error_naming_both(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from tests.harness.toolkit import TinyRegressor

    callbacks = [AnomalyDetectionCallback(debug_output_dir="a"), GradientHealthCallback(debug_output_dir="b")]
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with pytest.raises(ValueError, match="debug_output_dir is a setting of the whole run, but "
                                         "AnomalyDetectionCallback sets 'a' and GradientHealthCallback 'b'"):
        trainer.fit(TinyRegressor())


# --- a rule between two fields (issue 44) ---------------------------------------------------------------------------

CROSS_FIELD_RULE = "gradient_vanishing_threshold must be below gradient_explosion_threshold"
DEFAULT_PARSER_SCRIPT = """
from lightning.pytorch.cli import LightningCLI
from tests.harness.toolkit import TinyRegressor
LightningCLI(TinyRegressor, save_config_callback=None)
"""


def _cross_field_document(nested: bool) -> dict[str, Any]:
    threshold = {"gradient_explosion_threshold": 1e-9}
    return {"trainer": {"logger": False, "max_steps": 1, "enable_checkpointing": False, "callbacks": [
        {"class_path": "lightning_debug.GradientHealthCallback",
         "init_args": {"config": threshold} if nested else threshold}]}}


def _assert_cross_field_usage_error(code: int | None, printed: str, nested: bool) -> None:
    lines = [line for line in printed.splitlines() if line.strip() and not line.startswith("Seed set to")]
    owner = "lightning_debug.DebugConfig" if nested else "lightning_debug.GradientHealthCallback"
    assert code == 2 and len(lines) <= 3, printed[-3000:]
    assert lines[0] == f"error: {owner}: {CROSS_FIELD_RULE}", printed
    assert lines[1] == "  given: gradient_vanishing_threshold: 1e-06 (default), gradient_explosion_threshold: 1e-09", \
        printed
    assert "Traceback" not in printed


@pytest.mark.parametrize("parser, nested", [("lightning", False), ("compact", True)])
def test_a_cross_field_error_is_a_usage_error_with_either_parser(tmp_path: Path, parser: str, nested: bool) -> None:
    """``gradient_explosion_threshold: 1e-9`` (below the vanishing threshold) was exit 1 and 97 lines of two chained
    tracebacks with either parser: it is exit 2 and two lines, the keys, their values and the rule."""
    from tests.harness.toolkit import child_env

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(_cross_field_document(nested)))
    command = [sys.executable, "-c", DEFAULT_PARSER_SCRIPT] if parser == "lightning" else \
        [sys.executable, str(ROOT / "examples" / "train.py")]
    completed = subprocess.run([*command, "fit", "--config", "bad.yaml"], cwd=tmp_path,
                               env=child_env(PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=180)
    _assert_cross_field_usage_error(completed.returncode, completed.stdout + completed.stderr, nested)


@pytest.mark.parametrize("parser, nested", [("lightning", True), ("compact", False)])
def test_a_cross_field_error_in_process_is_the_same_usage_error(tmp_path: Path, parser: str, nested: bool) -> None:
    from lightning.pytorch.cli import LightningArgumentParser

    code, printed = _run_cli(tmp_path, _cross_field_document(nested), subcommand=True,
                             parser=LightningArgumentParser if parser == "lightning" else None)
    _assert_cross_field_usage_error(code, printed, nested)


def test_a_cross_field_error_from_python_is_still_a_value_error_naming_both_fields() -> None:
    from lightning_debug.errors import ConfigError

    with pytest.raises(ValueError, match="gradient_vanishing_threshold must be below DebugConfig.gradient_explosion_"
                                         "threshold") as raised:
        GradientHealthCallback(gradient_explosion_threshold=1e-9)
    assert isinstance(raised.value, ConfigError)
    assert raised.value.fields == ("gradient_vanishing_threshold", "gradient_explosion_threshold")
    assert raised.value.rule == CROSS_FIELD_RULE
