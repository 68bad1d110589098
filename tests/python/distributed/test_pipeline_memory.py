"""A pipeline stage's memory does not grow with the microbatch count: a finished microbatch's
calls drop their messages and its result leaves its graph (Note [Tensors of a finished call] in
smp.pipeline.runtime), so 1F1B's bound on the microbatches in flight is what a stage holds."""

from __future__ import annotations

import pytest
import torch
from model import GPT, GPTConfig, lm_loss
from models import step_peak

import smp

_SEQ, _VOCAB, _HIDDEN = 128, 512, 128


def _peak_worker(microbatches: int, pipeline: str, detach: bool) -> float:
    config = {"pipeline_parallel_degree": 2, "microbatches": microbatches, "ddp": True}
    if pipeline == "1f1b":
        config.update(pipeline="static", pipeline_schedule="1f1b")
    smp.init(config)
    torch.manual_seed(0)
    module = GPT(GPTConfig(block_size=_SEQ, vocab_size=_VOCAB, n_layer=4, n_head=4, n_embd=_HIDDEN))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step(detach_outputs=detach)
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = (torch.randint(0, _VOCAB, (microbatches, _SEQ)) for _ in range(2))  # one sample each
    peak, losses = step_peak(model, module, opt, train_step, x, y)
    assert all(loss.grad_fn is None for loss in losses.outputs) == detach
    return float(peak)


@pytest.mark.parametrize("pipeline", ["1f1b", "interleaved"])
def test_a_stage_holds_no_more_with_more_microbatches(pools, pipeline):
    few = pools.run(2, _peak_worker, 4, pipeline, True)
    many = pools.run(2, _peak_worker, 64, pipeline, True)
    # One microbatch's messages: its hidden state and its logits (fp32, one sample). Holding
    # them until the step's end grew a stage by more than half of that per microbatch (36 to 41
    # of them from 4 to 64 microbatches); what is left is the schedule's own variation, up to
    # 10 of them between runs.
    message = _SEQ * (_HIDDEN + _VOCAB) * 4
    for rank, (a, b) in enumerate(zip(few, many)):
        assert b - a < 20 * message, (rank, a, b, message)
