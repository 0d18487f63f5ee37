"""The sweep's fast subset (issue 24): one healthy case per family from tests/harness/sweep_models.py, trained in a
real Trainer on CPU, must raise no finding of severity warning or above.

``benchmarks/sweep.py`` runs every case; these are the families issue 24 names (LoRA, ConvNeXt's layer
scale, top-1 MoE routing, wav2vec2's LayerDrop with every check every step, MobileNetV2 at ADVANCED)
and two plain transformers that must stay quiet. A case that cries wolf on the current rules can be
listed in :data:`KNOWN` as a strict xfail, so that it fails the suite once it passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.harness.sweep_models import Case, case_named, fit_case, switch  # noqa: E402
from tests.harness.zoo import Plant  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# Test id -> a false alarm the current rules still raise on that case (none: every family below is quiet).
KNOWN: dict[str, str] = {}


def case(name: str, setting: str, needs: str | None = None) -> Any:
    test_id = f"{name}-{setting}"
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[test_id])] if test_id in KNOWN else []
    return pytest.param(name, setting, needs, id=test_id, marks=marks)


CASES = [
    case("lora_llama", "defaults", needs="peft"),
    case("convnext_layer_scale", "defaults"),
    case("switch_top1", "defaults"),
    case("switch_32_experts", "defaults"),
    case("wav2vec2_layerdrop", "every_step"),
    case("mobilenet_v2_advanced", "defaults"),
    case("adaln_zero_dit", "defaults"),
    case("bert", "every_step"),
    case("gpt2", "defaults"),
    case("marian", "defaults"),  # sinusoidal position tables built frozen, in AdamW(self.parameters())
    case("ernie4_5_moe", "defaults"),  # a router bias built frozen (updated outside the optimizer)
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the zoo runs (two spin-waiting OpenMP threads on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("name", "setting", "needs"), CASES)
def test_healthy_case_is_quiet(name: str, setting: str, needs: str | None, tmp_path: Path) -> None:
    if needs:
        pytest.importorskip(needs)
    outcome = fit_case(case_named(name), setting, tmp_path)
    assert outcome.status == "trained", outcome.reason
    assert outcome.steps == 30
    assert outcome.quiet, f"findings of severity warning or above on a healthy run:\n{outcome.alarms()}"


@pytest.mark.parametrize("experts", [8, 32])
def test_unused_layer_in_moe_is_still_missing_grad(experts: int, tmp_path: Path) -> None:
    """Routing must not excuse everything: a layer of the MoE model that no forward ever uses is named, also
    where experts wait many steps for their first token (which lengthens the wait before it is confirmed)."""
    planted = Case("switch_top1_unused", "hand", "Switch, an unused layer",
                   lambda: switch(Plant(unused_layer=True), experts=experts))
    outcome = fit_case(planted, "defaults", tmp_path)
    assert outcome.status == "trained", outcome.reason
    missing = [f for f in outcome.findings if f["kind"] == "missing_grad"]
    assert any("unused_layer.weight" in f["message"] for f in missing), outcome.alarms()
    assert all(f["message"].startswith("2 of ") for f in missing), "only the unused layer's weight and bias"


@pytest.mark.parametrize("name", ["beit", "modernvbert"])
def test_a_long_healthy_run_has_no_vanishing_grad(name: str, tmp_path: Path) -> None:
    """300 steps, every check every step: BEiT's class token shrinks under 1e-6 once its loss is 1/170 of its start
    (a converged run), ModernVBERT's two layers sit flat 300x under its head while its loss falls 6x (one cliff, no
    fade); both were named before (the 300-step sweep). Their twins: tests/unit/test_gradient_rules.py and
    tests/unit/test_fade_rule.py."""
    outcome = fit_case(case_named(name), "every_step", tmp_path, steps=300)
    assert outcome.status == "trained" and outcome.steps == 300, outcome.reason
    assert not [f for f in outcome.findings if f["kind"] == "vanishing_grad"], outcome.alarms()


def test_the_really_unstable_run_is_named_in_its_first_steps_at_the_defaults(tmp_path: Path) -> None:
    """MobileNetV1 (AdamW 1e-3): its global norm goes 803, 4.4e4, 2e3, 0.35, 0.0025, 0.0029 with the loss at chance
    (0.693), then 7,720 at step 6, and the loss reaches 32.6 at step 13. The jump out of a norm that collapsed while
    the loss did not fall is a runaway even below the 4.4e4 of step 1 (the twin, a saturated classifier whose loss
    fell with its norm, is tests/integration/test_saturated_runaway.py)."""
    outcome = fit_case(case_named("mobilenet_v1"), "defaults", tmp_path)
    assert outcome.status == "trained", outcome.reason
    exploding = [f["step"] for f in outcome.findings if f["kind"] == "exploding_grad"]
    assert exploding and exploding[0] <= 10, outcome.alarms()
