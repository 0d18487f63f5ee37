"""The support matrix's unit tier: each private torch name is probed against the installed torch, its public
fallback gives the same numbers, and the Python 3.10 stand-ins behave as the 3.11+ originals."""

from __future__ import annotations

import enum
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import lightning_debug
from lightning_debug.checks import dispatch, fused
from lightning_debug.checks.numerics import NormPlan, fused_norms
from lightning_debug.core import buffers
from lightning_debug.core.context import RunStatus
from lightning_debug.core.error_categories import ErrorCategory
from lightning_debug.core.ledger import FrameworkWork
from lightning_debug.core.strenum import StrEnum
from lightning_debug.monitors.gradients.exploding import ClipAlgorithm
from lightning_debug.monitors.gradients.trainability import FrozenCause
from lightning_debug.monitors.memory import history
from lightning_debug.monitors.memory.growth import GrowthStatus

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def test_the_foreach_norm_dtype_probe_agrees_with_the_installed_torch() -> None:
    """``torch._foreach_norm(..., dtype=)`` arrived in torch 2.4; the probe must say so on every torch."""
    assert fused.FOREACH_NORM_DTYPE == (TORCH >= (2, 4))
    try:
        torch._foreach_norm([torch.ones(2, dtype=torch.float16)], 2, dtype=torch.float32)
        takes_dtype = True
    except TypeError:
        takes_dtype = False
    assert fused.FOREACH_NORM_DTYPE == takes_dtype


def test_every_probe_agrees_with_the_installed_torch() -> None:
    assert fused.FOREACH == {name: hasattr(torch, name) for name in fused.FOREACH}
    assert fused.FLATTEN_DENSE == hasattr(torch._C._nn, "flatten_dense_tensors")
    assert dispatch.HAS_DISPATCH_MODE and dispatch.TorchDispatchMode.__module__ == "torch.utils._python_dispatch"
    record = torch.cuda.memory._record_memory_history
    takes_clear = "clear_history" in inspect.signature(record).parameters  # not in torch 2.2
    assert ("clear_history" in history.record_options(record, 5)) == takes_clear
    assert takes_clear or TORCH < (2, 4)
    assert buffers.NORM_MODULES is torch.nn.modules.batchnorm._NormBase


def _slots() -> list[torch.Tensor]:
    """Every path of a NormPlan on the CPU: rows of same-shape slots, segments, large and half tensors, a float64."""
    generator = torch.Generator().manual_seed(0)
    slots = [torch.randn(7, generator=generator) for _ in range(10)]  # rows
    slots += [torch.randn(3 + i, 5, generator=generator) for i in range(20)]  # segments
    slots += [torch.randn(80, 80, generator=generator), torch.randn(5000, generator=generator)]  # fused norm
    slots += [torch.randn(64, 90, generator=generator).half(), torch.randn(70, 70, generator=generator).bfloat16()]
    slots += [torch.randn(60, 80, generator=generator).double(), torch.tensor(3.0)]
    return slots


def _measure(slots: list[torch.Tensor]) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    plan = NormPlan(slots)
    moved = [slot * 1.5 + 0.25 for slot in slots]
    snapshot = plan.snapshot(slots)
    copies = [torch.zeros_like(slot) for slot in slots]
    fused.copy_(copies, slots)
    half = [slot for slot in slots if slot.dtype in (torch.float16, torch.bfloat16)]
    return {"squares": plan.squares(slots), "distances": plan.distance_squares(snapshot, moved),
            "fused_norms": fused_norms(slots), "half_norms": fused.norms(half, 2, torch.float32),
            "inf_norms": fused.norms(slots, math.inf), "flat": fused.flatten(slots[:30]), "copies": copies,
            "buffer_high": buffers._high("norm", slots[30:32]), "scaled": fused.scaled(slots, 2.0),
            "subtracted": fused.subtracted(moved, slots)}


def test_the_public_fallbacks_give_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a torch without a fused op (or without ``dtype=``, torch < 2.4) measures equals the fused result."""
    slots = _slots()
    fast = _measure(slots)
    monkeypatch.setattr(fused, "FOREACH", dict.fromkeys(fused.FOREACH, False))
    monkeypatch.setattr(fused, "FOREACH_NORM_DTYPE", False)
    monkeypatch.setattr(fused, "FLATTEN_DENSE", False)
    slow = _measure(slots)
    for name, value in fast.items():
        torch.testing.assert_close(slow[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert fast["half_norms"][0].dtype == torch.float32 and slow["half_norms"][0].dtype == torch.float32


def test_a_torch_whose_foreach_norm_rejects_dtype_is_probed_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe reads the installed function's real behaviour, as torch 2.2/2.3's keyword-less one."""
    original = torch._foreach_norm

    def without_dtype(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:  # noqa: A002
        return original(tensors, ord)

    monkeypatch.setattr(torch, "_foreach_norm", without_dtype)
    assert fused._norm_takes_dtype() is False
    monkeypatch.setattr(fused, "FOREACH_NORM_DTYPE", False)
    assert NormPlan(_slots()).squares(_slots()).isfinite().all()


def test_without_the_allocator_history_recording_fails_once_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "history_enabled", lambda: False)
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    failure = history.AllocationHistory(max_entries=10).start()
    assert isinstance(failure, RuntimeError) and "_record_memory_history" in str(failure)
    monkeypatch.delattr(torch.cuda.memory, "_snapshot")
    with pytest.raises(RuntimeError, match="_snapshot"):
        history.snapshot()


@pytest.mark.parametrize("enum_type", [FrameworkWork, ErrorCategory, RunStatus, FrozenCause, ClipAlgorithm,
                                       GrowthStatus])
def test_string_enums_read_as_their_value_on_every_python(enum_type: type[enum.Enum]) -> None:
    """``enum.StrEnum`` is 3.11+: the stand-in gives what it gave in str(), f-strings, format specs and JSON."""
    assert issubclass(enum_type, StrEnum) and issubclass(enum_type, str)
    for member in enum_type:
        value = member.value
        assert str(member) == f"{member}" == "%s" % member == value and member == value
        assert f"{member:>40}" == f"{value:>40}"
        assert json.loads(json.dumps({member: member})) == {value: value}
        assert enum_type(value) is member


def test_a_failing_import_behind_the_lazy_names_shows_its_real_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``from lightning_debug import x`` turned the module's AttributeError (``enum.StrEnum`` on 3.10) into a
    bare "cannot import name"; the real error is in the message now."""
    (tmp_path / "needs_newer_python.py").write_text("import enum\nclass X(enum.NoSuchEnum):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(lightning_debug._EXPORTS, "planted_name", "needs_newer_python")
    monkeypatch.delitem(sys.modules, "needs_newer_python", raising=False)
    with pytest.raises(ImportError, match=r"needs_newer_python.*NoSuchEnum") as raised:
        from lightning_debug import planted_name  # noqa: F401
    assert isinstance(raised.value.__cause__, AttributeError)
