"""Activation checkpointing (``smp.set_activation_checkpointing``, ``smp.checkpoint``) changes
no number: the same training run with and without it gives bitwise the same loss every step,
every gradient and the parameters after three AdamW steps, with dropout on (torch's generators
and smp's tensor-parallel ones restored for the recompute).

Layouts pp 2, tp 2, tp 2 x dp 2 and pp 2 x tp 2 x dp 2 (8 processes); the demo GPT (per-block TP
marking, its blocks checkpointed before wrapping) and an unmodified Hugging Face Llama
(whole-model marking, its layers checkpointed after wrapping, attention dropout on, padding on
some ranks only). Each run also counts the calls of a module inside each checkpointed layer:
with checkpointing every layer's forward runs again in backward, on the stage that owns it."""

from __future__ import annotations

import pytest
import torch
from models import lm_train_step, parity_adamw, split_gpt_blocks, tiny_hf_model
from test_tp_parity import full_grads

STEPS = 3
VOCAB = 64
SEQ = 8


def _batch(kind: str, step: int, replica: int):
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if replica % 2 == 1:
        mask[1, -3:] = 0  # padding on the odd replicas only
    return ids, mask


def _inputs(kind: str, step: int, replica: int):
    """(ids, targets) for the GPT, (ids, attention mask) for the Llama: lm_train_step's."""
    ids, mask = _batch(kind, step, replica)
    return (ids, ids) if kind == "gpt" else (ids, mask)


def _calling_gpt_forward(self, idx):
    """The demo GPT's forward with each block called through ``smp.checkpoint``."""
    import smp

    x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
    for block in self.h:
        x = smp.checkpoint(block, x)
    return self.lm_head(self.ln_f(x))


def _train(kind: str, layout: tuple[int, int, int], checkpointed: str | None, **config):
    """One run: losses, full gradients per step, the full state dict at the end, and how many
    times the counted inner module ran on this rank."""
    from model import GPT, GPTConfig

    import smp

    _CallingGPT = type("CallingGPT", (GPT,), {"forward": _calling_gpt_forward})
    pp, tp, dp = layout
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2,
              "ddp": dp > 1, **config})  # fmt: skip
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32,
                        dropout=0.1)  # fmt: skip
        module = (_CallingGPT if checkpointed == "call" else GPT)(cfg)
        split_gpt_blocks(smp, module)
        if checkpointed == "mark":
            smp.set_activation_checkpointing(module.h)  # before wrapping
        counted = [block.mlp for block in module.h]
    else:
        with smp.tensor_parallelism():
            module = tiny_hf_model("llama", VOCAB, SEQ,
                                   attention_dropout=0.1, use_cache=False)  # fmt: skip
        counted = [layer.mlp for layer in module.model.layers]
    model = smp.DistributedModel(module)
    if kind == "llama" and checkpointed == "mark":
        for layer in model.get_module().model.layers:  # SMP v1's way: after wrapping
            smp.set_activation_checkpointing(layer)
    calls = [0, 0]  # forwards with grad (not tracing), recomputes (run inside a backward)

    def count(*_):
        if torch._C._current_graph_task_id() != -1:
            calls[1] += 1
        elif torch.is_grad_enabled():
            calls[0] += 1

    for m in counted:
        m.register_forward_pre_hook(count)  # a recompute may stop before a module returns
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))

    train_step = lm_train_step(smp, kind)

    losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(train_step(model, *_inputs(kind, step, smp.dp_rank())).reduce_mean())
        grads.append(full_grads(model))
        optimizer.step()
    state = model.state_dict()
    smp.shutdown()
    return losses, grads, state, calls


def _compare(plain, checked, exact: bool) -> None:
    def same(a, b, what):
        if exact:
            assert torch.equal(a, b), (what, (a - b).abs().max())
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")

    for a, b in zip(plain[0], checked[0]):
        same(a, b, "loss")
    for step, (a, b) in enumerate(zip(plain[1], checked[1])):
        assert a.keys() == b.keys()
        for name in a:
            same(a[name], b[name], f"step {step} gradient of {name}")
    for name, value in plain[2].items():
        same(value, checked[2][name], f"parameter {name}")


def _worker(kind: str, layout: tuple[int, int, int], how: str):
    plain = _train(kind, layout, None)
    checked = _train(kind, layout, how)
    # A pipelined step adds the shares of a tied weight's gradient (the GPT's embedding and
    # head) in an order that depends on timing (design.md §4.4), so two runs of it differ in
    # rounding with or without checkpointing; elsewhere the runs agree bit for bit.
    _compare(plain, checked, exact=layout[0] == 1 or kind == "llama")
    return plain[3], checked[3], [x.item() for x in plain[0]]


LAYOUTS = {"pp2": (2, 1, 1), "tp2": (1, 2, 1), "tp2xdp2": (1, 2, 2), "pp2xtp2xdp2": (2, 2, 2)}


@pytest.mark.parametrize(
    "kind, layout, how",
    [
        ("gpt", "pp2", "mark"),
        ("gpt", "pp2", "call"),
        ("gpt", "tp2", "mark"),
        ("llama", "tp2xdp2", "mark"),
        ("llama", "pp2", "mark"),
        ("gpt", "pp2xtp2xdp2", "mark"),
    ],
)
def test_checkpointing_changes_no_number(pools, kind, layout, how):
    pp, tp, dp = LAYOUTS[layout]
    results = pools.run(pp * tp * dp, _worker, kind, LAYOUTS[layout], how, timeout_s=600)
    for plain_calls, checked_calls, losses in results:
        # Each forward of a counted module on this rank ran once more in backward (one
        # recompute per call, however many autograd calls its backward took), on its owner.
        assert plain_calls[1] == 0 and checked_calls[0] == plain_calls[0], (
            plain_calls,
            checked_calls,
        )
        assert checked_calls[1] == checked_calls[0], checked_calls
        assert all(0 < x < 10 for x in losses), losses
    assert sum(r[0][0] for r in results) > 0


def _offload_worker():
    """Llama at pp 2 with its layers checkpointed, 4 microbatches: offloading on (horizon 1)
    against off. The same losses bitwise, parameters to rounding; on each stage every
    checkpointed call's inputs went out once after its microbatch's forward there and came
    back once."""
    import smp

    runs = []
    for offload in (False, True):
        smp.init({"pipeline_parallel_degree": 2, "microbatches": 4,
                  "offload_activations": offload, "activation_loading_horizon": 1})  # fmt: skip
        torch.manual_seed(0)
        module = tiny_hf_model("llama", VOCAB, SEQ, attention_dropout=0.1, use_cache=False)
        smp.set_activation_checkpointing(module.model.layers)
        model = smp.DistributedModel(module)
        optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))

        train_step = lm_train_step(smp, "llama")
        losses = []
        for step in range(2):
            optimizer.zero_grad()
            ids, mask = _batch("llama", step, 1)  # padding in this batch
            ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
            losses.append(train_step(model, ids, mask).reduce_mean())
            optimizer.step()
        moves = list(smp.memory.offload.current().moves) if offload else []
        runs.append((losses, model.state_dict(), moves))
        smp.shutdown()
    (plain_losses, plain_state, _), (losses, state, moves) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    # Four microbatches' gradient shares meet in an order that depends on timing: rounding.
    for name, value in plain_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5)
    return [(m.direction, m.microbatch, m.ahead) for m in moves]


def test_offloading_at_pp2_changes_no_number_and_moves_each_frame_once(pools):
    for moves in pools.run(2, _offload_worker, timeout_s=300):
        out = [(mb) for d, mb, _ in moves if d == "out"]
        back = [(mb, ahead) for d, mb, ahead in moves if d == "in"]
        assert len(out) == len(back) == 2 * 4  # 1 layer per stage x 4 microbatches x 2 steps
        assert sorted(out) == sorted(mb for mb, _ in back)
        assert any(ahead for _, ahead in back), back  # the horizon brought some back early
