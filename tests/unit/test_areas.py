"""The one table of areas: every area has a row, and what the callbacks, presets and monitors use is derived from it."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_debug import DebugConfig
from lightning_debug.config import Area
from lightning_debug.core.kinds import KIND_SPECS
from lightning_debug.core.monitor import Monitor
from lightning_debug.monitors import AREA_SPECS, companion_monitors, monitors_for, run_monitors
from lightning_debug.presets import CALLBACK_BY_AREA

FIELDS = {field.name for field in dataclasses.fields(DebugConfig)}


def test_every_area_has_one_row_in_area_order() -> None:
    assert list(AREA_SPECS) == list(Area)
    assert all(spec.area is area and spec.monitor.area is area for area, spec in AREA_SPECS.items())


@pytest.mark.parametrize("area", list(Area), ids=lambda area: area.value)
def test_the_frequency_reader_reads_the_frequency_field_of_its_settings(area: Area) -> None:
    spec = AREA_SPECS[area]
    assert set(spec.settings) <= FIELDS
    frequency_fields = [name for name in FIELDS if name.endswith("_frequency")]
    read = [name for name in frequency_fields if spec.frequency(DebugConfig(**{name: 7})) == 7]
    assert len(read) == 1
    if spec.callback is not None:
        assert read[0] in spec.settings
    monitor = spec.build(DebugConfig(**{read[0]: 7}), "test")
    assert type(monitor) is spec.monitor and monitor.frequency == 7 and monitor.report_section()["check_frequency"] == 7


def test_the_monitor_base_takes_its_frequency_as_given_or_from_its_row() -> None:
    class Unlisted(Monitor):
        area = Area.LOOP

    assert Unlisted(DebugConfig(), "test", frequency=3).schedule.is_due(3)
    with pytest.raises(TypeError, match="no row in the table of areas"):
        Unlisted(DebugConfig(), "test")


def test_callbacks_and_their_state_keys_come_from_the_table() -> None:
    assert {area: callback.__name__ for area, callback in CALLBACK_BY_AREA.items()} == {
        area: spec.callback for area, spec in AREA_SPECS.items() if spec.callback is not None}
    assert set(CALLBACK_BY_AREA) == set(DebugConfig().areas)
    for area, callback in CALLBACK_BY_AREA.items():
        assert callback.area is area and callback.own_fields == AREA_SPECS[area].settings
    assert CALLBACK_BY_AREA[Area.ANOMALY].own_fields == ("anomaly_detection_mode", "anomaly_check_frequency")


def test_companions_and_run_wide_monitors() -> None:
    for config in (DebugConfig(), DebugConfig(log_activations=True)):  # verdicts always, scalars with the setting
        assert [m.area for m in companion_monitors(Area.GRADIENTS, config, "test")] == [Area.ACTIVATIONS]
    assert [m.area for m in run_monitors(DebugConfig(), "test")] == [Area.LOOP, Area.ERRORS]
    assert [m.area for m in monitors_for(DebugConfig(), "test")] == list(Area)
    assert monitors_for(DebugConfig(mode="none"), "test") == []


def test_each_monitor_writes_only_kinds_of_its_own_area() -> None:
    for area, spec in AREA_SPECS.items():
        assert all(KIND_SPECS[kind].area is area for kind in spec.monitor.kinds), area
