"""A fit on the torch floor's fused norm: torch 2.2/2.3's ``_foreach_norm`` has no ``dtype=`` (it arrived in 2.4).

The installed function is replaced by one with the old signature and the probe re-run, as an old torch would
be probed at import; the checks must then measure through the public fallback, name a planted NaN at its step
and its parameters, fail no check, and stay quiet on a healthy run. Before the probe, every check step of such
a torch failed in ``AnomalyMonitor`` and the NaN went unreported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_debug.checks import fused
from tests.harness.toolkit import TinyRegressor, all_four, debug_dir, fit_seeded, read_events, read_report


@pytest.fixture
def foreach_norm_without_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch._foreach_norm

    def old_signature(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:  # noqa: A002
        return original(tensors, ord)

    monkeypatch.setattr(torch, "_foreach_norm", old_signature)
    monkeypatch.setattr(fused, "FOREACH_NORM_DTYPE", fused._norm_takes_dtype())
    assert fused.FOREACH_NORM_DTYPE is False


@pytest.mark.usefixtures("foreach_norm_without_dtype")
def test_a_nan_is_named_on_a_torch_without_the_dtype_keyword(tmp_path: Path) -> None:
    trainer = fit_seeded(tmp_path, TinyRegressor(nan_layer_from_step=5), all_four(), max_steps=10)
    report = read_report(debug_dir(trainer))
    assert report["failed_checks"] == {}
    grads = [e for e in read_events(debug_dir(trainer)) if e["kind"] == "nonfinite_grad" and e.get("episode") == "start"]
    assert grads and grads[0]["step"] == 5
    assert any(name.startswith(("inp.", "hidden.")) for name in grads[0]["details"]["parameters"])
    assert "No problems found" not in (debug_dir(trainer) / "report.md").read_text()


@pytest.mark.usefixtures("foreach_norm_without_dtype")
def test_a_healthy_run_stays_quiet_on_a_torch_without_the_dtype_keyword(tmp_path: Path) -> None:
    trainer = fit_seeded(tmp_path, TinyRegressor(), all_four(), max_steps=10)
    report = read_report(debug_dir(trainer))
    assert report["failed_checks"] == {}
    loud = [e for e in read_events(debug_dir(trainer)) if e["severity"] in ("warning", "error", "critical")]
    assert loud == []
