"""Delayed parameter initialisation at pp 2 x dp 2 and pp 2 x tp 2: a model created inside
``smp.model_creation()`` with ``delayed_parameter_initialization`` has no parameter values until
the partition; then each rank gives values to the parameters its stage owns — bit for bit those
of eager construction with the same seed, or its tensor-parallel shards of them — and none to
the others. Before that no rank holds the whole model: tensor parallelism splits one module at
a time, and rank 0 traces holding the parameters of the modules running at that moment.
Training then matches the same run on an eagerly built model (losses, every gradient,
parameters after 3 AdamW steps). On the demo GPT (per-block TP plan) and an unmodified Hugging
Face Llama (whole-model marking, vocab-parallel head), each data-parallel rank with its own
data."""

from __future__ import annotations

import pytest
import torch
from models import lm_train_step, parity_adamw, split_gpt_blocks, tiny_hf_model
from test_activation_checkpointing import SEQ, VOCAB, _batch, _compare, _inputs
from test_tp_parity import full_grads


def _make(kind: str):
    from model import GPT, GPTConfig

    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32))
    return tiny_hf_model("llama", VOCAB, SEQ, use_cache=False)


def _run(kind: str, delay: bool, tp: int):
    import smp
    from smp.memory import delayed
    from smp.tp.functional import shard_tensor

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": tp, "microbatches": 2,
              "delayed_parameter_initialization": delay})  # fmt: skip
    torch.manual_seed(0)
    eager = _make(kind)
    total = sum(p.numel() for p in eager.parameters())
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=tp > 1 and kind == "llama"):  # whole model
        module = _make(kind)
    if tp > 1 and kind == "gpt":
        split_gpt_blocks(smp, module)  # per block
    assert all(p.is_meta for p in module.parameters()) == delay
    live, peak = [0], [0]
    materialize, release = delayed.materialize, delayed.release

    def counted_materialize(p, pool=None):
        materialize(p, pool)
        live[0] += p.numel()
        peak[0] = max(peak[0], live[0])

    def counted_release(p, pool=None):
        live[0] -= p.numel()
        release(p, pool)

    delayed.materialize, delayed.release = counted_materialize, counted_release
    model = smp.DistributedModel(module)
    if delay:  # TP shards too: a record of "the shard of that parameter", no values yet
        assert all(p.numel() == 0 for p in model.module.parameters())
    checked = []
    traced = []
    owned = model._materialize_owned

    def materialize_owned():  # the peak so far is tracing's (rank 0) or nothing
        traced.append(peak[0])
        owned()

    model._materialize_owned = materialize_owned

    def after_partition(model, _):
        for name, p in model.module.named_parameters():
            if model._owns(name):
                expected = dict(eager.named_parameters())[name]
                split = getattr(p, "_smp_tp_split", None)
                if split is not None:  # this rank's shard of eager construction's tensor
                    expected = shard_tensor(expected, *split, smp.tp_size(), smp.tp_rank())
                assert torch.equal(p, expected), name
                checked.append(name)
            else:
                assert p.numel() == 0, name
        held = sum(p.numel() for p in model.module.parameters())
        assert held < total, (held, total)  # this stage's share, never the whole model
        checked.append(traced[0] if traced else 0)

    model.register_post_partition_hook(after_partition)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))

    train_step = lm_train_step(smp, kind)

    losses, grads = [], []
    try:
        for step in range(3):
            optimizer.zero_grad()
            losses.append(train_step(model, *_inputs(kind, step, smp.dp_rank())).reduce_mean())
            grads.append(full_grads(model))
            optimizer.step()
    finally:
        delayed.materialize, delayed.release = materialize, release
    state = model.state_dict()
    smp.shutdown()
    return losses, grads, state, checked, total


def _worker(kind: str, tp: int):
    eager = _run(kind, False, tp)
    lazy = _run(kind, True, tp)
    _compare(eager, lazy, exact=False)
    checked, total = lazy[3], lazy[4]
    return len(checked) - 1, checked[-1], total


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", ["pp2xdp2", "pp2xtp2"])
def test_delayed_init_matches_eager_construction(pools, kind, layout):
    tp = 2 if layout == "pp2xtp2" else 1
    results = pools.run(4, _worker, kind, tp, timeout_s=300)
    for owned, peak, total in results:
        assert owned > 0
        # Before the partition a rank held at most: one module being split for TP (its
        # whole weights), or while tracing, the parameters of the modules running then.
        assert peak < (total / 2 if tp > 1 else total / 4), (peak, total)


def _seeded_apart_worker():
    """Replicas seeded differently replay different values; the partition then makes them
    equal (dp rank 0's), as eager construction's broadcast at wrap time does."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(smp.dp_rank())
    with smp.delay_param_initialization():
        module = _make("gpt")
    model = smp.DistributedModel(module)

    @smp.step
    def forward(model, ids):
        return model(ids)

    with torch.no_grad():
        forward(model, _batch("gpt", 0, 0)[0])
    mine = torch.cat([p.detach().reshape(-1) for p in model.local_parameters()])
    everyone = smp.allgather(mine, smp.DP_GROUP)
    smp.shutdown()
    return all(torch.equal(everyone[0], other) for other in everyone)


def test_replicas_seeded_apart_end_equal(pools):
    assert all(pools.run(4, _seeded_apart_worker, timeout_s=120))
