"""Delayed parameter initialisation in one process: the replayed values are eager
construction's, bit for bit, the generator ends where eager construction leaves it, and what
cannot be replayed says so."""

from __future__ import annotations

import pytest
import torch
from models import tiny_gpt_config, tiny_hf_model
from torch import nn

import smp
from smp.memory import delayed


def _build(make, delay: bool):
    torch.manual_seed(0)
    with smp.delay_param_initialization(enabled=delay):
        model = make()
    return model, torch.rand(4)  # where the generator is afterwards


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2", "bert", "t5"])
def test_replayed_values_are_eager_constructions(kind):
    from model import GPT

    def make():
        return GPT(tiny_gpt_config()) if kind == "gpt" else tiny_hf_model(kind)

    eager, after_eager = _build(make, False)
    lazy, after_lazy = _build(make, True)
    assert torch.equal(after_eager, after_lazy)  # the same draws follow construction
    assert all(p.is_meta for p in lazy.parameters())
    assert all(not b.is_meta for b in lazy.buffers())  # buffers are built as usual
    delayed.placeholders(lazy)
    assert all(p.numel() == 0 for p in lazy.parameters())
    for (name, p), (_, q) in zip(lazy.named_parameters(), eager.named_parameters()):
        delayed.materialize(p)
        assert torch.equal(p, q), name
    tied = [p for p in lazy.parameters()]
    assert len(tied) == len(list(eager.parameters()))  # tied parameters stay one


def test_values_given_at_creation_and_views_are_replayed():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(5) * 0.1)  # a computed initial value
            self.table = nn.Parameter(torch.empty(6, 4))
            nn.init.trunc_normal_(self.table, std=0.5)
            with torch.no_grad():
                self.table[2].zero_()  # a view of the parameter
                self.table[:, 1].fill_(3.0)
            self.ones = nn.Parameter(torch.ones(3))

    eager, _ = _build(Odd, False)
    lazy, _ = _build(Odd, True)
    delayed.placeholders(lazy)
    for (name, p), (_, q) in zip(lazy.named_parameters(), eager.named_parameters()):
        delayed.materialize(p)
        assert torch.equal(p, q), name


def test_a_constant_made_where_a_freed_empty_tensor_was_is_kept():
    class Reuse(nn.Module):  # the ones() storage tends to take the freed empty()'s address
        def __init__(self):
            super().__init__()
            for i in range(20):
                torch.empty(3)
                setattr(self, f"w{i}", nn.Parameter(torch.ones(3)))

    lazy, _ = _build(Reuse, True)
    delayed.placeholders(lazy)
    for name, p in lazy.named_parameters():
        delayed.materialize(p)
        assert torch.equal(p, torch.ones(3)), name


def test_inits_that_skip_meta_tensors_still_draw_and_replay():
    class Inits(nn.Module):  # torch's versions of these return at once for a meta tensor
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.empty(4, 4))
            nn.init.orthogonal_(self.a)
            self.b = nn.Parameter(torch.empty(6, 5))
            nn.init.sparse_(self.b, sparsity=0.5)
            self.c = nn.Parameter(torch.empty(3, 3, 3))
            nn.init.dirac_(self.c)

    eager, after_eager = _build(Inits, False)
    lazy, after_lazy = _build(Inits, True)
    assert torch.equal(after_eager, after_lazy)
    delayed.placeholders(lazy)
    for (name, p), (_, q) in zip(lazy.named_parameters(), eager.named_parameters()):
        delayed.materialize(p)
        assert torch.equal(p, q), name


def test_an_initialisation_that_cannot_be_replayed_names_the_parameter():
    class Computed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))
            with torch.no_grad():
                self.w.copy_(self.w.new_ones(4, 4) * 2)  # a tensor computed on the meta device

    lazy, _ = _build(Computed, True)
    delayed.placeholders(lazy)
    with pytest.raises(RuntimeError, match="parameter 'w'.*without smp.delay_param"):
        delayed.materialize(lazy.w)


def test_the_model_is_given_its_values_when_wrapped_on_one_stage(single_process_smp):
    from model import GPT

    smp_ = single_process_smp({"delayed_parameter_initialization": True})
    torch.manual_seed(0)
    eager = GPT(tiny_gpt_config())
    torch.manual_seed(0)
    with smp_.model_creation():
        lazy = GPT(tiny_gpt_config())
    assert all(p.is_meta for p in lazy.parameters())
    model = smp_.DistributedModel(lazy)
    for (name, p), (_, q) in zip(model.module.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), name
