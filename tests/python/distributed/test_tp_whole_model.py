"""SMP-style whole-model marking: an unmodified Hugging Face model created inside
``smp.tensor_parallelism()`` (every registered module marked: embeddings, LayerNorms, blocks,
LM head), with its default ``use_cache=True``, matches one process at every layout: tp 2,
pp 2 x tp 2 and pp 2 x tp 2 x dp 2. Loss every step, every gradient and the full state dict
after each of three AdamW steps (test_tp_parity's loop)."""

from __future__ import annotations

import pytest
import torch
from models import tiny_hf_model
from test_tp_parity import SEQ, TOL32, _run_parity

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _whole_model_worker(kind: str, tp: int, pp: int, microbatches: int):
    import smp

    smp.init(
        {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "microbatches": microbatches}
    )
    torch.manual_seed(5)
    reference = tiny_hf_model(kind, VOCAB, SEQ)
    torch.manual_seed(5)
    with smp.tensor_parallelism():
        model = tiny_hf_model(kind, VOCAB, SEQ)
    model = smp.DistributedModel(model)
    assert model.distributed_modules, "nothing was split"

    def loss_of(m, ids, labels):
        # Padding on the samples whose first token is small: some ranks' batches have none
        # (HF then drops the mask), others some, and which changes from step to step.
        mask = torch.ones_like(ids)
        mask[ids[:, 0] < VOCAB // 3, -3:] = 0
        if kind in ("bert", "roberta"):
            return m(input_ids=ids, attention_mask=mask, labels=labels[:, 0] % 3).loss
        if kind == "t5":
            return m(input_ids=ids, attention_mask=mask, labels=labels[:, :5].contiguous()).loss
        return m(input_ids=ids, attention_mask=mask, labels=ids).loss

    losses = _run_parity(smp, model, reference, loss_of, VOCAB, TOL32, microbatches, False)
    stages = sorted(set(model.partition_plan.assignment.values()))
    heads = {
        "gpt2": ["transformer.wte", "lm_head"],  # tied
        "opt": ["model.decoder.embed_tokens", "lm_head"],  # tied
        "llama": ["model.embed_tokens", "lm_head"],
    }
    for path in heads.get(kind, []):  # split along the vocabulary (tied for GPT-2)
        assert path in model.distributed_modules, (path, model.distributed_modules)
    if kind in heads:
        # Without labels the output holds the full logits of this rank's samples.
        @smp.step
        def predict(model, ids):
            return model(input_ids=ids).logits

        ids = torch.randint(0, VOCAB, (2 * microbatches * smp.dp_size(), SEQ))
        mine = ids.chunk(smp.dp_size())[smp.dp_rank()]
        with torch.no_grad():
            logits = predict(model, mine).concat()
            torch.testing.assert_close(logits, reference(input_ids=mine).logits, **TOL32)
    # Bytes of parameters this rank holds (tied ones once), against the whole model's.
    held = sum(p.numel() for _, p in model.local_named_parameters())
    whole = sum(p.numel() for p in reference.parameters())
    return {
        "losses": losses,
        "stages": stages,
        "split": sorted(model.distributed_modules),
        "held": held / whole if smp.pp_size() == 1 else None,
    }


@pytest.mark.parametrize("kind", ["gpt2", "llama", "opt", "t5", "bert", "roberta"])
def test_whole_model_tp2(pools, kind):
    results = pools.run(2, _whole_model_worker, kind, 2, 1, 1)
    assert all(r == results[0] for r in results)
    # The tied GPT-2 embedding and head are one shard per rank: about half the model each.
    if kind == "gpt2":
        assert results[0]["held"] <= 0.55, results[0]["held"]


def _different_lengths_worker():
    """Each TP rank brings its own sequence length (6 and 8 tokens) and padding on one rank
    only: the vocab-split head takes every rank's tokens, padded, and the loss and every
    gradient equal one process's on both ranks' samples. Without labels, different shapes
    fail fast on every rank, naming them."""
    from test_tp_parity import full_grads

    import smp

    smp.init({"tensor_parallel_degree": 2, "timeout_s": 20})
    torch.manual_seed(5)
    reference = tiny_hf_model("llama", VOCAB, SEQ)
    torch.manual_seed(5)
    with smp.tensor_parallelism():
        model = smp.DistributedModel(tiny_hf_model("llama", VOCAB, SEQ))

    @smp.step
    def train_step(model, ids, mask):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        model.backward(loss.loss)
        return loss.loss

    g = torch.Generator().manual_seed(3)
    batches = []
    for length in (6, 8):  # rank 0's, rank 1's
        ids = torch.randint(0, VOCAB, (2, length), generator=g)
        mask = torch.ones_like(ids)
        if length == 8:
            mask[1, -3:] = 0  # padding on rank 1 only
        batches.append((ids, mask))
    ids, mask = batches[smp.tp_rank()]
    loss = train_step(model, ids, mask).reduce_mean()
    everyone = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size()
    expected = sum(
        reference(input_ids=i, attention_mask=m, labels=i.masked_fill(m == 0, -100)).loss
        for i, m in batches
    ) / len(batches)
    expected.backward()
    assert abs(everyone - expected.item()) < 2e-5, (everyone, expected.item())
    grads = full_grads(model)
    for name, q in reference.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, **TOL32, msg=lambda m, n=name: f"{n}: {m}")

    @smp.step
    def predict(model, ids):
        return model(input_ids=ids).logits

    shapes = r"rank 0: .*shape \(2, 6\); rank 1"
    with pytest.raises(smp.DivergentArgumentsError, match=shapes), torch.no_grad():
        predict(model, ids)
    return True


def test_vocab_parallel_head_with_different_lengths_per_rank(pools):
    assert pools.run(2, _different_lengths_worker) == [True, True]


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert", "roberta", "t5"])
def test_whole_model_pp2_tp2(pools, kind):
    results = pools.run(4, _whole_model_worker, kind, 2, 2, 2)
    assert all(r == results[0] for r in results)
    assert results[0]["stages"] == [0, 1]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_whole_model_pp2_tp2_dp2(pools, kind):
    results = pools.run(8, _whole_model_worker, kind, 2, 2, 2)
    assert all(r == results[0] for r in results)
