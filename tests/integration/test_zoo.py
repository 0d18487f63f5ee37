"""The model zoo (tests/harness/zoo.py): stock models nobody here wrote, run healthy and with the bugs users plant.

A healthy run must raise no finding of severity warning or above and no check may fail; a planted
bug must be named at its step with its cause, at the default level. Each test id is
``<model>-<plant>``. The cases that fail today are listed in :data:`KNOWN`, each with the kind it
raises wrongly (or misses) and the part of issue 13 that fixes it; they are strict xfails, so a case
that starts passing fails the suite until its line is removed (:data:`FLAKY`: the cases that fail on
some runs only). docs/zoo.md has the table of verdicts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.zoo import HEALTHY, LOSS_GRAD_FN, TRANSFORMERS_MODELS, Plant, Result, defaults, every_check, fit

pytestmark = pytest.mark.timeout(180)

DIVERGENCE_KINDS = ("loss_spike", "loss_divergence", "update_ratio_high")
NONFINITE_KINDS = ("nonfinite_input", "nonfinite_activation", "nonfinite_loss", "nonfinite_grad", "nonfinite_param")

# Cases that fail before the fixes of issue 13, by test id: "<kind> <false alarm|missed|wrong cause>: <why>".
_GRAD = "issue 13 (gradient thresholds)"
_CAUSE = "issue 13 (root cause ordering)"
_DIVERGE = "issue 13 (early divergence)"
_PERF = "issue 13 (slow_step/dataloader/census/leak explanation)"
_MULTI = "issue 13 (multi-optimizer)"
KNOWN: dict[str, str] = {
}


# Cases that fail on some runs only (step timing on a loaded 2-core machine): xfail, not strict.
FLAKY: dict[str, str] = {
}


def case(model: str, plant: str) -> Any:
    """A parameter ``model`` with id ``<model>-<plant>``: a strict xfail when :data:`KNOWN` lists it, a
    lenient one when :data:`FLAKY` does."""
    test_id = f"{model}-{plant}"
    marks = []
    if test_id in KNOWN:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[test_id]))
    elif test_id in FLAKY:
        marks.append(pytest.mark.xfail(strict=False, reason=FLAKY[test_id]))
    return pytest.param(model, id=test_id, marks=marks)


def cases(plant: str, *models: str) -> list[Any]:
    return [case(model, plant) for model in models]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: on 2 cores shared with other processes, two OpenMP threads spin-wait for each
    other and a 24-step run takes 20 s instead of 0.5 s (and its step times mean nothing)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def needs(model: str) -> None:
    if model in TRANSFORMERS_MODELS:
        pytest.importorskip("transformers")


def assert_quiet(result: Result) -> None:
    assert not result.serious(), f"findings of severity warning or above on a healthy run:\n{result.alarms()}"
    assert not result.report.get("failed_checks"), result.report["failed_checks"]
    assert result.report["status"] == "finished"


def nonfinite_order(result: Result) -> list[str]:
    return [kind for kind in result.findings_order() if kind in NONFINITE_KINDS]


# --- healthy runs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", cases("healthy", "bert", "gpt2", "resnet", "t5", "demo_transformer", "boring",
                                        "mlp24", "gan", "lstm"))
def test_healthy_run_with_every_check_is_quiet(model: str, tmp_path: Path) -> None:
    needs(model)
    assert_quiet(fit(model, HEALTHY, every_check(), tmp_path, max_steps=24))


@pytest.mark.parametrize("model", cases("defaults", "mlp24", "bert", "resnet"))
def test_healthy_run_with_defaults_is_quiet(model: str, tmp_path: Path) -> None:
    needs(model)
    assert_quiet(fit(model, HEALTHY, defaults(), tmp_path, max_steps=24))


@pytest.mark.parametrize("model", cases("every_step", "gan", "gan_untoggled"))
def test_gan_with_every_check_every_step_is_quiet(model: str, tmp_path: Path) -> None:
    """Two optimizers stepped in one manual ``training_step``: each optimizer step is judged on the
    parameters its optimizer owns (``gan_untoggled`` leaves the generator's gradients unset)."""
    config = every_check(gradient_checking_frequency=1, memory_profiling_frequency=1)
    assert_quiet(fit(model, HEALTHY, config, tmp_path, max_steps=24))


@pytest.mark.parametrize("model", cases("frequency_10", "gan", "gan_untoggled"))
def test_gan_with_checks_every_10_steps_is_quiet(model: str, tmp_path: Path) -> None:
    config = every_check(anomaly_check_frequency=10, gradient_checking_frequency=10, memory_profiling_frequency=10,
                         performance_profiling_frequency=10)
    assert_quiet(fit(model, HEALTHY, config, tmp_path, max_steps=40))


@pytest.mark.parametrize("model", cases("advanced", "gan", "gan_untoggled"))
def test_gan_at_advanced_level_is_quiet(model: str, tmp_path: Path) -> None:
    """ADVANCED adds frozen-parameter checks and replays; its profiler window is left out (cost only)."""
    config = every_check(gradient_checking_frequency=1, level="advanced", profile_steps=(0, 0))
    assert_quiet(fit(model, HEALTHY, config, tmp_path, max_steps=16))


@pytest.mark.parametrize("model", cases("returns_none", "mlp24", "boring"))
def test_training_step_returning_none_is_quiet(model: str, tmp_path: Path) -> None:
    """Lightning skips the optimizer step of a batch whose ``training_step`` returns None: no gradients
    that step is not a layer that is never used."""
    assert_quiet(fit(model, Plant(return_none_every=3), every_check(gradient_checking_frequency=1), tmp_path,
                     max_steps=16))


# --- planted bugs, default configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("model", cases("log_zero", "mlp24", "bert", "gpt2", "resnet", "t5", "demo_transformer",
                                        "boring", "lstm"))
def test_log_of_zero_in_the_loss_is_named_at_its_step_loss_first(model: str, tmp_path: Path) -> None:
    """``loss + log(0 * loss)`` at step 5: the loss is -inf and every gradient NaN at step 5; the weights
    break in step 5's update, a consequence, which must neither be listed first nor blamed on the
    learning rate. On the CPU the defaults replay the step: the `log` comes first."""
    needs(model)
    result = fit(model, Plant(log_zero_at=5), defaults(), tmp_path, max_steps=7)
    loss = result.starts("nonfinite_loss")
    assert loss and loss[0]["step"] == 5, result.alarms()
    assert "parameters are already non-finite" not in loss[0]["message"], loss[0]["message"]
    assert result.first_step("nonfinite_grad") == 5, result.alarms()
    for event in result.starts("nonfinite_param"):
        assert event["step"] >= 5, event
        assert not re.search(r"with finite gradients", event["message"], re.I), event["message"]
    order = nonfinite_order(result)
    assert order[0] == "nonfinite_activation" and order[1] in ("nonfinite_loss", "nonfinite_grad"), order
    activation = result.starts("nonfinite_activation")
    assert activation[0]["step"] == 5 and "`torch.log`" in activation[0]["message"], activation


@pytest.mark.parametrize("model", cases("nan_input", "mlp24", "resnet", "boring"))
def test_nan_sample_in_the_batch_is_named_with_its_sample_first(model: str, tmp_path: Path) -> None:
    needs(model)
    result = fit(model, Plant(nan_input_at=3, nan_sample=1), defaults(), tmp_path, max_steps=5)
    inputs = result.starts("nonfinite_input")
    assert [e["step"] for e in inputs] == [3], result.alarms()
    assert inputs[0]["details"]["samples"] == [1]
    loss = result.starts("nonfinite_loss")
    assert loss and loss[0]["step"] == 3 and "parameters are already non-finite" not in loss[0]["message"], \
        result.alarms()
    assert nonfinite_order(result)[0] == "nonfinite_input", result.findings_order()


@pytest.mark.parametrize("model", cases("nan_input_skip", "resnet", "mlp24"))
def test_skip_mode_drops_the_nan_batch_without_a_trace(model: str, tmp_path: Path) -> None:
    """``anomaly_detection_mode="skip"`` on the NaN sample of step 3: the update is dropped, and what the
    forward changed goes with it (BatchNorm running statistics of the ResNet), so every parameter and
    buffer is finite at the end and the run goes on."""
    needs(model)
    result = fit(model, Plant(nan_input_at=3, nan_sample=1), defaults(anomaly_detection_mode="skip"), tmp_path,
                 max_steps=6)
    assert [e["step"] for e in result.starts("nonfinite_input")] == [3], result.alarms()
    assert not result.nonfinite_state(), result.nonfinite_state()
    assert not result.starts("nonfinite_param"), result.alarms()
    assert result.report["status"] == "finished" and result.report["last_step"] >= 5, result.report["last_step"]


@pytest.mark.parametrize("model", cases("lr_10", "mlp24", "bert", "gpt2", "resnet"))
def test_learning_rate_far_too_high_is_a_warning_before_any_nan(model: str, tmp_path: Path) -> None:
    """AdamW lr=10: the loss jumps by orders of magnitude from step 1 and the update-to-weight ratio of
    step 0 is far above 1; a warning must come within the first 3 steps, before anything is NaN."""
    needs(model)
    result = fit(model, Plant(lr=10.0), defaults(), tmp_path, max_steps=6)
    early = [e for e in result.serious() if e["kind"] in DIVERGENCE_KINDS]
    assert early, result.alarms()
    first = min(early, key=lambda e: e["step"])
    assert first["step"] <= 3, first
    nonfinite = [e["step"] for e in result.serious() if e["kind"] in NONFINITE_KINDS]
    assert first["step"] < min(nonfinite, default=math.inf), result.alarms()
    assert re.search(r"learning rate|\blr\b", first["message"], re.I), first["message"]


@pytest.mark.parametrize("model", cases("unused_layer", "mlp24", "bert", "lstm"))
def test_layer_never_used_is_a_missing_gradient_named(model: str, tmp_path: Path) -> None:
    needs(model)
    result = fit(model, Plant(unused_layer=True), defaults(), tmp_path, max_steps=3)
    missing = result.starts("missing_grad")
    assert missing and missing[0]["step"] == 0, result.alarms()
    assert set(missing[0]["details"]["parameters"]) == {"unused_layer.weight", "unused_layer.bias"}


@pytest.mark.parametrize("model", cases("kept_graph", "mlp24", "gpt2"))
def test_losses_kept_with_their_graph_are_a_leak_explained_by_the_graph(model: str, tmp_path: Path) -> None:
    """``losses.append(loss)``: memory_growth whose explanation leads with the loss's graph; the memory
    check's own census (hundreds of ms) must not show up as a slow step."""
    needs(model)
    # 12 memory checks (readings are at least 8 steps apart): the verdict needs 2 warm-up readings, 6 for a trend
    # and one to confirm it; 72 steps gave exactly those 9, and one noisy reading missed it
    config = defaults(memory_profiling_frequency=8, performance_profiling_frequency=1)
    result = fit(model, Plant(keep_graph=True), config, tmp_path, max_steps=96)
    growth = result.starts("memory_growth")
    assert growth and growth[0]["severity"] == "warning", result.alarms()
    assert growth[0]["details"]["tensors"][0]["grad_fn"] == LOSS_GRAD_FN[model], growth[0]["details"]["tensors"]
    message = growth[0]["message"]
    graph_at, no_graph_at = message.find(LOSS_GRAD_FN[model]), message.find("without a graph")
    assert graph_at >= 0 and (no_graph_at < 0 or graph_at < no_graph_at), message
    assert not result.starts("slow_step"), result.alarms()


@pytest.mark.parametrize("model", cases("slow_data", "resnet", "gpt2"))
def test_dataset_that_sleeps_is_a_dataloader_bottleneck(model: str, tmp_path: Path) -> None:
    """4 ms per sample in ``__getitem__`` (32-64 ms per batch, more than the step's compute), timed every
    step: a sustained bottleneck, found within the 12 steps however many timed steps the verdict needs."""
    needs(model)
    result = fit(model, Plant(data_sleep_s=0.004), defaults(performance_profiling_frequency=1), tmp_path,
                 max_steps=12)
    bottleneck = result.starts("dataloader_bottleneck")
    assert bottleneck and bottleneck[0]["step"] <= 11, result.alarms()
    assert bottleneck[0]["details"]["num_workers"] == 0 and bottleneck[0]["details"]["share"] > 0.3
