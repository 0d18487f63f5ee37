"""The batch-mixing probe's parts on tensors and loaders (lightning_debug.checks.mixing, monitors.mixing)."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_debug.checks.mixing import Call, Measured, measure, probe, take_rows
from lightning_debug.monitors.mixing import loader_facts, unjudged

DATA = TensorDataset(torch.randn(40, 3), torch.zeros(40))


def test_the_loader_facts_are_found_through_samplers_and_batch_samplers() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=True)
    assert loader_facts(DataLoader(DATA, batch_size=8, sampler=sampler)) == (8, True)
    in_order = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=False)
    assert loader_facts(DataLoader(DATA, batch_size=8, sampler=in_order)) == (8, False)
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(DATA), batch_size=5, drop_last=False)
    assert loader_facts(DataLoader(DATA, batch_sampler=batches)) == (5, True)


def test_what_cannot_be_cut_into_samples_is_not_judged() -> None:
    model = nn.Linear(3, 2)
    x = torch.randn(8, 3)
    assert unjudged(Call(model, (x,), {}), 8, True) is None
    assert "does not shuffle" in str(unjudged(Call(model, (x,), {}), 8, False))
    assert "dimension 0" in str(unjudged(Call(model, (x, torch.zeros(2, 5, dtype=torch.long)), {}), 8, True))
    assert "object" in str(unjudged(Call(model, (x, object()), {}), 8, True))
    assert "batch size" in str(unjudged(Call(model, (x,), {}), None, True))
    sharded = nn.Linear(3, 2)
    sharded.weight.data = torch.empty(0)  # a ZeRO-3 parameter: its values live on other ranks
    assert "sharded" in str(unjudged(Call(sharded, (x,), {}), 8, True))


def test_rows_are_taken_through_named_tuples_and_mappings() -> None:
    Pair = namedtuple("Pair", "x y")
    leaves: list[torch.Tensor] = []
    taken = take_rows(Pair(torch.arange(10.0).reshape(5, 2), {"ids": torch.arange(5)}), torch.tensor([4, 1]), leaves)
    assert isinstance(taken, Pair) and taken.y["ids"].tolist() == [4, 1] and len(leaves) == 1


class Scrambled(nn.Module):
    """A per-sample layer, then rows regrouped (a view where a transpose was meant), then another layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.second(h.reshape(4, -1, 4).transpose(0, 1).reshape(-1, 4))


def test_the_finding_says_between_which_module_outputs_the_rows_mix() -> None:
    torch.manual_seed(0)
    found = probe(Call(Scrambled(), (torch.randn(16, 4),), {}), rows=12)
    assert found.named and found.between == ("`first` (Linear)'s output", "`second` (Linear)'s output")


def test_a_model_that_pairs_the_rows_is_not_measured() -> None:
    class Similarity(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.embed(x)
            return z @ z.T

    assert measure(Call(Similarity(), (torch.randn(16, 4),), {}), rows=13) is None


def test_an_output_the_shuffled_rows_do_not_reproduce_is_ordered_and_one_they_do_is_not() -> None:
    rows = 13
    numbers = torch.zeros(3 * rows + 1)
    numbers[:rows] = torch.tensor([1.0] * rows)  # row 12 depends on every row equally
    measured = Measured(rows, (12, 0, 6), [], "the inputs", [rows, 2], 1e-4, numbers)
    values = numbers.tolist()
    assert measured.read(values).mixed and not measured.read(values).ordered
    values[-1] = 0.5
    assert measured.read(values).named


def test_a_per_sample_scalar_input_is_read_as_a_row_too() -> None:
    """A diffusion model's timestep, one value per sample: a gradient of one dimension."""

    class Denoiser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.time, self.body = nn.Linear(1, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return self.body(x + self.time(t[:, None]))

    found = probe(Call(Denoiser(), (torch.randn(8, 4), torch.rand(8)), {}), rows=8)
    assert found.output_shape == [8, 4] and not found.mixed


def test_a_forward_that_scales_its_input_in_place_is_probed() -> None:
    """CTRL scales its embeddings in place; a forward may normalise its input in place too."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)
            h = self.embed(ids)
            h *= 3.0
            return self.head(h.mean(1) + x)

    assert not probe(Call(InPlace(), (torch.randint(0, 10, (8, 5)), torch.randn(8, 4)), {}), rows=8).mixed
    tokens_only = InPlace()
    tokens_only.forward = lambda ids: tokens_only.head(tokens_only.embed(ids).mul_(3.0).mean(1))  # type: ignore
    assert probe(Call(tokens_only, (torch.randint(0, 10, (8, 5)),), {}), rows=8).leaves == "`embed` (Embedding)'s output"


def test_a_call_through_a_forward_patched_on_the_instance_is_a_redirection_not_the_models_forward() -> None:
    """Under DDP Lightning calls the module with ``(batch, batch_idx)``, its ``forward`` set to ``training_step`` for
    that call; the step's own ``self(x)`` inside it is the model's forward."""
    from lightning_debug.monitors.mixing import CallWatch

    model = nn.Sequential(nn.Linear(3, 2))
    original = model.forward

    def training_step(batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        model.forward = original  # type: ignore[method-assign]
        del model.forward  # unpatched, as Lightning's redirection does before the step runs
        return model(batch[0]).sum()

    watch = CallWatch()
    watch.watch(model)
    model.forward = training_step  # type: ignore[method-assign]
    model((torch.ones(4, 3), torch.zeros(4)), 0)
    call = watch.stop()
    assert call is not None and len(call.args) == 1 and call.args[0].shape == (4, 3)
