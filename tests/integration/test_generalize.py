"""Families the zoo did not cover (tests/harness/families.py), healthy and quiet: at the defaults and with every
check on every step, no finding of severity warning or above and no failed check (issue 24's fast subset:
LoRA, ConvNeXt, a top-1 mixture of experts, wav2vec2 with LayerDrop, MobileNetV2 at level ADVANCED). And a
layer never used in a mixture of experts is still ``missing_grad``, naming that layer and no expert."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

from lightning_debug import DebugConfig
from tests.harness.families import FAMILIES, LEVEL, every_step, switch_moe, train
from tests.harness.zoo import Plant

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]
STEPS = 24


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def needs(family: str) -> None:
    if family == "lora" and importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")


@pytest.mark.parametrize("checks", ["defaults", "every_step"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_healthy_family_is_quiet(family: str, checks: str, tmp_path: Path) -> None:
    needs(family)
    level = LEVEL.get(family, "basic")
    config = (DebugConfig(level=level, print_summary=False, save_plots=False) if checks == "defaults"
              else every_step(level=level))
    result = train(family, config, tmp_path, STEPS)
    assert not result.serious(), result.alarms()
    assert not result.report.get("failed_checks"), result.report.get("failed_checks")


def test_a_layer_never_used_in_a_mixture_of_experts_is_missing_and_no_expert_is(tmp_path: Path) -> None:
    result = train("switch_moe", every_step(), tmp_path, STEPS, module=switch_moe(plant=Plant(unused_layer=True)))
    missing = result.starts("missing_grad")
    assert [e["step"] for e in missing] == [0], result.alarms()
    assert missing[0]["severity"] == "warning"
    assert set(missing[0]["details"]["parameters"]) == {"unused_layer.weight", "unused_layer.bias"}
    assert "received no gradient on any of the" in missing[0]["message"]
    assert [e["kind"] for e in result.serious()] == ["missing_grad"], result.alarms()
