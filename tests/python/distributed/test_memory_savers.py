"""All the memory savers together change no number: activation checkpointing
(``smp.set_activation_checkpointing``), activation offloading (``offload_activations``,
``activation_loading_horizon`` 1) and optimizer-state sharding (``shard_optimizer_state``)
in one run, against the same run with none of them.

Compared: the loss every step, every gradient at its full shape (tensor-parallel shards
gathered) and the full ``model.state_dict()`` after 3 AdamW steps, with dropout on, every
data-parallel rank given its own samples and padding on the odd ones only. Layouts: pp 2 x
tp 2 x dp 2 (8 processes) on an unmodified Hugging Face Llama (whole-model tensor-parallel
marking, its decoder layers checkpointed after wrapping), and pp 2 x dp 2 (4 processes) on the
demo GPT (its blocks checkpointed before wrapping). Inside the run with the savers each rank
also checks that it holds about half the optimizer state of the unsharded run (rdp is 2) and
that its checkpointed frames went to the host and came back (as many loads as offloads).

Tolerance rtol = atol = 1e-5, not bitwise: at pp 2 the pipeline runtime adds the shares of a
gradient (microbatches, tied weights) in an order that depends on timing, so two runs of the
same configuration may differ in the last bits (design.md §7.1, §7.3); each saver alone is
tested bitwise where the layout allows it (test_activation_checkpointing.py, test_zero.py).
"""

from __future__ import annotations

import pytest
import torch
from models import lm_train_step, parity_adamw, tiny_hf_model
from test_activation_checkpointing import _batch
from test_tp_parity import full_grads

STEPS = 3
VOCAB = 64
SEQ = 8
TOL = dict(rtol=1e-5, atol=1e-5)
SAVERS = {"offload_activations": True, "activation_loading_horizon": 1,
          "shard_optimizer_state": True}  # fmt: skip


def _gpt_batch(step: int, replica: int):
    """Next-token inputs and targets, this data-parallel replica's own."""
    g = torch.Generator().manual_seed(2000 + 1000 * replica + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _train(kind: str, layout: tuple[int, int, int], savers: bool):
    """One run: losses and full gradients per step, the full state dict at the end, this
    rank's optimizer state bytes and (with the savers) the offloader's summary."""
    from model import GPT, GPTConfig

    import smp

    pp, tp, dp = layout
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2,
              "ddp": dp > 1, **(SAVERS if savers else {})})  # fmt: skip
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32,
                        dropout=0.1)  # fmt: skip
        module = GPT(cfg)
        if savers:
            smp.set_activation_checkpointing(module.h)  # before wrapping
    else:
        with smp.tensor_parallelism():  # SMP-style: the whole model marked
            module = tiny_hf_model("llama", VOCAB, SEQ,
                                   attention_dropout=0.1, use_cache=False)  # fmt: skip
    model = smp.DistributedModel(module)
    if kind == "llama" and savers:
        smp.set_activation_checkpointing(model.get_module().model.layers)  # after wrapping
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))

    train_step = lm_train_step(smp, kind)

    losses, grads = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        if kind == "gpt":
            batch = _gpt_batch(step, smp.dp_rank())
        else:
            batch = _batch("llama", step, smp.dp_rank())  # (ids, attention mask)
        losses.append(train_step(model, *batch).reduce_mean())
        grads.append(full_grads(model))
        optimizer.step()
    state = model.state_dict()
    summary = smp.memory.offload.current().summary() if savers else None
    out = {"losses": losses, "grads": grads, "state": state, "summary": summary,
           "bytes": optimizer.state_bytes(), "rdp": smp.rdp_size()}  # fmt: skip
    smp.shutdown()
    return out


def _worker(kind: str, layout: tuple[int, int, int]):
    plain = _train(kind, layout, savers=False)
    saved = _train(kind, layout, savers=True)

    largest = [0.0]  # the largest difference seen, for the report

    def same(a, b, what):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{kind} {layout} {what}: {m}")
        largest[0] = max(largest[0], (a.double() - b.double()).abs().max().item())

    for step, (a, b) in enumerate(zip(plain["losses"], saved["losses"])):
        same(a, b, f"step {step} loss")
    for step, (a, b) in enumerate(zip(plain["grads"], saved["grads"])):
        assert a.keys() == b.keys(), step
        for name in a:
            same(a[name], b[name], f"step {step} gradient of {name}")
    assert plain["state"].keys() == saved["state"].keys()
    for name, value in plain["state"].items():
        same(value, saved["state"][name], f"state_dict()[{name!r}]")

    # Sharded over rdp 2: about half the optimizer state of the unsharded run on this rank.
    assert saved["rdp"] == 2, saved["rdp"]
    ratio = saved["bytes"] / plain["bytes"]
    assert 0 < ratio <= 0.6, (saved["bytes"], plain["bytes"])
    # Every checkpointed frame went to the host after its forward and came back for backward.
    summary = saved["summary"]
    assert summary["offloaded"] == summary["loaded"] > 0, summary
    assert summary["offloaded_bytes"] == summary["loaded_bytes"] > 0, summary
    return ratio, summary, [x.item() for x in plain["losses"]], largest[0]


LAYOUTS = {"pp2xtp2xdp2": ("llama", (2, 2, 2)), "pp2xdp2": ("gpt", (2, 1, 2))}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_memory_savers_together_change_no_number(pools, layout):
    kind, (pp, tp, dp) = LAYOUTS[layout]
    results = pools.run(pp * tp * dp, _worker, kind, (pp, tp, dp), timeout_s=600)
    for _, _, losses, _ in results:
        assert all(0 < x < 10 for x in losses), losses
    # -s shows per rank: state bytes / unsharded, frames offloaded, loaded ahead, largest diff.
    print(layout, [(round(r, 3), s["offloaded"], s["loaded_ahead"], d) for r, s, _, d in results])
