"""smp.nn's transformer layers with SMP v1's constructor arguments and input conventions.

v1's layers take ``pre_layernorm`` / ``post_layernorm`` (both at once too), cross-attention
(``add_cross_attention``), token types, position ids, ``add_lm_head``, ``fp32_residual_addition``
and ``use_normal_initialization`` (default: torch's own initialisation), and are called with a
tuple: ``layer((hidden_states, attention_mask))`` returns ``(output, attention_mask)``. Each is
checked against one process (the same classes on a group of one rank) at tp 2, with every rank
holding different samples and padding on some rows only, in float64; one layer is checked
against v1's reference implementation written out with torch ops.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_tp_parity import SEQ, TOL64, _run_parity, local_group

VOCAB, HIDDEN, CROSS = 64, 32, 5
SIZES = dict(num_attention_heads=4, attention_head_size=8, hidden_size=HIDDEN,
             intermediate_size=64, attention_dropout_prob=0.0, hidden_dropout_prob=0.0)  # fmt: skip


def _padding(ids: torch.Tensor) -> torch.Tensor:
    """1 = attend; rows whose first id is even end in 2 padding tokens (so ranks differ)."""
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 2 == 0, -2:] = 0
    return mask


def _additive(mask01: torch.Tensor) -> torch.Tensor:
    return (1.0 - mask01.double())[:, None, None, :] * torch.finfo(torch.float64).min


def _lm_worker(optimize: str):
    import smp
    from smp.nn import DistributedTransformerLMHead

    torch.set_default_dtype(torch.float64)
    try:
        smp.init({"tensor_parallel_degree": 2, "optimize": optimize})
        # v1's defaults otherwise: post-LN layers, torch's initialisation
        config = dict(SIZES, num_layers=2, vocab_size=VOCAB, num_positions=SEQ, num_token_types=2)
        torch.manual_seed(11)
        reference = DistributedTransformerLMHead(**config, group=local_group())
        assert reference.layernorm is None  # post-LN layers: no final norm
        layer = reference.transformer.seq_layers[0]
        assert layer.attention.pre_layernorm is None and layer.attention.layernorm is not None
        bound = 1 / math.sqrt(HIDDEN)  # torch's nn.Linear initialisation
        assert layer.attention.query.weight.abs().max() <= bound
        assert layer.attention.query.weight.std() > 0.05  # not N(0, 0.02)
        model = smp.DistributedModel(DistributedTransformerLMHead(**config))
        model.load_state_dict(reference.state_dict())

        def loss_of(m, ids, labels):  # v1's tuple: (ids, mask, token types, positions, labels)
            positions = torch.arange(SEQ).flip(0).expand_as(ids)
            out = m((ids, _padding(ids), ids % 2, positions, labels))
            return (out * _padding(ids)).sum() / _padding(ids).sum()

        return _run_parity(smp, model, reference, loss_of, VOCAB, TOL64, 1, False)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_v1_lm_head_with_token_types_positions_and_padding(pools, optimize):
    losses = pools.run(2, _lm_worker, optimize, timeout_s=300)
    assert losses[0] == losses[1] and losses[0][0] > losses[0][-1], losses


class _Decoder(torch.nn.Module):
    """A decoder stack called the v1 way: embeddings in, DistributedTransformer with
    cross-attention (tuple in, tuple out), then a loss over the output."""

    def __init__(self, group=None):
        super().__init__()
        from smp.nn import DistributedTransformer

        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.stack = DistributedTransformer(
            num_layers=2, add_cross_attention=True, pre_layernorm=True, post_layernorm=True,
            fp32_residual_addition=True, use_normal_initialization=True, causal_mask_size=SEQ,
            group=group, **SIZES,
        )  # fmt: skip

    def forward(self, ids, labels):
        hidden = self.embed(ids)
        cross = self.embed(ids.flip(1)[:, :CROSS]) * 0.5
        mask, cross_mask = _additive(_padding(ids)), _additive(_padding(ids[:, :CROSS]))
        out, *rest = self.stack((hidden, cross, mask, cross_mask))
        assert rest[0] is cross and rest[1] is mask and rest[2] is cross_mask  # v1's tuple back
        return F.cross_entropy((out @ self.embed.weight.t()).flatten(0, 1), labels.flatten())


def _cross_worker(optimize: str):
    import smp

    torch.set_default_dtype(torch.float64)
    try:
        smp.init({"tensor_parallel_degree": 2, "optimize": optimize})
        torch.manual_seed(5)
        reference = _Decoder(group=local_group())
        model = smp.DistributedModel(_Decoder())
        model.load_state_dict(reference.state_dict())
        layer = model.module.stack.seq_layers[0]
        assert layer.cross_attention.cross_attention and not layer.attention.cross_attention
        assert layer.output.pre_layernorm is not None and layer.output.layernorm is not None
        return _run_parity(smp, model, reference, lambda m, i, y: m(i, y), VOCAB, TOL64, 1, False)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_v1_cross_attention_stack_with_tuple_inputs(pools, optimize):
    losses = pools.run(2, _cross_worker, optimize, timeout_s=300)
    assert losses[0] == losses[1] and losses[0][0] > losses[0][-1], losses


def _reference_worker():
    """One DistributedTransformerLayer (tp 1) against SMP v1's reference implementation of
    the layer (its documentation's appendix), written out with torch ops: pre- and post-LN."""
    import smp
    from smp.nn import DistributedTransformerLayer

    torch.set_default_dtype(torch.float64)
    try:
        smp.init({})
        torch.manual_seed(3)
        layer = DistributedTransformerLayer(pre_layernorm=True, post_layernorm=True, **SIZES)
        x = torch.randn(2, SEQ, HIDDEN)
        mask = _additive(_padding(torch.tensor([[2] * SEQ, [1] * SEQ])))
        out, back = layer((x, mask))
        assert back is mask

        def attention(a, inp):
            norm = F.layer_norm(inp, (HIDDEN,), a.pre_layernorm.weight, a.pre_layernorm.bias)
            heads = lambda t: t.view(2, SEQ, 4, 8).transpose(1, 2)  # noqa: E731
            q, k, v = (heads(F.linear(norm, m.weight, m.bias)) for m in (a.query, a.key, a.value))
            scores = q @ k.transpose(-1, -2) / math.sqrt(8) + mask
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, SEQ, HIDDEN)
            y = F.linear(ctx, a.dense.weight, a.dense.bias) + inp
            return F.layer_norm(y, (HIDDEN,), a.layernorm.weight, a.layernorm.bias)

        def output(o, inp):
            norm = F.layer_norm(inp, (HIDDEN,), o.pre_layernorm.weight, o.pre_layernorm.bias)
            y = F.linear(F.gelu(F.linear(norm, o.dense1.weight, o.dense1.bias)),
                         o.dense2.weight, o.dense2.bias) + inp  # fmt: skip
            return F.layer_norm(y, (HIDDEN,), o.layernorm.weight, o.layernorm.bias)

        expected = output(layer.output, attention(layer.attention, x))
        torch.testing.assert_close(out, expected, **TOL64)
        torch.testing.assert_close(layer(x, mask), expected, **TOL64)  # the keyword form
        # Cross-attention: keys and values from cross_states, its mask over their positions.
        cross_layer = DistributedTransformerLayer(add_cross_attention=True, **SIZES)
        cross = torch.randn(2, CROSS, HIDDEN)
        cross_mask = torch.zeros(2, 1, 1, CROSS)
        cross_mask[..., -1] = torch.finfo(torch.float64).min
        out, *_ = cross_layer((x, cross, mask, cross_mask))
        changed = cross.clone()
        changed[:, -1] += 1.0  # a masked cross position: no effect
        torch.testing.assert_close(cross_layer((x, changed, mask, cross_mask))[0], out, **TOL64)
        changed[:, 0] += 1.0  # an attended one: an effect
        assert not torch.allclose(cross_layer((x, changed, mask, cross_mask))[0], out)

        # The attention layer alone, v1's tuple (hidden_states, cross_states, attention_mask).
        from smp.nn import DistributedAttentionLayer

        heads = {k: v for k, v in SIZES.items() if k != "intermediate_size"}
        att = DistributedAttentionLayer(cross_attention=True, **heads)
        alone = att((x, cross, cross_mask))
        changed = cross.clone()
        changed[:, -1] += 1.0
        torch.testing.assert_close(att((x, changed, cross_mask)), alone, **TOL64)
        torch.testing.assert_close(att(x, cross_mask, cross_states=changed), alone, **TOL64)

        # The LM head's [N, S] mask: 1 = attend, 0 = padding (what tokenizers give).
        from smp.nn import DistributedTransformerLMHead

        lm = DistributedTransformerLMHead(num_layers=1, vocab_size=VOCAB, num_positions=SEQ,
                                          **SIZES)  # fmt: skip
        ids = torch.randint(0, VOCAB, (2, SEQ))
        pad = torch.ones(2, SEQ, dtype=torch.long)
        pad[0, -2:] = 0
        logits = lm(ids, pad)
        other = ids.clone()
        other[0, -2:] = (other[0, -2:] + 1) % VOCAB
        torch.testing.assert_close(lm(other, pad)[0, :-2], logits[0, :-2], **TOL64)
        assert not torch.allclose(lm(other, None)[0, :-2], lm(ids, None)[0, :-2])

        with pytest.raises(ValueError, match="at least one of pre_layernorm and post_layernorm"):
            DistributedTransformerLayer(pre_layernorm=False, post_layernorm=False, **SIZES)
        with pytest.raises(ValueError, match=r"tuple input is \(hidden_states, attention_mask\)"):
            layer((x,))
        return True
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_layer_computes_v1s_reference(pools):
    assert pools.run(1, _reference_worker, timeout_s=120) == [True]
