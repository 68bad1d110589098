"""Ops on another stage's outputs run there (design.md §4.3, Note [Ops on futures run where the
value is] in smp/pipeline/calls.py): an unmodified Hugging Face Llama trained with
``model(input_ids=x, labels=x).loss`` (the loss in the root's forward, on stage 0, while the head
is on stage 1) leaves its logits on stage 1, and still equals one process: the loss every step
and the full state dict after each of four AdamW steps, on data whose padding differs per
microbatch. A step function that also uses the logits gets them, and an op with a large local
operand runs where the step function is."""

from __future__ import annotations

import pytest
import torch
from models import parity_adamw, tiny_hf_model

pytest.importorskip("transformers")

VOCAB, SEQ, STEPS, MICRO, M = 1024, 16, 6, 2, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (MICRO * M, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[ids[:, 0] < VOCAB // 3, -4:] = 0  # padding on some samples only
    return ids, mask


def _logits_stay_worker(use: str):
    """use: "loss" (only the loss), "logits" (the step also uses the logits: they are
    fetched), "big_operand" (an op with a large local operand: computed here)."""
    import smp
    from smp.pipeline.sender import Sender

    smp.init({"pipeline_parallel_degree": 2, "microbatches": M})
    torch.manual_seed(3)
    reference = tiny_hf_model("llama", VOCAB, SEQ)
    torch.manual_seed(3)
    module = tiny_hf_model("llama", VOCAB, SEQ)
    smp.set_partition(module, 0)
    smp.set_partition(module.model, 0)
    smp.set_partition(module.lm_head, 1)
    smp.set_partition(module.model.norm, 1)
    smp.set_partition(module.model.layers[1], 1)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())
    weights = torch.rand(MICRO, SEQ, VOCAB, generator=torch.Generator().manual_seed(9))

    def extra(logits, ids):
        if use == "logits":  # argmax is not an op that runs remotely: the logits come here
            return (logits.argmax(-1) == ids).float().mean()
        if use == "big_operand":  # a 128 KiB operand: the op runs here
            return (logits * weights).mean() * 1e-3
        return None

    @smp.step
    def train_step(model, ids, mask):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        more = extra(out.logits, ids)
        loss = out.loss if more is None or use == "logits" else out.loss + more
        model.backward(loss)
        return loss, more if more is not None else loss

    sent = {"bytes": 0}
    original = Sender.send

    def counting(self, peer, header, tensors, wait=False):
        sent["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return original(self, peer, header, tensors, wait)

    losses = []
    for step in range(STEPS):
        ids, mask = _batch(step)
        optimizer.zero_grad()
        sent["bytes"] = 0
        Sender.send = counting
        try:
            loss, more = train_step(model, ids, mask)
        finally:
            Sender.send = original
        reference_optimizer.zero_grad()
        ref_losses, ref_more = [], []
        for x, m in zip(ids.chunk(M), mask.chunk(M)):
            out = reference(input_ids=x, attention_mask=m, labels=x)
            value = extra(out.logits, x)
            total = out.loss if value is None or use == "logits" else out.loss + value
            (total / M).backward()
            ref_losses.append(total.detach())
            ref_more.append(value.detach() if value is not None else total.detach())
        torch.testing.assert_close(torch.stack(list(loss)), torch.stack(ref_losses), **TOL)
        torch.testing.assert_close(torch.stack(list(more)), torch.stack(ref_more), **TOL)
        optimizer.step()
        reference_optimizer.step()
        full = model.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        losses.append(float(sum(loss)) / M)
    logits_bytes = MICRO * SEQ * VOCAB * 4
    return smp.pp_rank(), sent["bytes"] / M / logits_bytes, losses


@pytest.mark.parametrize("use", ["loss", "logits", "big_operand"])
def test_ops_on_the_logits_run_where_they_are_and_stay_exact(pools, use):
    results = sorted(pools.run(2, _logits_stay_worker, use))
    (_, stage0_share, losses0), (_, stage1_share, losses1) = results
    assert losses0 == losses1
    # What stage 1 sends per microbatch in the last step, as a share of one microbatch's logits
    # (the calls' structures are learnt over the first steps: from the fifth, nothing changes).
    if use == "loss":
        assert stage1_share < 0.25, f"stage 1 sent {stage1_share:.2f} x the logits"
    else:  # the logits come to the step function once
        assert 1.0 <= stage1_share < 1.5, f"stage 1 sent {stage1_share:.2f} x the logits"
