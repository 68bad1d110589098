"""``DistributedModel.join()``: data-parallel replicas with different numbers of batches.

A replica whose inputs end shadows the others' steps with zero gradients; the gradients are the
sum over the replicas that had data divided by the data-parallel degree (DDP's join with
``divide_by_initial_world_size``), and every replica leaves with the same parameters. Checked
against one process computing exactly that, at dp 2, pp 2 x dp 2 and tp 2 x dp 2, and a replica
whose ranks disagree fails on every rank instead of hanging.
"""

from __future__ import annotations

import time

import pytest
import torch
from models import build_model, gpt_train_step, loss_fn, make_batch, split_gpt_blocks

TOL = dict(rtol=1e-5, atol=1e-6)


def _join_worker(pp: int, tp: int, steps_per_replica: list[int]):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2})
    torch.manual_seed(0)
    module = build_model("gpt")
    reference = build_model("gpt")
    reference.load_state_dict(module.state_dict())
    if pp > 1 or tp > 1:
        split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)

    train_step = gpt_train_step(smp)

    # Each rank of the TP group holds its own samples: a replica is a (dp, tp) pair here.
    replica, replicas = smp.dp_rank(), smp.dp_size()
    mine = steps_per_replica[replica // tp] if tp > 1 else steps_per_replica[replica]
    with model.join():
        for step in range(mine):
            optimizer.zero_grad()
            train_step(model, *make_batch("gpt", 4, step, seed=100 + replica))
            optimizer.step()

    # The reference: each step, the mean over the replicas that still had data, with the
    # missing ones counted as zero gradients (divided by the data-parallel degree).
    counts = [
        steps_per_replica[r // tp] if tp > 1 else steps_per_replica[r] for r in range(replicas)
    ]
    for step in range(max(counts)):
        reference_optimizer.zero_grad()
        total = 0.0
        for r in range(replicas):
            if step < counts[r]:
                total = total + loss_fn("gpt", reference(make_batch("gpt", 4, step, 100 + r)[0]),
                                        make_batch("gpt", 4, step, 100 + r)[1])  # fmt: skip
        (total / replicas).backward()
        reference_optimizer.step()
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return mine


@pytest.mark.parametrize(
    "world,pp,tp,steps",
    [(2, 1, 1, [3, 1]), (4, 2, 1, [1, 3]), (4, 1, 2, [2, 0])],
    ids=["dp2", "pp2xdp2", "tp2xdp2"],
)
def test_join_with_uneven_inputs_matches_one_process(pools, world, pp, tp, steps):
    pools.run(world, _join_worker, pp, tp, steps, timeout_s=300)


def _split_replica_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 20})
    torch.manual_seed(0)
    module = build_model("gpt")
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)

    train_step = gpt_train_step(smp)

    start = time.monotonic()
    replica_split = pytest.raises(RuntimeError, match="ranks of one model replica ran out")
    with replica_split, model.join():
        for step in range(2 if smp.pp_rank() == 0 else 1):  # stage 1 stops early
            train_step(model, *make_batch("gpt", 4, step))
    return time.monotonic() - start


def test_join_rejects_a_replica_whose_stages_disagree(pools):
    elapsed = pools.run(2, _split_replica_worker, timeout_s=120)
    assert max(elapsed) < 15, elapsed  # an error on every rank, not a stall
