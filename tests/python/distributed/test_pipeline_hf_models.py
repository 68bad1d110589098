"""Unmodified Hugging Face models with their default configs (``use_cache=True``, as every HF
causal LM and seq2seq model ships; only dropout off and sizes tiny) train under the pipeline
runtime exactly as one process does: the loss of every step, and the full state dict after three
AdamW steps. Their caches (``DynamicCache``, ``EncoderDecoderCache``) cross stages: each stage
appends its layers' keys and values to the caller's cache object, so an evaluation step returns
the same cache as one process.

Every batch has padding on some samples only, and of different lengths."""

from __future__ import annotations

import pytest
import torch
from models import parity_adamw

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=2e-4, atol=2e-5)
STEPS = 3
VOCAB = 96


def build(name: str):
    """A tiny model of each family; every other setting is the family's default."""
    t = transformers
    if name == "gpt2":
        config = t.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=4, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        cls = t.GPT2LMHeadModel
    elif name == "llama":
        config = t.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        cls = t.LlamaForCausalLM
    elif name == "opt":
        config = t.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=4,
            num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32,
            dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        cls = t.OPTForCausalLM
    elif name == "t5":
        config = t.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=2, dropout_rate=0.0,
        )  # fmt: skip
        cls = t.T5ForConditionalGeneration
    elif name in ("bert", "roberta"):
        kind = t.BertConfig if name == "bert" else t.RobertaConfig
        config = kind(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=72,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        cls = t.BertForMaskedLM if name == "bert" else t.RobertaForMaskedLM
    else:
        raise ValueError(name)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 1)
    if name == "t5":
        config.decoder_start_token_id = config.pad_token_id  # T5's own convention
    torch.manual_seed(0)
    return cls(config)


def make_batch(name: str, step: int, batch: int = 4) -> dict:
    """Samples of different lengths, padded on the right to the longest; sample 0 unpadded."""
    g = torch.Generator().manual_seed(100 + step)
    seq = 10 + step
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(1, batch):
        mask[i, seq - int(torch.randint(1, 5, (1,), generator=g)) :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if name == "t5":
        targets = torch.randint(2, VOCAB, (batch, 6), generator=g)
        targets[batch - 1, 4:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": targets}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _parity_worker(
    name: str,
    pp: int,
    microbatches: int,
    dp: int = 1,
    keep_min: int | None = None,
    options: dict | None = None,
):
    """Trains ``STEPS`` steps against one process: with ``dp`` replicas, each on its own
    batches (other lengths, other padding), the reference on all of them. ``keep_min``: the
    size from which a request tensor the owner did not read stays with the caller (Note
    [Arguments fetched when read]; 0: every tensor)."""
    from smp.pipeline import calls

    keep = calls._KEEP_MIN
    if keep_min is not None:
        calls._KEEP_MIN = keep_min
    try:
        return _parity(name, pp, microbatches, dp, options or {})
    finally:
        calls._KEEP_MIN = keep


def _parity(name: str, pp: int, microbatches: int, dp: int, options: dict):
    import smp

    smp.init(
        {"pipeline_parallel_degree": pp, "microbatches": microbatches, "ddp": dp > 1, **options}
    )
    reference = build(name)
    model = smp.DistributedModel(build(name))
    assert model.module.config.use_cache or name in ("bert", "roberta")
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, batch):
        out = model(**batch)
        model.backward(out.loss)
        return out.loss

    from smp.core import messages
    from smp.pipeline import protocol
    from smp.pipeline.sender import Sender

    again = [0]  # tensors that went as references to an earlier request's (tensors sent once)
    quiet = [0]  # requests sent quiet (Note [Quiet calls] in smp/pipeline/protocol.py)
    kept = [0, 0]  # tensors kept by the caller, and FETCHes of them
    send = Sender.send

    def counting_send(self, peer, header, tensors, wait=False):
        if header[0] == protocol.REQUEST and header[3] != protocol._FETCH:
            stages = list(header[8 : 7 + 4 * header[6] : 4])
            again[0] += stages.count(messages.INPUT)
            kept[0] += stages.count(messages.CALLER)
            quiet[0] += bool(header[5] & protocol._QUIET)
        elif header[0] == protocol.REQUEST:
            kept[1] += header[8] == protocol._ARGUMENT
        return send(self, peer, header, tensors, wait)

    def reference_loss(step: int, replica: int):
        batch = make_batch(name, step + 3 * replica)  # replicas: other lengths and padding
        chunks = [
            {k: v.chunk(microbatches)[i] for k, v in batch.items()} for i in range(microbatches)
        ]
        return sum(reference(**c).loss for c in chunks) / microbatches

    losses = []
    for step in range(STEPS):
        batch = make_batch(name, step + 3 * smp.dp_rank())
        optimizer.zero_grad()
        Sender.send = counting_send
        try:
            loss = train_step(model, batch).reduce_mean().item()
        finally:
            Sender.send = send
        reference_optimizer.zero_grad()
        replicas = [reference_loss(step, r) for r in range(dp)]
        (sum(replicas) / dp).backward()
        mine = replicas[smp.dp_rank()].item()
        assert abs(loss - mine) <= 2e-5 * (1 + abs(loss)), (step, loss, mine)
        optimizer.step()
        reference_optimizer.step()
        losses.append(loss)
    full, expected = model.state_dict(), reference.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    return losses, sorted(set(model.partition_plan.assignment.values())), again[0], quiet[0], kept


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "t5", "bert", "roberta"])
def test_default_config_two_stages(pools, name):
    results = pools.run(2, _parity_worker, name, 2, 2)
    assert results[0][:2] == results[1][:2] and results[0][1] == [0, 1]
    if name in ("gpt2", "llama", "opt"):  # the cache's earlier layers, the masks: once each
        assert results[0][2] > 0, results[0][2]


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "t5", "bert", "roberta"])
def test_every_unread_argument_kept(pools, name):
    """Every request tensor of any size that the owner does not read stays with the caller and
    is fetched when read (Note [Arguments fetched when read]): the masks, positions and cache
    entries of each family, with their gradients and through the optimizer's steps, exact."""
    results = pools.run(2, _parity_worker, name, 2, 2, 1, 0)
    assert results[0][:2] == results[1][:2] and results[0][1] == [0, 1]
    kept = [sum(r[4][i] for r in results) for i in range(2)]
    assert kept[0] >= kept[1] > 0, kept  # read ones fetched once per microbatch, then sent
    if name in ("gpt2", "llama", "opt"):  # the cache's earlier layers are never read
        assert kept[0] > kept[1], kept


def test_every_unread_argument_kept_under_a_zero_bubble_program(pools):
    """The same under the static ZB-H1 program, whose weight halves run apart from their input
    gradients: a fetched argument's leaf takes its gradient as a sent one would."""
    zbh1 = {"pipeline": "static", "pipeline_schedule": "zbh1"}
    results = pools.run(2, _parity_worker, "llama", 2, 4, 1, 0, zbh1)
    kept = [sum(r[4][i] for r in results) for i in range(2)]
    assert kept[0] > kept[1] > 0, kept


@pytest.mark.parametrize("name", ["llama", "t5"])
@pytest.mark.parametrize("pp, dp", [(2, 2), (4, 1)], ids=["pp2xdp2", "pp4"])
def test_every_unread_argument_kept_in_other_layouts(pools, name, pp, dp):
    """The same with every tensor kept, at pp 2 x dp 2 (each replica its own lengths and
    padding, so its own learned reads) and at pp 4 (one caller keeping for three owners)."""
    results = pools.run(pp * dp, _parity_worker, name, pp, 2, dp, 0)
    assert all(r[1] == list(range(pp)) for r in results)
    kept = [sum(r[4][i] for r in results) for i in range(2)]
    assert kept[0] >= kept[1] > 0, kept


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_default_config_two_stages_two_replicas(pools, name):
    """pp 2 x dp 2, each replica on batches of its own lengths and padding: the leader's
    calls go quiet after the first step (no REPLY, no GRAD_IN; on the cache's layers too),
    and the gradients averaged over the replicas stay exact through the optimizer's steps."""
    results = pools.run(4, _parity_worker, name, 2, 2, 2)
    leaders = [r for r in results if r[3] or r[2]]  # the ranks that send requests
    assert len(leaders) == 2 and all(r[3] > 0 for r in leaders), [r[2:] for r in results]
    assert len({tuple(r[0]) for r in results}) == 2, [r[0] for r in results]  # own data


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "t5", "bert", "roberta"])
def test_default_config_four_stages(pools, name):
    results = pools.run(4, _parity_worker, name, 4, 2)
    assert all(r[:2] == results[0][:2] for r in results) and results[0][1] == [0, 1, 2, 3]


def _evaluation_worker(name: str, pp: int):
    """An evaluation step with ``use_cache=True``: logits and the returned cache equal one
    process's, although every stage filled its own layers' part of it."""
    import smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 1})
    reference = build(name).eval()
    model = smp.DistributedModel(build(name))
    model.eval()

    @smp.step
    def evaluate(model, batch):
        out = model(**batch, use_cache=True)
        return out.logits, out.past_key_values

    batch = make_batch(name, 0)
    del batch["labels"]
    if name == "t5":
        batch["decoder_input_ids"] = batch["input_ids"][:, :5]
    with torch.no_grad():
        logits, cache = evaluate(model, batch)
        expected = reference(**batch, use_cache=True)
    logits, cache = logits.outputs[0], cache.outputs[0]
    torch.testing.assert_close(logits, expected.logits, **TOL)
    assert type(cache) is type(expected.past_key_values)
    caches = [(cache, expected.past_key_values)]
    if name == "t5":
        caches = [
            (cache.self_attention_cache, expected.past_key_values.self_attention_cache),
            (cache.cross_attention_cache, expected.past_key_values.cross_attention_cache),
        ]
    layers = 0
    for mine, theirs in caches:
        assert len(mine.layers) == len(theirs.layers)
        for a, b in zip(mine.layers, theirs.layers):
            torch.testing.assert_close(a.keys, b.keys, **TOL)
            torch.testing.assert_close(a.values, b.values, **TOL)
            layers += 1
    return layers


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_evaluation_returns_the_cache_every_stage_filled(pools, name):
    layers = pools.run(2, _evaluation_worker, name, 2)
    assert layers[0] == layers[1] > 0
