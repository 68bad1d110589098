"""Small models and deterministic data shared by the Python tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from model import GPT, GPTConfig, lm_loss  # examples/gpt, put on sys.path by conftest
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 32, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


class Bert(nn.Module):
    """BERT-shaped encoder: embeddings, layers taking an attention (padding) mask, a pooler and a
    classifier."""

    def __init__(self, vocab: int = 50, d: int = 32, layers: int = 4, classes: int = 3):
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(16, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, classes)

    def forward(self, ids, mask):
        x = self.word(ids) + self.position(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=~mask)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def build_model(name: str) -> nn.Module:
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return GPT(tiny_gpt_config())
    if name == "bert":
        return Bert()
    raise ValueError(name)


def make_batch(name: str, batch_size: int, step: int, seed: int = 1234):
    """The global batch of ``step``: (inputs, targets), identical on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if name == "mlp":
        return torch.randn(batch_size, 12, generator=g), torch.randint(
            0, 5, (batch_size,), generator=g
        )
    if name == "bert":
        ids = torch.randint(0, 50, (batch_size, 16), generator=g)
        lengths = torch.randint(4, 17, (batch_size,), generator=g)
        mask = torch.arange(16)[None, :] < lengths[:, None]
        return (ids, mask), torch.randint(0, 3, (batch_size,), generator=g)
    cfg = tiny_gpt_config()
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(name: str, output, target):
    if name in ("mlp", "bert"):
        return F.cross_entropy(output, target)
    return lm_loss(output, target)


def gpt_train_step(smp):
    """The demo GPT's training step as an ``smp.step`` function ``(model, x, y) -> loss``: the
    loss, ``model.backward(loss)``, the loss back."""

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn("gpt", model(x), y)
        model.backward(loss)
        return loss

    return train_step


def step_peak(model, module: nn.Module, opt, train_step, *batch) -> tuple[int, Any]:
    """This rank's tensor peak (smp.planner.live.LiveMemory) over one training step and its
    optimizer step, after a first step has partitioned the model and made the optimizer
    state, not counting what it held before (parameters, buffers, optimizer state, the batch);
    and the measured step's output."""
    from smp.planner.live import LiveMemory

    train_step(model, *batch)
    opt.step()
    opt.zero_grad()
    state = [
        t for s in opt.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    live = LiveMemory([*model.local_parameters(), *module.buffers(), *state, *batch])
    with live:
        out = train_step(model, *batch)
        opt.step()
        opt.zero_grad()
    return live.peak_bytes, out


def lm_train_step(smp, kind: str):
    """The memory-saver tests' step as an ``smp.step`` function ``(model, ids, other)``: the
    demo GPT's next-token loss against ``other`` (its targets), or a Hugging Face causal LM's
    loss with ``other`` as the attention mask (labels -100 where it is 0)."""

    @smp.step
    def train_step(model, ids, other):
        if kind == "gpt":
            loss = loss_fn("gpt", model(ids), other)
        else:
            loss = model(input_ids=ids, attention_mask=other,
                         labels=ids.masked_fill(other == 0, -100)).loss  # fmt: skip
        model.backward(loss)
        return loss

    return train_step


def parity_adamw(params):
    """AdamW for parity tests. Adam's update lr * m / (sqrt(v) + eps) has sensitivity lr / eps to
    a gradient near zero, so fp32 summation-order noise (~1e-9: microbatches, ranks and stages add
    in a different order than one whole-batch backward) becomes lr / eps * 1e-9 in the
    parameters: 1e-3 with torch's defaults (eps 1e-8) and lr 1e-2, 1e-6 with eps 1e-6 and lr 1e-3.
    So the 1e-5 tolerance checks smp, not Adam's conditioning; the tolerance is not loosened."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def assert_owned_grads_match(model, reference, pp_rank: int, tol: dict) -> int:
    """Compares the gradients of the parameters this pipeline stage owns with the reference's
    (None where the reference has none); returns how many were compared."""
    plan = model.partition_plan
    checked = 0
    for (n, p), (_, q) in zip(model.module.named_parameters(), reference.named_parameters()):
        if plan.assignment[n.rpartition(".")[0]] != pp_rank:
            continue
        checked += 1
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=n: f"{n}: {m}")
    return checked


def tiny_hf_model(kind: str, vocab: int = 64, seq: int = 8, **overrides: Any):
    """An unmodified Hugging Face model of family ``kind`` ("gpt2", "llama", "opt", "t5",
    "bert", "roberta") from a tiny config: 2 layers, hidden 32, 4 heads, dropout off, every
    other setting the family's default (GPT-2, Llama, OPT and T5 keep ``use_cache=True``)
    unless ``overrides`` (config keywords) set it. BERT and RoBERTa are 3-label sequence
    classifiers; nothing is downloaded."""
    import transformers as t

    if kind == "gpt2":
        config = t.GPT2Config(
            vocab_size=vocab, n_positions=seq, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides,
        )  # fmt: skip
        return t.GPT2LMHeadModel(config)
    if kind in ("bert", "roberta"):
        cls = t.BertConfig if kind == "bert" else t.RobertaConfig
        config = cls(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=seq + 2, num_labels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides,
        )  # fmt: skip
        model_cls = (
            t.BertForSequenceClassification
            if kind == "bert"
            else t.RobertaForSequenceClassification
        )
        return model_cls(config)
    if kind == "opt":
        config = t.OPTConfig(
            vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=seq, word_embed_proj_dim=32,
            dropout=0.0, attention_dropout=0.0, **overrides,
        )  # fmt: skip
        return t.OPTForCausalLM(config)
    if kind == "t5":
        config = t.T5Config(
            vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, **overrides,
        )  # fmt: skip
        return t.T5ForConditionalGeneration(config)
    config = t.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, **overrides,
    )  # fmt: skip
    return t.LlamaForCausalLM(config)


_TOL = dict(rtol=1e-5, atol=1e-5)


def exact_steps(smp, make, place, variants, seed, microbatches, before_step, after_step) -> list:
    """Trains ``make()`` under smp (placed by ``place(module)``) and a single-process reference
    copy with SGD, one step per entry of ``variants`` (both models' ``variant`` for that step),
    checking the loss and every owned gradient each step. Calls ``before_step(step, module)``
    before and returns ``after_step(step)`` after each smp step. A variant of None is a step
    that must fail (on every rank); it returns the error's text and leaves the models as they
    were."""
    torch.manual_seed(0)
    reference = make()
    torch.manual_seed(0)
    module = make()
    place(module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(seed)
    out = []
    for step, variant in enumerate(variants):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        optimizer.zero_grad()
        before_step(step, module)
        if variant is None:
            with pytest.raises(Exception) as info:
                train_step(model, x, y)
            out.append(str(info.value))
            continue
        module.variant = reference.variant = variant
        loss = train_step(model, x, y).reduce_mean()
        out.append(after_step(step))
        reference_optimizer.zero_grad()
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            mb_loss = F.cross_entropy(reference(xs), ys) / microbatches
            mb_loss.backward()
            ref_loss += mb_loss.item()
        assert abs(loss.item() - ref_loss) < 1e-5, (step, loss.item(), ref_loss)
        assert assert_owned_grads_match(model, reference, smp.pp_rank(), _TOL) > 0
        optimizer.step()
        reference_optimizer.step()
    return out


def split_gpt_blocks(smp, gpt: nn.Module) -> None:
    """Registers the demo GPT's tensor-parallel plan for its ``Block`` (as
    examples/gpt/train.py does) and marks every block of ``gpt`` for tensor parallelism."""
    from model import BLOCK_TP_PLAN, Block

    smp.tp_register_plan(Block, **BLOCK_TP_PLAN)
    for block in gpt.h:
        smp.set_tensor_parallelism(block)
