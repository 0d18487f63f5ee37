"""The shared gradient pass is planned once per model, by identity: models that re-register their own
modules in every forward (transformers' Llama-family decoders slice their ``ModuleList``; the
Switch-Transformers router reassigns ``self.classifier``) keep one plan, and a real change of the
trainable parameters (a layer added mid-run) is followed at once, without a false alarm."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_debug import debug_callbacks
from lightning_debug.core.numerics import ParameterIndex
from tests.harness.families import every_step, switch_moe
from tests.harness.toolkit import TinyRegressor, debug_dir, make_trainer, read_events, read_scalars
from tests.harness.zoo import DictDataset, HFModule

pytestmark = pytest.mark.timeout(240)


def tiny_llama_module() -> HFModule:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tokens = torch.randint(2, 128, (256, 16), generator=torch.Generator().manual_seed(0))
    return HFModule(LlamaForCausalLM(config), DictDataset({"input_ids": tokens, "labels": tokens}))


def builds_over_fit(module: Any, root: Path, steps: int = 20) -> tuple[int, list[dict[str, Any]]]:
    trainer = make_trainer(root, debug_callbacks(every_step()), max_steps=steps, limit_val_batches=0)
    before = ParameterIndex.builds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    assert trainer.global_step == steps
    return ParameterIndex.builds - before, read_events(debug_dir(trainer))


@pytest.mark.parametrize("family", ["llama", "switch"])
def test_models_that_re_register_modules_every_forward_are_planned_once(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    module = tiny_llama_module() if family == "llama" else switch_moe()
    builds, events = builds_over_fit(module, tmp_path)
    assert builds == 1, f"{family}: {builds} plans in 20 steps, every check every step"
    assert not [e for e in events if e.get("severity") in ("warning", "error", "critical")]


class GrowsALayer(TinyRegressor):
    """From step 6 a new layer (registered on the model, given to the optimizer) joins the forward:
    the trainable parameters really change, so the plan must follow."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 6 and not hasattr(self, "extra"):
            self.extra = nn.Linear(1, 1)
            self.trainer.optimizers[0].add_param_group({"params": list(self.extra.parameters())})
        x, y = batch
        out = self(x)
        if hasattr(self, "extra"):
            out = self.extra(out)
        return nn.functional.mse_loss(out, y)


def test_a_layer_added_mid_run_is_planned_again_once_and_measured(tmp_path: Path) -> None:
    config = every_step(log_gradients=True)
    trainer = make_trainer(tmp_path, debug_callbacks(config), max_steps=16)
    before = ParameterIndex.builds
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(GrowsALayer())
    builds = ParameterIndex.builds - before
    assert builds == 2, f"one plan before the change and one after it: {builds}"
    events = read_events(debug_dir(trainer))
    assert not [e for e in events if e.get("severity") in ("warning", "error", "critical")], events
    steps = [step for step, _ in read_scalars(trainer.logger.log_dir)["debug/grad/norm/extra.weight"]]
    assert steps[0] == 6 and steps[-1] == 15, "the new layer is measured from its first step"
