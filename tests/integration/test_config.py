"""DebugConfig: every field validated at construction, from Python and from a LightningCLI YAML file."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jsonargparse import get_loader

from lightning_debug import (AnomalyDetectionCallback, DebugConfig, DebugLevel, DebugMode, GradientHealthCallback,
                             MemoryProfilerCallback, PerformanceProfilerCallback, debug_callbacks)

FREQUENCIES = ["anomaly_check_frequency", "gradient_checking_frequency", "memory_profiling_frequency",
               "performance_profiling_frequency"]
BOOLEANS = ["save_debug_info", "log_gradients", "log_activations", "log_weights", "log_memory", "log_performance"]

INVALID: list[tuple[str, Any, str]] = (
    [("mode", "everything", "NONE, ANOMALY_DETECTION"), ("mode", 3, "FULL_DEBUG"),
     ("level", "deep", "BASIC, INTERMEDIATE, ADVANCED, EXPERT"),
     ("anomaly_detection_mode", "ignore", "warn, raise, skip, stop"), ("anomaly_detection_mode", None, "warn"),
     ("gradient_explosion_threshold", -1.0, ">= 0"), ("gradient_explosion_threshold", float("nan"), "finite"),
     ("gradient_vanishing_threshold", "small", ">= 0"),
     ("debug_output_dir", "", "non-empty"), ("debug_output_dir", 7, "non-empty")]
    + [(name, value, ">= 1") for name in FREQUENCIES for value in (0, -5, 2.5, "10", True)]
    + [(name, value, "True or False") for name in BOOLEANS for value in ("yes", 1, None)]
)


def test_defaults_match_the_contract() -> None:
    config = DebugConfig()
    assert (config.mode, config.level, config.anomaly_detection_mode) == (DebugMode.FULL_DEBUG, DebugLevel.BASIC, "warn")
    assert (config.anomaly_check_frequency, config.gradient_checking_frequency, config.memory_profiling_frequency,
            config.performance_profiling_frequency) == (1, 100, 50, 10)
    assert (config.gradient_explosion_threshold, config.gradient_vanishing_threshold) == (None, 1e-6)
    assert config.save_debug_info and config.debug_output_dir == "debug_outputs"
    assert not (config.log_gradients or config.log_activations or config.log_weights)
    assert config.log_memory and config.log_performance


@pytest.mark.parametrize(("field", "value", "allowed"), INVALID)
def test_invalid_values_name_the_field_and_what_is_allowed(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"DebugConfig\.{field} .*") as raised:
        DebugConfig(**{field: value})
    assert allowed in str(raised.value)


def test_strings_are_accepted_for_enums_and_modes() -> None:
    config = DebugConfig(mode="memory_profiling", level="Advanced", anomaly_detection_mode=" SKIP ")
    assert config.mode is DebugMode.MEMORY_PROFILING and config.level is DebugLevel.ADVANCED
    assert config.anomaly_detection_mode == "skip"
    assert DebugLevel.EXPERT > DebugLevel.ADVANCED >= DebugLevel.ADVANCED > DebugLevel.BASIC


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ValueError, match="DebugConfig has no field 'anomaly_frequency'"):
        DebugConfig().replace(anomaly_frequency=3)


@pytest.mark.parametrize(("mode", "expected"), [
    ("none", []), ("anomaly_detection", [AnomalyDetectionCallback]), ("gradient_checking", [GradientHealthCallback]),
    ("memory_profiling", [MemoryProfilerCallback]), ("performance_profiling", [PerformanceProfilerCallback]),
    ("full_debug", [AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback,
                    PerformanceProfilerCallback]),
])
def test_debug_callbacks_follow_the_mode(mode: str, expected: list[type]) -> None:
    config = DebugConfig(mode=mode, anomaly_check_frequency=4)
    callbacks = debug_callbacks(config)
    assert [type(c) for c in callbacks] == expected
    assert all(c.config == config for c in callbacks)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from([f.name for f in dataclasses.fields(DebugConfig)]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                       st.text(max_size=12)))
def test_any_value_is_either_accepted_or_a_value_error_naming_the_field(field: str, value: Any) -> None:
    try:
        config = DebugConfig(**{field: value})
    except ValueError as error:
        assert f"DebugConfig.{field}" in str(error)
    else:
        assert dataclasses.replace(config) == config  # an accepted value survives re-validation


def _run_cli(tmp_path: Path, yaml_text: str) -> Any:
    from lightning.pytorch.cli import LightningCLI

    from tests.harness.toolkit import TinyRegressor

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml_text)
    return LightningCLI(TinyRegressor, run=False, args=["--config", str(config_file)],
                        save_config_callback=None)


def test_lightning_cli_yaml_with_flat_overrides_and_nested_config(tmp_path: Path) -> None:
    cli = _run_cli(tmp_path, """
trainer:
  logger: false
  callbacks:
    - class_path: lightning_debug.GradientHealthCallback
      init_args:
        gradient_checking_frequency: 10
    - class_path: lightning_debug.AnomalyDetectionCallback
      init_args:
        anomaly_detection_mode: skip
        config:
          anomaly_check_frequency: 3
          level: ADVANCED
""")
    gradient, anomaly = [c for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_debug")]
    assert gradient.config.gradient_checking_frequency == 10
    assert anomaly.config.anomaly_detection_mode == "skip" and anomaly.config.anomaly_check_frequency == 3
    assert anomaly.config.level is DebugLevel.ADVANCED


def test_the_explosion_threshold_is_opt_in_and_bounds_the_vanishing_one_only_when_set() -> None:
    assert DebugConfig(gradient_vanishing_threshold=100.0).gradient_explosion_threshold is None
    with pytest.raises(ValueError, match="gradient_vanishing_threshold must be below"):
        DebugConfig(gradient_vanishing_threshold=100.0, gradient_explosion_threshold=50.0)
    config = DebugConfig(gradient_explosion_threshold=50)
    assert (config.gradient_explosion_threshold, type(config.gradient_explosion_threshold)) == (50.0, float)
    assert config.replace(level="advanced").gradient_explosion_threshold == 50.0
    assert DebugConfig().replace(gradient_explosion_threshold=None).gradient_explosion_threshold is None
    assert DebugConfig().to_dict()["gradient_explosion_threshold"] is None


def test_a_nested_config_block_means_what_the_same_values_flat_mean(tmp_path: Path) -> None:
    """Every field listed in a nested ``config:`` (as ``--print_config`` writes it) switches no rule on."""
    import yaml

    listed = DebugConfig().to_dict()  # null for gradient_explosion_threshold and profile_steps
    nested = yaml.safe_dump({"trainer": {"logger": False, "callbacks": [{
        "class_path": "lightning_debug.GradientHealthCallback",
        "init_args": {"config": dict(listed, gradient_checking_frequency=10)}}]}})
    flat = yaml.safe_dump({"trainer": {"logger": False, "callbacks": [{
        "class_path": "lightning_debug.GradientHealthCallback", "init_args": {"gradient_checking_frequency": 10}}]}})
    (tmp_path / "nested").mkdir()
    (tmp_path / "flat").mkdir()
    configs = [next(c for c in _run_cli(tmp_path / name, text).trainer.callbacks
                    if type(c).__module__.startswith("lightning_debug")).config
               for name, text in (("nested", nested), ("flat", flat))]
    assert configs[0] == configs[1] == DebugConfig(gradient_checking_frequency=10)
    assert configs[0].gradient_explosion_threshold is None


def test_lightning_cli_rejects_an_invalid_yaml_value(tmp_path: Path) -> None:
    with pytest.raises((ValueError, SystemExit)):
        _run_cli(tmp_path, """
trainer:
  callbacks:
    - class_path: lightning_debug.AnomalyDetectionCallback
      init_args:
        anomaly_detection_mode: ignore
""")


# --- property tests: many fields at once from Python, one field at a time from a LightningCLI YAML file ---
FIELD_NAMES = [f.name for f in dataclasses.fields(DebugConfig)]
CALLBACK_CLASSES = [AnomalyDetectionCallback, GradientHealthCallback, MemoryProfilerCallback,
                    PerformanceProfilerCallback]
WORDS = ["warn", "RAISE", " skip ", "ignore", "full_debug", "Anomaly_Detection", "NONE", "everything", "advanced",
         "EXPERT", "deep", "", "  ", "runs/debug", "10", "0", "-3", "2.5", "1e3", "nan", "yes", "no", "True", "off",
         "null"]
YAML_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 500), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS), st.text(max_size=6),
    st.lists(st.one_of(st.integers(-2, 30), st.floats(0, 3), st.booleans()), max_size=3),
)


def _names_field(message: str, field: str) -> bool:
    return re.search(rf"(?<!\w){field}(?!\w)", message) is not None


@settings(max_examples=100, deadline=None)
@given(values=st.dictionaries(st.sampled_from(FIELD_NAMES), YAML_VALUES, min_size=1, max_size=5))
def test_several_fields_at_once_are_accepted_or_rejected_naming_one_of_them(values: dict[str, Any]) -> None:
    try:
        config = DebugConfig(**values)
    except ValueError as error:
        assert any(_names_field(str(error), f"DebugConfig.{field}") for field in values), str(error)
    else:
        assert DebugConfig(**config.to_dict()) == config  # an accepted config survives a trip through plain values


class _QuotingDumper(yaml.SafeDumper):
    """Writes every string quoted, as a user who means a string writes it: ``safe_dump`` leaves ``1e3`` plain
    (a string to YAML 1.1) but jsonargparse reads a plain ``1e3`` as the float 1000.0, as YAML 1.2 does."""


_QuotingDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="'"))


def _yaml_through_lightning_cli(directory: Path, callback: type, init_args: dict[str, Any]) -> DebugConfig | str:
    """The callback's config as LightningCLI builds it from a YAML file, or the error text a user would see."""
    import argparse
    import io
    import warnings

    from lightning.pytorch.cli import LightningCLI

    from tests.harness.toolkit import TinyRegressor

    entry = {"class_path": f"lightning_debug.{callback.__name__}", "init_args": init_args}
    document = {"trainer": {"logger": False, "enable_checkpointing": False, "callbacks": [entry]}}
    text = yaml.dump(document, Dumper=_QuotingDumper, sort_keys=False)
    assert repr(get_loader("yaml")(text)) == repr(document), f"the file does not say what the test means:\n{text}"
    config_file = directory / "config.yaml"
    config_file.write_text(text)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LightningCLI warns that pytest's own argv is also there
            cli = LightningCLI(TinyRegressor, run=False, args=["--config", str(config_file)],
                               save_config_callback=None, parser_kwargs={"exit_on_error": False})
    except (ValueError, TypeError, argparse.ArgumentError) as error:
        return str(error)
    except SystemExit:
        return printed.getvalue()
    return next(c for c in cli.trainer.callbacks if isinstance(c, callback)).config


def _readings(text: Any) -> list[Any]:
    """What a YAML string can stand for once jsonargparse converts it: the YAML scalar it spells
    (``"10"``, ``"off"``, ``"null"``) or the number (``"1e3"``)."""
    import yaml

    if not isinstance(text, str):
        return []
    readings: list[Any] = []
    with contextlib.suppress(yaml.YAMLError):
        readings.append(yaml.safe_load(text))
    with contextlib.suppress(ValueError):
        readings.append(float(text))
    return readings


@settings(max_examples=50, deadline=None)
@given(field=st.sampled_from(FIELD_NAMES), value=YAML_VALUES, flat=st.booleans(),
       callback=st.sampled_from(CALLBACK_CLASSES))
@example(field="mode", value="full_debug", flat=False, callback=AnomalyDetectionCallback)
@example(field="level", value="advanced", flat=False, callback=GradientHealthCallback)
@example(field="level", value="deep", flat=True, callback=MemoryProfilerCallback)
@example(field="anomaly_check_frequency", value=2.5, flat=True, callback=AnomalyDetectionCallback)
@example(field="log_memory", value=1, flat=False, callback=MemoryProfilerCallback)
@example(field="profile_steps", value=[3, -1], flat=True, callback=PerformanceProfilerCallback)
@example(field="gradient_vanishing_threshold", value=50.0, flat=False, callback=GradientHealthCallback)
@example(field="debug_output_dir", value="1e3", flat=True, callback=AnomalyDetectionCallback)  # a float in plain YAML
def test_any_yaml_value_through_lightning_cli_is_accepted_as_in_python_or_an_error_naming_the_field(
        field: str, value: Any, flat: bool, callback: type) -> None:
    import inspect
    import tempfile

    flat = flat and field in inspect.signature(callback).parameters

    def in_python(candidate: Any) -> DebugConfig | None:
        try:
            return DebugConfig().replace(**{field: candidate}) if flat else DebugConfig(**{field: candidate})
        except ValueError:
            return None

    expected = in_python(value)
    with tempfile.TemporaryDirectory() as directory:
        outcome = _yaml_through_lightning_cli(Path(directory), callback,
                                              {field: value} if flat else {"config": {field: value}})
    if isinstance(outcome, str):
        assert _names_field(outcome, field), outcome[-2000:]
        assert expected is None, f"Python accepts {field}={value!r}, the YAML file should too: {outcome[-2000:]}"
    else:  # as Python has it, or the CLI read a string as what it spells (``"null"`` for an optional field)
        parsed = getattr(outcome, field)
        accepted = [expected] + [in_python(reading) for reading in _readings(value)]
        assert any(c is not None and getattr(c, field) == parsed for c in accepted), \
            f"{field}={value!r} became {parsed!r}"


# --- issue 17: what a user passes from Python ----------------------------------------------------------------


def test_path_like_and_numpy_values_are_accepted(tmp_path: Path) -> None:
    import numpy as np

    config = DebugConfig(debug_output_dir=tmp_path / "debug", anomaly_check_frequency=np.int64(3),
                         gradient_explosion_threshold=np.float32(20.0), slow_step_factor=np.float64(4.0),
                         memory_high_fraction=np.float32(0.5), log_weights=np.bool_(True),
                         profile_steps=(np.int64(2), np.int32(3)))
    assert config.debug_output_dir == str(tmp_path / "debug") and type(config.debug_output_dir) is str
    assert (config.anomaly_check_frequency, type(config.anomaly_check_frequency)) == (3, int)
    assert (config.gradient_explosion_threshold, type(config.gradient_explosion_threshold)) == (20.0, float)
    assert config.log_weights is True and config.profile_steps == (2, 3)
    assert config.memory_high_fraction == pytest.approx(0.5)
    assert DebugConfig(**config.to_dict()) == config
    assert DebugConfig(anomaly_check_frequency=np.float64(3.0)).anomaly_check_frequency == 3, \
        "a whole float is the integer it spells, as LightningCLI reads a YAML 3.0"
    with pytest.raises(ValueError, match="DebugConfig.anomaly_check_frequency"):
        DebugConfig(anomaly_check_frequency=np.float64(2.5))
    with pytest.raises(ValueError, match="DebugConfig.log_weights"):
        DebugConfig(log_weights=np.int64(1))


@pytest.mark.parametrize(("value", "message"), [
    ("runs/\0debug", "must not contain a NUL byte"),
    (Path("/etc/hostname"), "is an existing file"),
    ("/etc/hostname/sub", "'/etc/hostname' in '/etc/hostname/sub' is an existing file"),
    (Path("/etc/hostname/a/b"), "'/etc/hostname' in '/etc/hostname/a/b' is an existing file"),
    ("runs/" + "x" * 256 + "/debug", "path components of at most 255 bytes"),
    ("runs/" + "é" * 128, "path components of at most 255 bytes"),  # 256 bytes in UTF-8
    ("/".join(["d" * 200] * 21), "at most 4095 bytes in all"),
])
def test_output_paths_that_cannot_work_are_rejected_at_construction(value: Any, message: str) -> None:
    if not Path("/etc/hostname").is_file() and "existing" in message:
        pytest.skip("needs an existing file at an absolute path")
    with pytest.raises(ValueError, match=f"DebugConfig.debug_output_dir .*{message}"):
        DebugConfig(debug_output_dir=value)


def test_debug_callbacks_takes_a_config_a_mapping_or_a_mode_name() -> None:
    from lightning_debug.config import DebugMode

    assert [type(c) for c in debug_callbacks({"mode": "gradient_checking", "gradient_checking_frequency": 7})] == [
        GradientHealthCallback]
    assert debug_callbacks({"mode": "gradient_checking", "gradient_checking_frequency": 7})[0].config \
        .gradient_checking_frequency == 7
    assert [type(c) for c in debug_callbacks("anomaly_detection")] == [AnomalyDetectionCallback]
    assert [type(c) for c in debug_callbacks(DebugMode.MEMORY_PROFILING)] == [MemoryProfilerCallback]
    assert len(debug_callbacks("full_debug")) == 4 and len(debug_callbacks()) == 4
    for bad in (3, ["anomaly_detection"], object(), b"full_debug"):
        with pytest.raises(ValueError, match="expected a DebugConfig, a mapping of its fields or a mode name"):
            debug_callbacks(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="DebugConfig.mode must be one of"):
        debug_callbacks("everything")
    with pytest.raises(ValueError, match="DebugConfig has no field 'gradient_frequency'; did you mean "
                                         "'gradient_checking_frequency'"):
        debug_callbacks({"gradient_frequency": 7})


def test_profile_steps_is_bounded_and_says_why() -> None:
    assert DebugConfig(profile_steps=(0, 50)).profile_steps == (0, 50)
    with pytest.raises(ValueError, match=r"profile_steps length must be at most 50, got \(0, 1000000000000\): "
                                         r"torch.profiler keeps every event"):
        DebugConfig(profile_steps=(0, 10**12))


@pytest.mark.parametrize(("build", "closest"), [
    (lambda: DebugConfig(anomaly_check_frequncy=3), "anomaly_check_frequency"),
    (lambda: DebugConfig().replace(anomaly_check_frequncy=3), "anomaly_check_frequency"),
    (lambda: AnomalyDetectionCallback(anomaly_check_frequncy=3), "anomaly_check_frequency"),
    (lambda: GradientHealthCallback(DebugConfig(), log_gradient=True), "log_gradients"),
    (lambda: PerformanceProfilerCallback(profile_step=(1, 2)), "profile_steps"),
    (lambda: debug_callbacks({"anomaly_check_frequncy": 3}), "anomaly_check_frequency"),
])
def test_an_unknown_field_is_a_value_error_naming_the_closest_one_everywhere(build: Any, closest: str) -> None:
    with pytest.raises(ValueError, match=rf"has no (field|argument) '\w+'; did you mean '{closest}'\?"):
        build()


def test_an_unknown_keyword_of_the_accelerate_debugger_is_a_value_error() -> None:
    import torch
    from accelerate import Accelerator

    from lightning_debug.accelerate import AccelerateDebugger

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="DebugConfig has no field 'log_gradient'; did you mean 'log_gradients'"):
        AccelerateDebugger(accelerator, model, optimizer, log_gradient=True)


# --- issue 42: each field declared once; what is made from the declarations ----------------------------------------


def test_the_docs_table_of_fields_is_the_declarations() -> None:
    from lightning_debug.config import config_rows

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    lines = page.splitlines()
    start = lines.index("| field | default | allowed values | meaning |") + 2
    documented = lines[start:start + next(i for i, line in enumerate(lines[start:]) if not line.startswith("| "))]
    assert documented == config_rows(), "docs/configuration.md's table: paste lightning_debug.config.config_rows()"
    assert [row.split(" | ")[0][2:] for row in documented] == FIELD_NAMES


@pytest.mark.parametrize("callback", CALLBACK_CLASSES, ids=lambda callback: callback.__name__)
def test_each_callback_takes_its_areas_fields_typed_and_documented_as_declared(callback: type) -> None:
    import inspect

    from lightning_debug.config import EVERY_CALLBACK, SETTINGS, TYPES

    signature = inspect.signature(callback)
    overrides = [name for name in signature.parameters if name in SETTINGS]
    assert set(overrides) == {name for name, declared in SETTINGS.items() if callback.area in declared.areas}
    assert {"level", "save_debug_info", "debug_output_dir"} <= set(overrides)
    for name in overrides:
        parameter = signature.parameters[name]
        assert parameter.kind is parameter.KEYWORD_ONLY and parameter.default is None
        assert parameter.annotation == (TYPES[name] | None)
        assert " ".join(SETTINGS[name].doc.split()[:5]) in " ".join((callback.__doc__ or "").split())
    assert list(signature.parameters)[0] == "config"
    assert all(SETTINGS[name].areas != EVERY_CALLBACK for name in overrides[:-3]), "its own fields come first"


def test_the_area_settings_views_read_their_areas_fields_with_the_declared_defaults() -> None:
    from lightning_debug.config import EVERY_CALLBACK, SETTINGS, Area
    from lightning_debug.monitors.anomaly.settings import AnomalySettings
    from lightning_debug.monitors.gradients.settings import GradientSettings
    from lightning_debug.monitors.memory.settings import MemorySettings
    from lightning_debug.monitors.performance.settings import PerformanceSettings

    views = {Area.ANOMALY: AnomalySettings, Area.GRADIENTS: GradientSettings, Area.MEMORY: MemorySettings,
             Area.PERFORMANCE: PerformanceSettings}
    changed = DebugConfig(anomaly_detection_mode="skip", anomaly_check_frequency=3, gradient_checking_frequency=7,
                          gradient_explosion_threshold=9.0, log_gradients=True, memory_profiling_frequency=5,
                          memory_high_fraction=0.5, log_memory=False, performance_profiling_frequency=4,
                          slow_step_factor=5.0, dataloader_bottleneck_share=0.6, log_performance=False,
                          level="advanced")
    for area, view in views.items():
        read = {f.name: f.metadata["config_field"] for f in dataclasses.fields(view) if "config_field" in f.metadata}
        assert read, view
        for attribute, field in read.items():
            assert area in SETTINGS[field].areas or SETTINGS[field].areas == EVERY_CALLBACK, (view, field)
            assert getattr(view(), attribute) == getattr(DebugConfig(), field), (view, attribute)
            assert getattr(view.from_config(changed), attribute) == getattr(changed, field), (view, attribute)


@pytest.mark.parametrize(("callback", "page"), [
    (AnomalyDetectionCallback, "anomaly.md"), (GradientHealthCallback, "gradients.md"),
    (MemoryProfilerCallback, "memory.md"), (PerformanceProfilerCallback, "performance_profiler.md")])
def test_each_callback_page_lists_the_fields_it_takes(callback: type, page: str) -> None:
    from lightning_debug.config import fields_of

    text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text(encoding="utf-8")
    paragraph = text[text.index("\nFields ("):]
    paragraph = paragraph[paragraph.index(":", paragraph.index("configuration.md")):paragraph.index("\n\n")]
    assert tuple(re.findall(r"`(\w+)`", paragraph)) == fields_of(callback.area)


@pytest.mark.parametrize("value", [-1, 0, 1e-9, 0.5, 1, 1.0, 1.5, 2, 2.5, 50, 51, 10**6, float("inf"), float("nan"), True])
def test_each_bound_checks_the_same_at_parse_time_and_at_construction(value: Any) -> None:
    from lightning_debug.config_types import BOUNDS

    for bound in BOUNDS.values():
        if bound.base is str:
            continue
        try:
            bound.type(value)
        except ValueError:
            parsed = False
        else:
            parsed = True
        assert parsed is (bound.read(value) is not None), (bound.name, value)


def test_a_user_subclass_that_forwards_keywords_takes_the_callbacks_keywords() -> None:
    """Before, a subclass's own ``__init__(self, extra=1, **kwargs)`` accepted only ``extra``: every override was
    'no argument'."""

    class Mine(GradientHealthCallback):
        def __init__(self, extra: int = 1, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.extra = extra

    mine = Mine(extra=2, gradient_checking_frequency=7)
    assert (mine.extra, mine.config.gradient_checking_frequency) == (2, 7)
    with pytest.raises(ValueError, match="did you mean 'gradient_checking_frequency'"):
        Mine(gradient_checking_frequncy=7)
