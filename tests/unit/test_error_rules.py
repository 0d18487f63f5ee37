"""The user's exception explained, fed recorded PyTorch messages and traceback readings: no Trainer, milliseconds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import DebugConfig
from lightning_debug.checks.errors import failing_module
from lightning_debug.core.context import RunContext
from lightning_debug.core.kinds import ERROR_ADVICE, ErrorCategory
from lightning_debug.errors import AnomalyError
from lightning_debug.monitors.errors import EXPLANATIONS_KEPT, NAMES_SHOWN, ErrorMonitor, classify, explain_error
from lightning_debug.run import Run

# Messages as PyTorch 2.x writes them (recorded, so the tests need no GPU and no process group).
SHAPE = "mat1 and mat2 shapes cannot be multiplied (5x2 and 3x1)"
DEVICE = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
INPLACE = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
           "[torch.FloatTensor [3, 2]], which is output 0 of ReluBackward0, is at version 1; expected version 0 "
           "instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, "
           "with torch.autograd.set_detect_anomaly(True, check_nan=False).")
LEAF = "a leaf Variable that requires grad is being used in an in-place operation."
DDP_PREFIX = ("Expected to have finished reduction in the prior iteration before starting a new one. This error "
              "indicates that your module has parameters that were not used in producing loss. ")
DDP_NAMED = DDP_PREFIX + "Parameters which did not receive grad for rank 0: unused.weight, unused.bias\n"
DDP_INDEXED = DDP_PREFIX + "Parameter indices which did not receive grad for rank 1: 2 3\n"


@pytest.mark.parametrize(("error", "category"), [
    (RuntimeError(SHAPE), ErrorCategory.SHAPE_MISMATCH),
    (RuntimeError("The size of tensor a (4) must match the size of tensor b (3) at non-singleton dimension 1"),
     ErrorCategory.SHAPE_MISMATCH),
    (RuntimeError(DEVICE), ErrorCategory.DEVICE_MISMATCH),
    (RuntimeError("Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same"),
     ErrorCategory.DEVICE_MISMATCH),
    (RuntimeError("expected scalar type Float but found Double"), ErrorCategory.DTYPE_MISMATCH),
    (IndexError("Target 5 is out of bounds."), ErrorCategory.INDEX_OUT_OF_RANGE),
    (RuntimeError(INPLACE), ErrorCategory.INPLACE_OPERATION),
    (RuntimeError(LEAF), ErrorCategory.INPLACE_OPERATION),
    (RuntimeError(DDP_NAMED), ErrorCategory.DDP_UNUSED_PARAMETERS),
    (RuntimeError("Trying to backward through the graph a second time"), ErrorCategory.BACKWARD_TWICE),
    (RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"), ErrorCategory.NO_GRAD),
    (RuntimeError("CUDA error: device-side assert triggered"), ErrorCategory.DEVICE_ASSERT),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), ErrorCategory.OOM),
    (ValueError("my own bug"), ErrorCategory.OTHER),
])
def test_classify_reads_type_and_message(error: BaseException, category: ErrorCategory) -> None:
    assert classify(error) is category


def test_every_category_has_advice() -> None:
    assert set(ERROR_ADVICE) == set(ErrorCategory)


def _shape_error() -> tuple[RuntimeError, nn.Module]:
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(3, 1))
    try:
        model(torch.ones(5, 4))
    except RuntimeError as error:
        return error, model
    raise AssertionError("the model should not accept its own output")


def test_shape_mismatch_names_the_module_its_input_and_what_it_expects() -> None:
    error, model = _shape_error()
    module = failing_module(error, model)
    explained = explain_error(7, error, module)
    assert explained["category"] == "shape_mismatch" and explained["step"] == 7
    message = explained["message"]
    assert "in module `1`" in message and "[5, 2]" in message and "in_features=3" in message
    assert "`weight` [1, 3]" in message and message.endswith(f"PyTorch says: {str(error).splitlines()[0]}")
    assert explained["details"]["modules"] == ["1"]
    assert explained["advice"] == ERROR_ADVICE[ErrorCategory.SHAPE_MISMATCH]


def test_shape_mismatch_outside_a_module_names_the_innermost_tensors() -> None:
    innermost = {"input": {"shape": [4, 3], "dtype": "float32", "device": "cpu"},
                 "target": {"shape": [4, 2], "dtype": "float32", "device": "cpu"}}
    explained = explain_error(0, RuntimeError(SHAPE), innermost=innermost)
    assert "the tensors involved: `input` [4, 3], `target` [4, 2]." in explained["message"]
    assert explained["details"]["tensors"] == innermost and "modules" not in explained["details"]


def test_device_mismatch_names_both_devices_and_the_operands() -> None:
    innermost = {"x": {"shape": [2], "dtype": "float32", "device": "cuda:0"},
                 "w": {"shape": [2], "dtype": "float32", "device": "cpu"}}
    explained = explain_error(1, RuntimeError(DEVICE), innermost=innermost)
    assert explained["category"] == "device_mismatch"
    assert explained["details"]["devices"] == ["cuda:0", "cpu"]
    assert "`x` cuda:0, `w` cpu" in explained["message"]


def test_an_error_with_nothing_to_read_says_what_pytorch_said() -> None:
    explained = explain_error(2, ValueError("my own bug"))
    assert explained["message"] == "ValueError at step 2 (other): PyTorch says: my own bug"
    assert explained["details"]["module"] is None and explained["details"]["source"] is None


def test_a_category_without_operands_gets_its_sentence() -> None:
    explained = explain_error(3, RuntimeError("Trying to backward through the graph a second time"))
    assert "an earlier backward already freed" in explained["message"]


def test_index_out_of_range_compares_the_label_with_the_class_count() -> None:
    innermost = {"input": {"shape": [4, 3], "dtype": "float32", "device": "cpu"},
                 "target": {"shape": [4], "dtype": "int64", "device": "cpu"}}
    explained = explain_error(0, IndexError("Target 5 is out of bounds."), innermost=innermost)
    assert explained["details"]["label"] == 5 and explained["details"]["num_classes"] == 3
    assert "labels must be in [0, 3)" in explained["message"]


def test_inplace_without_a_replay_reads_the_modified_tensor_from_the_message() -> None:
    explained = explain_error(4, RuntimeError(INPLACE))
    assert explained["details"]["modified"] == {"node": "ReluBackward0", "output": 0, "shape": [3, 2],
                                                "saved_version": 0, "version": 1}
    assert "version 0 -> 1" in explained["message"] and "inplace" not in explained["details"]


def test_inplace_with_a_replay_names_the_operation_module_and_line() -> None:
    asked: list[tuple[str, list[int]]] = []

    def replay(node: str, shape: list[int]) -> dict[str, Any]:
        asked.append((node, shape))
        return {"operation": "Tensor.add_", "module": "block.act", "module_type": "ReLU", "modified": node,
                "shape": shape, "source": {"file": "/home/me/model.py", "line": 12, "code": "h += 1"}}

    explained = explain_error(4, RuntimeError(INPLACE), replay_inplace=replay)
    assert asked == [("ReluBackward0", [3, 2])]
    assert explained["details"]["modules"] == ["block.act"]
    assert explained["details"]["inplace"]["operation"] == "Tensor.add_"
    assert "`Tensor.add_` at model.py:12 (`h += 1`) in module `block.act` (ReLU)" in explained["message"]


def test_inplace_on_a_leaf_parameter() -> None:
    explained = explain_error(0, RuntimeError(LEAF))
    assert explained["details"]["leaf"] is True and "torch.no_grad()" in explained["message"]


def test_ddp_unused_parameters_by_name_asks_for_no_parameter_list() -> None:
    def trainable() -> list[str]:
        raise AssertionError("names given: no need to list the parameters")

    explained = explain_error(9, RuntimeError(DDP_NAMED), trainable_names=trainable)
    assert explained["details"]["parameters"] == ["unused.weight", "unused.bias"]
    assert "2 parameter(s) received no gradient" in explained["message"]
    assert "find_unused_parameters=True" in explained["message"]


def test_ddp_unused_parameters_by_index_maps_through_the_trainable_parameters() -> None:
    names = ["inp.weight", "inp.bias", "unused.weight", "unused.bias"]
    explained = explain_error(9, RuntimeError(DDP_INDEXED), trainable_names=lambda: names)
    assert explained["details"]["indices"] == [2, 3]
    assert explained["details"]["parameters"] == ["unused.weight", "unused.bias"]


def test_ddp_unused_parameters_without_names_or_indices() -> None:
    explained = explain_error(9, RuntimeError(DDP_PREFIX))
    assert explained["details"]["parameters"] == []
    assert "some parameters received no gradient" in explained["message"]


def test_ddp_names_shown_are_bounded() -> None:
    many = ", ".join(f"p{i}" for i in range(NAMES_SHOWN + 5))
    explained = explain_error(0, RuntimeError(DDP_PREFIX + f"Parameters which did not receive grad for rank 0: {many}"))
    assert len(explained["details"]["parameters"]) == NAMES_SHOWN
    assert f"{NAMES_SHOWN + 5} parameter(s)" in explained["message"]


# --- the monitor's plumbing, through a run with a minimal context ----------------------------------

def _run() -> tuple[Run, ErrorMonitor]:
    config = DebugConfig(save_debug_info=False, print_summary=False, save_plots=False)
    monitor = ErrorMonitor(config, "test")
    run = Run(config, RunContext(), [monitor])
    run.start(0)
    return run, monitor


def test_interrupts_and_the_packages_own_error_are_not_explained() -> None:
    run, monitor = _run()
    run.exception(0, KeyboardInterrupt())
    run.exception(0, AnomalyError("stopped by the anomaly policy", 0, ["nonfinite_loss"]))
    assert monitor.explanations == [] and monitor.tally.kinds == {}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_explanations_are_bounded_and_each_error_is_explained_once() -> None:
    run, monitor = _run()
    errors = [RuntimeError(f"{SHAPE} #{i}") for i in range(EXPLANATIONS_KEPT + 2)]
    for step, error in enumerate(errors):
        run.exception(step, error)
        run.exception(step, error)  # the adapter may report the same error twice
    assert [e["step"] for e in monitor.explanations] == list(range(2, EXPLANATIONS_KEPT + 2))
    assert monitor.tally.kinds["exception"]["steps"] == EXPLANATIONS_KEPT + 2
    report = run.finish("failed", EXPLANATIONS_KEPT + 2)
    assert report is not None and len(report["sections"]["errors"]["explanations"]) == EXPLANATIONS_KEPT
