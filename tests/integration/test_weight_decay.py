"""``weight_decay_on_norm`` on a real model: a BERT trained with ``AdamW(model.parameters(), weight_decay=0.01)``
(the classic mistake, also AdamW's default) is told once, at step 0, which LayerNorm weights, biases and
embedding tables it decays; the recipe with a no-decay param group is quiet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.harness.zoo import HEALTHY, HFModule, Result, bert, defaults, fit


def test_adamw_over_every_parameter_of_a_bert_decays_its_norms_biases_and_embeddings(tmp_path: Path) -> None:
    result = fit("bert", HEALTHY, defaults(), tmp_path, max_steps=4)
    found = result.starts("weight_decay_on_norm")
    assert [(e["step"], e["severity"]) for e in found] == [(0, "info")]
    details = found[0]["details"]
    names = details["parameters"]
    assert any("LayerNorm.weight" in name for name in names) and any(name.endswith(".bias") for name in names)
    assert details["roles"]["embedding"] == 3  # word, position and token-type embeddings
    assert details["weight_decay"] == [0.01]
    assert not any("query.weight" in name or "dense.weight" in name for name in names)  # matrices are decayed by design
    assert result.report["findings"]["weight_decay_on_norm"]["severity"] == "info"
    assert result.serious() == [], result.alarms()


class NoDecayGroups(HFModule):
    """The recipe of BERT's own training code: no decay for biases, LayerNorm weights and embeddings."""

    def configure_optimizers(self) -> Any:
        lookups = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.Embedding)}
        plain = [p for p in self.parameters() if p.dim() >= 2 and id(p) not in lookups]
        rest = [p for p in self.parameters() if p.dim() < 2 or id(p) in lookups]
        return torch.optim.AdamW([{"params": plain, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                 lr=self.lr)


def test_the_no_decay_recipe_is_quiet(tmp_path: Path, monkeypatch: Any) -> None:
    import tests.harness.zoo as zoo

    def recipe(plant: Any = HEALTHY) -> HFModule:
        module = bert(plant)
        return NoDecayGroups(module.model, module.data, lr=module.lr, plant=plant)

    monkeypatch.setitem(zoo.BUILDERS, "bert", recipe)
    result: Result = fit("bert", HEALTHY, defaults(), tmp_path, max_steps=4)
    assert result.starts("weight_decay_on_norm") == []
    assert result.serious() == [], result.alarms()
