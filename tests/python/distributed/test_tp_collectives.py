"""How many collectives, and how many bytes, each tensor-parallel layout issues per layer.

A CountingGroup wraps the real gloo TP group; the modules are built on it. Per-layer numbers are
the difference between a 2-layer and a 1-layer DistributedTransformer, so the region's entry and
exit (the batch gather and hand-back) are not counted as the layer's.
"""

from __future__ import annotations

import pytest
import torch

BATCH, SEQ, HIDDEN = 2, 8, 32


def _counts_worker(optimize: str, prescaled: bool) -> dict:
    import smp
    from smp import _C
    from smp.nn import DistributedTransformer

    smp.init({"tensor_parallel_degree": 2, "prescaled_batch": prescaled})
    counting = _C.CountingGroup(smp.get_tp_process_group())
    measured = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = DistributedTransformer(
            num_layers=layers,
            num_attention_heads=4,
            attention_head_size=8,
            hidden_size=HIDDEN,
            intermediate_size=64,
            attention_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
            causal_mask_size=SEQ,
            optimize=optimize,
            group=counting.group,
        )
        x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
        counting.reset()
        y = model(x)
        forward = counting.counts()
        counting.reset()
        y.square().sum().backward()
        measured[layers] = (forward, counting.counts())

    def per_layer(i: int) -> dict:
        two, one = measured[2][i], measured[1][i]
        keys = set(two) | set(one)
        diff = {
            k: tuple(a - b for a, b in zip(two.get(k, (0, 0)), one.get(k, (0, 0)))) for k in keys
        }
        return {k: v for k, v in diff.items() if v[0]}

    return {"forward": per_layer(0), "backward": per_layer(1), "entry": measured[1]}


# The group's batch is 2 x BATCH by default (each rank brings its own), BATCH when prescaled.
ACT = 4  # bytes per fp32 element


@pytest.mark.parametrize("prescaled", [False, True])
def test_speed_layout_two_allreduces_per_layer(pools, prescaled):
    results = pools.run(2, _counts_worker, "speed", prescaled)
    group_batch = BATCH * (1 if prescaled else 2)
    activation_bytes = group_batch * SEQ * HIDDEN * ACT
    for r in results:
        # Megatron's minimum: one all-reduce of the activations after attention, one after the MLP.
        assert r["forward"] == {"allreduce": (2, 2 * activation_bytes)}, r
        # Backward: the conjugates of the two copy_to_region, nothing else.
        assert r["backward"] == {"allreduce": (2, 2 * activation_bytes)}, r


@pytest.mark.parametrize("prescaled", [False, True])
def test_memory_layout_gathers_and_reduce_scatters(pools, prescaled):
    results = pools.run(2, _counts_worker, "memory", prescaled)
    group_batch = BATCH * (1 if prescaled else 2)
    full = group_batch * SEQ * HIDDEN * ACT
    for r in results:
        # Inputs counted: an all-gather sends its rank's half, a reduce-scatter the whole tensor.
        expected = {"_allgather_base": (2, full), "_reduce_scatter_base": (2, 2 * full)}
        assert r["forward"] == expected, r
        assert r["backward"] == expected, r
        assert "allreduce" not in r["forward"] and "allreduce" not in r["backward"]
