"""Tensor parallelism of unmodified Hugging Face causal LMs
whose head, loss call, embedding or projections are not the common form matches one process.

- A pruned head (Apertus' ``output_vocab_size`` < ``vocab_size``): the vocab-parallel loss
  splits by the head's width, as the head is split (head or whole model marked).
- Mixtral passes the vocabulary size to ``self.loss_function`` by position: it is bound by
  ``ForCausalLMLoss``'s signature, never taken for ``num_items_in_batch`` (tp 2, pp 2 x tp 2).
- Gemma's tied embedding scales its rows by sqrt(hidden) in its own forward: the vocab-parallel
  pair keeps that forward; an embedding whose forward reads its weight by hand stays whole.
- Falcon's projections are ``FalconLinear`` (``input @ weight.T + bias``): split as
  ``nn.Linear``; a Linear subclass that computes something else stays whole, and a warning
  names it with its bytes.

Parity as in test_tp_parity: the loss every step, every gradient gathered to its full shape,
and every parameter after each of three AdamW steps; each TP rank has its own samples.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_tp_parity import SEQ, TOL32, _run_parity
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
PRUNED = 48  # Apertus' output_vocab_size: the head's width


def _tiny(kind: str) -> nn.Module:
    """An unmodified Hugging Face causal LM from a tiny config (2 layers, hidden 32)."""
    t = transformers
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    if kind == "apertus":
        return t.Apertus1p5TextForCausalLM(
            t.Apertus1p5TextConfig(output_vocab_size=PRUNED, **common)
        )
    if kind == "mixtral":
        return t.MixtralForCausalLM(
            t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        )
    if kind == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(head_dim=8, **common))
    if kind == "falcon":
        return t.FalconForCausalLM(
            t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4)
        )  # fmt: skip
    raise ValueError(kind)


def _loss_of(kind: str):
    width = PRUNED if kind == "apertus" else VOCAB

    def loss_of(m, ids, labels):
        # Padding on the samples whose first token is small: some ranks have none, some some.
        mask = torch.ones_like(ids)
        mask[ids[:, 0] < VOCAB // 3, -3:] = 0
        # Every position counts (as in test_tp_whole_model), so that the mean of the ranks'
        # losses is the loss of the whole batch. A pruned head's ids are < 48.
        return m(input_ids=ids, attention_mask=mask, labels=ids % width).loss

    return loss_of


def _parity_worker(kind: str, tp: int, pp: int, microbatches: int, mark: str = "whole"):
    import smp

    smp.init(
        {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "microbatches": microbatches}
    )
    torch.manual_seed(5)
    reference = _tiny(kind)
    torch.manual_seed(5)
    if mark == "whole":
        with smp.tensor_parallelism():
            model = _tiny(kind)
    else:  # the head only
        model = _tiny(kind)
        smp.set_tensor_parallelism(model.get_output_embeddings())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = smp.DistributedModel(model)
    losses = _run_parity(smp, model, reference, _loss_of(kind), VOCAB, TOL32, microbatches, False)
    held = sum(p.numel() for _, p in model.local_named_parameters())
    whole = sum(p.numel() for p in reference.parameters())
    return {
        "losses": losses,
        "split": sorted(model.distributed_modules),
        "held": held / whole if smp.pp_size() == 1 else None,
        "warnings": [str(w.message) for w in caught],
        "embedding": type(model.module.get_input_embeddings()).__mro__[1].__name__,
    }


@pytest.mark.parametrize("mark", ["whole", "head"])
def test_pruned_head_tp2(pools, mark):
    """The head is 48 wide, the vocabulary 64; the loss splits by 48 as the head."""
    results = pools.run(2, _parity_worker, "apertus", 2, 1, 1, mark)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert "lm_head" in results[0]["split"], results[0]["split"]


@pytest.mark.parametrize("pp", [1, 2])
def test_vocab_size_by_position_mixtral(pools, pp):
    """``self.loss_function(logits, labels, self.vocab_size, **kwargs)``."""
    results = pools.run(2 * pp, _parity_worker, "mixtral", 2, pp, pp)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert "lm_head" in results[0]["split"], results[0]["split"]


def test_gemma_scaled_tied_embedding_tp2(pools):
    """Gemma's tied embedding multiplies its rows by sqrt(hidden) in its own forward;
    split with the head, it keeps that forward (still a GemmaTextScaledWordEmbedding)."""
    results = pools.run(2, _parity_worker, "gemma", 2, 1, 1)
    first = results[0]
    assert all(r["losses"] == first["losses"] for r in results)
    assert {"model.embed_tokens", "lm_head"} <= set(first["split"]), first["split"]
    assert first["embedding"] == "GemmaTextScaledWordEmbedding", first["embedding"]
    assert first["held"] < 0.8, first["held"]  # the tied matrix is split


def test_falcon_linear_split_tp2(pools):
    """FalconLinear computes ``input @ weight.T + bias``: its projections are split
    like nn.Linear's, so each rank holds well under the whole model, and no module of a
    registered kind is left whole (no warning)."""
    results = pools.run(2, _parity_worker, "falcon", 2, 1, 1)
    first = results[0]
    assert all(r["losses"] == first["losses"] for r in results)
    qkv = "transformer.h.0.self_attention.query_key_value"
    assert qkv in first["split"], first["split"]
    assert first["held"] < 0.6, first["held"]
    assert not [w for w in first["warnings"] if "stay whole" in w], first["warnings"]


# ---- what stays whole ----------------------------------------------------------------------------


class _Doubled(nn.Linear):
    """A Linear subclass whose forward is not nn.Linear's: twice the product."""

    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


class _Float32Out(nn.Linear):
    """Computes nn.Linear's values but always returns float32."""

    def forward(self, x):
        return F.linear(x.float(), self.weight.float(), self.bias.float())


class _Routes(nn.Linear):
    """A router: the product and its top choice (a tuple, as Llama 4's router returns)."""

    def forward(self, x):
        logits = F.linear(x, self.weight, self.bias)
        return logits, logits.argmax(-1)


class _ByHand(nn.Embedding):
    """An embedding whose forward looks its rows up in ``weight`` itself, then scales them."""

    def forward(self, ids):
        return F.embedding(ids, self.weight) * 2.0


class _Net(nn.Module):
    """Token ids to logits through a plain Linear and a _Doubled one."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.plain = nn.Linear(16, 16)
        self.doubled = _Doubled(16, VOCAB)

    def forward(self, ids):
        return self.doubled(torch.tanh(self.plain(self.embed(ids))))


def _net_loss(m, ids, labels):
    return F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())


def _seeded_net() -> nn.Module:
    torch.manual_seed(1)
    return _Net()


def _by_hand_llama() -> nn.Module:
    """A tied Llama whose input embedding is a _ByHand (its own lookup), seeded."""
    torch.manual_seed(5)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.model.embed_tokens = _ByHand(VOCAB, 32)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _kept_whole_worker(kind: str):
    """``kind`` "net": a marked model with a Linear subclass that doubles its output; "llama":
    a tied Llama whose embedding is a _ByHand. Returns the conversion's warnings, what was
    split, and runs the parity loop."""
    import smp

    smp.init({"tensor_parallel_degree": 2})
    make = _seeded_net if kind == "net" else _by_hand_llama
    reference = make()
    with smp.tensor_parallelism():
        model = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = smp.DistributedModel(model)
    loss_of = _net_loss if kind == "net" else _loss_of("llama")
    _run_parity(smp, model, reference, loss_of, VOCAB, TOL32, 1, False)
    return [str(w.message) for w in caught], sorted(model.distributed_modules)


def test_linear_subclass_of_another_function_stays_whole_named(pools):
    """A Linear subclass that computes something else stays whole, and
    one warning on every rank names it and its bytes; the rest is split; one process's
    numbers."""
    for said, split in pools.run(2, _kept_whole_worker, "net"):
        assert split == ["embed", "plain"], split
        whole = [w for w in said if "stay whole" in w]
        assert len(whole) == 1, said
        assert "doubled (_Doubled, 4352 bytes)" in whole[0], whole[0]  # (16 x 64 + 64) x 4
        assert "4352 bytes of parameters held whole" in whole[0], whole[0]


def test_tied_embedding_reading_its_weight_stays_whole(pools):
    """A tied embedding whose forward looks its rows up by hand cannot run
    on a shard; the head path says why, the pair stays whole, the numbers are one process's."""
    for said, split in pools.run(2, _kept_whole_worker, "llama"):
        assert "lm_head" not in split and "model.embed_tokens" not in split, split
        assert any("not split along the vocabulary" in w and "_ByHand" in w for w in said), said


# ---- single process: the checks themselves ------------------------------------------------------


def test_computes_linear():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from smp.tp.subclasses import computes_linear

    assert computes_linear(nn.Linear(8, 4))
    assert computes_linear(FalconLinear(8, 6, bias=True))
    assert computes_linear(FalconLinear(8, 6, bias=False))
    for other in (_Doubled(8, 4), _Float32Out(8, 4), _Routes(8, 4)):
        assert not computes_linear(other), type(other).__name__
    fresh = FalconLinear(6, 6)
    state = torch.get_rng_state()
    assert computes_linear(fresh)
    assert torch.equal(state, torch.get_rng_state())  # the probe draws from its own generator


def test_keeps_lookup():
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    from smp.tp.lm_head import _keeps_lookup

    assert _keeps_lookup(GemmaTextScaledWordEmbedding(8, 4, 0, embed_scale=2.0), 4)
    assert not _keeps_lookup(_ByHand(8, 4), 4)
    assert not _keeps_lookup(OPTLearnedPositionalEmbedding(8, 4), 4)


def test_loss_binds_by_the_signature(single_process_smp):
    """Every way ``ForCausalLMLoss``'s signature lets a model pass its
    arguments gives Hugging Face's value; a vocabulary size other than the head's raises."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from smp.tp.lm_head import causal_lm_loss_kw

    single_process_smp()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, 1] = -100
    shifted = torch.randint(0, VOCAB, (2, 5), generator=g)
    variants = [
        ((logits, labels, VOCAB), {}),  # Mixtral, Gemma 2/3, Qwen2-MoE, Jamba, ...
        ((logits, labels, VOCAB, 7), {}),
        ((logits, labels), {"vocab_size": VOCAB}),  # Llama
        ((), {"logits": logits, "labels": labels, "vocab_size": VOCAB}),
        ((logits, labels, VOCAB), {"num_items_in_batch": torch.tensor(9)}),
        ((logits, labels.masked_fill(labels < 0, 3), VOCAB, None, 3), {}),  # ignore_index
        ((logits, labels, VOCAB), {"shift_labels": shifted}),
        ((logits, labels, VOCAB), {"output_attentions": False}),  # **kwargs, ignored by both
    ]
    for args, kwargs in variants:
        expected = ForCausalLMLoss(*args, **kwargs)
        got = causal_lm_loss_kw(VOCAB, *args, **kwargs)
        torch.testing.assert_close(got, expected, msg=f"{len(args)} positional, {list(kwargs)}")
    with pytest.raises(ValueError, match="vocab_size=80 .* 64 outputs"):
        causal_lm_loss_kw(VOCAB, logits, labels, 80)


def test_plan_projections_recognised_by_class():
    """A sharding plan's projections: transformers' Conv1D by its class (not a class of that
    name with an [out, in] weight), and an nn.Linear only if it computes nn.Linear's function."""
    from transformers.pytorch_utils import Conv1D

    from smp.tp.registry import _CannotDistribute, _linear_dims

    assert _linear_dims(Conv1D(6, 4)) == (4, 6, True)  # Conv1D(nf=6, nx=4): weight [4, 6]
    with pytest.raises(_CannotDistribute, match="_Doubled defines its own forward"):
        _linear_dims(_Doubled(4, 6))

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(6, 4))

    Named.__name__ = "Conv1D"
    with pytest.raises(_CannotDistribute, match="not a linear projection"):
        _linear_dims(Named())
