"""Tensor parallelism equals one process running the whole global batch.

Every rank builds a reference (tensor_parallel_degree 1: the same modules on a group of one rank)
and the model under test from the same seed, loads the reference's full state dict into the
distributed model (exercising the sharding of load_state_dict), and then compares, every step:
the global loss, every gradient gathered to its full shape, and every parameter after the AdamW
step (through ``model.state_dict()``, which gathers shards). fp32 at rtol = atol = 1e-5, fp64 at
1e-10.

Batch semantics: by default each rank of a TP group holds different samples (the global batch is
dp_size x local); with ``prescaled_batch`` the TP ranks share one (rdp_size x local).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from models import parity_adamw, tiny_hf_model

LOCAL_BATCH = 2
SEQ = 8
STEPS = 3
TOL32 = dict(rtol=1e-5, atol=1e-5)
TOL64 = dict(rtol=1e-10, atol=1e-10)
LM = dict(
    num_layers=2,
    num_attention_heads=4,
    attention_head_size=8,
    hidden_size=32,
    intermediate_size=64,
    vocab_size=64,
    num_positions=SEQ,
    attention_dropout_prob=0.0,
    hidden_dropout_prob=0.0,
    embedding_dropout_prob=0.0,
    causal_mask_size=SEQ,
    pre_layernorm=True,  # GPT-2 style: LayerNorm on each sublayer's input, and a final one
    post_layernorm=False,
    use_normal_initialization=True,  # N(0, 0.02): a key bias's zero gradient stays below eps
)


def local_group() -> dist.ProcessGroup:
    """A group of this rank alone: modules built on it are not distributed (the reference)."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at its full shape (shards gathered over the TP group)."""
    import smp
    from smp.tp.functional import unshard_tensor

    out = {}
    group = smp.get_tp_process_group()
    for name, p in model.module.named_parameters():
        if not model._owns(name):  # another pipeline stage's
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        split = getattr(p, "_smp_tp_split", None)
        if split is not None and smp.tp_size() > 1:
            parts = [torch.empty_like(grad) for _ in range(smp.tp_size())]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = unshard_tensor(parts, *split)
        out[name] = grad
    return out


def batches(vocab: int, batch: int, step: int):
    g = torch.Generator().manual_seed(4321 + step)
    tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _run_parity(smp, model, reference, loss_of, vocab, tol, microbatches, prescaled):
    """The shared step loop: returns the global losses."""
    per_rank_batches = smp.rdp_size() if prescaled else smp.dp_size()
    my_index = smp.rdp_rank() if prescaled else smp.dp_rank()
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, ids, labels):
        loss = loss_of(model, ids, labels)
        model.backward(loss)
        return loss

    losses = []
    local = LOCAL_BATCH * microbatches
    for step in range(STEPS):
        ids, labels = batches(vocab, local * per_rank_batches, step)
        mine = slice(my_index * local, (my_index + 1) * local)
        optimizer.zero_grad()
        loss = train_step(model, ids[mine], labels[mine]).reduce_mean()
        global_loss = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size()

        reference_optimizer.zero_grad()
        reference_loss = loss_of(reference, ids, labels)
        reference_loss.backward()
        assert abs(global_loss - reference_loss.item()) <= tol["atol"] + tol["rtol"] * abs(
            global_loss
        ), (step, global_loss, reference_loss.item())

        grads = full_grads(model)
        for name, q in reference.named_parameters():
            if name not in grads:
                continue
            expected = q.grad if q.grad is not None else torch.zeros_like(q)
            torch.testing.assert_close(
                grads[name], expected, **tol, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
            )
        optimizer.step()
        reference_optimizer.step()
        full = model.state_dict()
        for name, q in reference.state_dict().items():
            torch.testing.assert_close(
                full[name], q, **tol, msg=lambda m, n=name, s=step: f"step {s} param {n}: {m}"
            )
        losses.append(global_loss)
    return losses


def _lm_worker(tp, optimize="speed", prescaled=False, microbatches=1, dtype="float32"):
    import smp
    from smp.nn import DistributedTransformerLMHead

    torch.set_default_dtype(getattr(torch, dtype))
    try:
        smp.init(
            {
                "tensor_parallel_degree": tp,
                "microbatches": microbatches,
                "optimize": optimize,
                "prescaled_batch": prescaled,
            }
        )
        torch.manual_seed(11)
        reference = DistributedTransformerLMHead(**LM, group=local_group())
        torch.manual_seed(12 + smp.rank())  # differs on purpose: the weights come from the load
        model = smp.DistributedModel(DistributedTransformerLMHead(**LM))
        model.load_state_dict(reference.state_dict())
        # The split really happened: embedding rows and heads are per rank.
        assert model.module.word_embedding.weight.shape[0] == LM["vocab_size"] // tp

        def loss_of(m, ids, labels):
            return m(ids, labels=labels).mean()

        tol = TOL64 if dtype == "float64" else TOL32
        return _run_parity(
            smp, model, reference, loss_of, LM["vocab_size"], tol, microbatches, prescaled
        )
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize(
    "world,tp,optimize,prescaled,microbatches,dtype",
    [
        (2, 2, "speed", False, 1, "float64"),
        (2, 2, "speed", False, 2, "float32"),
        (2, 2, "memory", False, 1, "float64"),
        (2, 2, "speed", True, 1, "float32"),
        (2, 2, "memory", True, 2, "float32"),
        (4, 4, "speed", False, 1, "float32"),
        (4, 2, "speed", False, 2, "float32"),  # tp 2 x dp 2
        (4, 2, "memory", True, 1, "float32"),  # tp 2 x dp 2, prescaled
    ],
)
def test_lm_head_parity(pools, world, tp, optimize, prescaled, microbatches, dtype):
    results = pools.run(world, _lm_worker, tp, optimize, prescaled, microbatches, dtype)
    assert all(r == results[0] for r in results)


# ---- Hugging Face models ------------------------------------------------------------------------


def _hf_model(kind: str):
    """(the tiny HF model of ``kind``, the path of its blocks); GPT-2 and Llama without a cache."""
    blocks = {"gpt2": "transformer.h", "llama": "model.layers"}.get(kind, f"{kind}.encoder.layer")
    overrides = {"use_cache": False} if kind in ("gpt2", "llama") else {}
    return tiny_hf_model(kind, 64, SEQ, **overrides), blocks


def _hf_worker(kind, tp, microbatches, pp=1, bucket_cap_mb=25):
    import smp

    smp.init(
        {"tensor_parallel_degree": tp, "microbatches": microbatches, "pipeline_parallel_degree": pp}
    )
    torch.manual_seed(5)
    reference, blocks = _hf_model(kind)
    model = copy.deepcopy(reference)
    for block in model.get_submodule(blocks):
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(model, bucket_cap_mb=bucket_cap_mb)
    assert len(model.distributed_modules) == 2, model.distributed_modules
    first = model.module.get_submodule(blocks)[0]
    assert type(first).__name__.startswith("TP"), type(first)

    def loss_of(m, ids, labels):
        if kind in ("bert", "roberta"):
            # Padding in every other sample: the attention mask travels with the batch.
            mask = torch.ones_like(ids)
            mask[1::2, -3:] = 0
            return m(input_ids=ids, attention_mask=mask, labels=labels[:, 0] % 3).loss
        # Causal LMs shift the labels themselves: pass the inputs.
        return m(input_ids=ids, labels=ids).loss

    losses = _run_parity(smp, model, reference, loss_of, 64, TOL32, microbatches, False)
    stages = [model.partition_plan.assignment[f"{blocks}.{i}"] for i in range(2)]
    if bucket_cap_mb < 1:  # the dp and rdp reductions went out during the backward (§2)
        groups = {b.group for b in model._grads.reduction.buckets}
        assert groups == {"dp", "rdp"}, groups
        assert model._grads.reduction.issued_early == len(model._grads.reduction.buckets) > 10
    return {"losses": losses, "block_stages": stages}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "roberta"])
def test_hugging_face_parity(pools, kind):
    pytest.importorskip("transformers")
    results = pools.run(2, _hf_worker, kind, 2, 1)
    assert all(r == results[0] for r in results)


def test_hugging_face_tp2_dp2(pools):
    pytest.importorskip("transformers")
    results = pools.run(4, _hf_worker, "gpt2", 2, 2)
    assert all(r == results[0] for r in results)


def test_hugging_face_tp2_dp2_reduced_during_backward(pools):
    """Small buckets: both reduction groups (dp for replicated parameters, rdp for shards) issue
    their buckets from the gradient hooks, and the result is still exact."""
    pytest.importorskip("transformers")
    results = pools.run(4, _hf_worker, "llama", 2, 2, 1, 4 / 1024)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_pp2_tp2(pools, kind):
    """Pipeline x tensor parallelism: the TP ranks of each stage agree on the task order."""
    pytest.importorskip("transformers")
    results = pools.run(4, _hf_worker, kind, 2, 2, 2)
    assert all(r == results[0] for r in results)
    assert results[0]["block_stages"] == [0, 1], results[0]  # TP blocks on both stages


def test_hugging_face_pp2_tp2_dp2(pools):
    pytest.importorskip("transformers")
    results = pools.run(8, _hf_worker, "gpt2", 2, 2, 2)
    assert all(r == results[0] for r in results)


def _pp_tp_failure_worker(bad_tp_rank: int):
    import time

    import smp

    smp.init(
        {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2,
         "timeout_s": 8}
    )  # fmt: skip
    torch.manual_seed(5)
    model, blocks = _hf_model("gpt2")
    for block in model.get_submodule(blocks):
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(model)
    armed = [False]

    @smp.step
    def train_step(model, ids):
        if armed[0] and smp.tp_rank() == bad_tp_rank and smp.microbatch() == 1:
            raise KeyError(f"boom on TP rank {bad_tp_rank}")
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids, _ = batches(64, 4, 0)
    train_step(model, ids)  # partitions the model; a good step
    armed[0] = True
    start = time.monotonic()
    try:
        train_step(model, ids)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)[:2000], time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("bad_tp_rank", [0, 1])
def test_pp_tp_failure_reaches_every_rank(pools, bad_tp_rank):
    pytest.importorskip("transformers")
    for kind, message, seconds in pools.run(4, _pp_tp_failure_worker, bad_tp_rank, timeout_s=150):
        assert f"boom on TP rank {bad_tp_rank}" in message, (kind, message)
        assert seconds < 60, seconds
