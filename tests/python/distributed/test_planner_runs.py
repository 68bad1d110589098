"""A plan runs as planned: ``smp.init(plan.config)`` starts it, smp partitions the model as the
planner priced it, and each rank holds the parameters and optimizer state its ledger predicts
(design.md §13.3)."""

from __future__ import annotations

import pytest
import torch
from models import build_model, lm_loss, make_batch

import smp

# What the planner sees: the GPT's step on 2 samples, on two devices of a profile whose
# numbers do not matter here (the layout, partition and model states do not depend on them).
_CLUSTER = "h100"


def _plans():
    model = build_model("gpt")
    x, y = make_batch("gpt", 2, 0)
    return smp.plan(
        model, (x,), _CLUSTER, 8, num_devices=2, device="cpu",
        run=lambda m, ids: lm_loss(m(ids), y), max_plans=1000,
    )  # fmt: skip


def _pick(plans, pp: int, zero: bool, checkpointing: bool):
    for p in plans:
        c = p.config
        if (
            c["pipeline_parallel_degree"] == pp
            and c.get("shard_optimizer_state", False) == zero
            and bool(p.checkpointing) == checkpointing
            and c.get("pipeline_schedule") in (None, "1f1b")
        ):
            return p
    raise AssertionError(f"no plan with pp {pp}, ZeRO-1 {zero}, checkpointing {checkpointing}")


def _run_worker(config, checkpointing):
    smp.init(config)
    torch.manual_seed(0)
    module = build_model("gpt")
    for path in checkpointing:
        smp.set_activation_checkpointing(module.get_submodule(path))
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for i in range(2):
        x, y = make_batch("gpt", 8, i)
        dp, rank = smp.dp_size(), smp.dp_rank()
        x, y = x.chunk(dp)[rank], y.chunk(dp)[rank]
        losses.append(train_step(model, x, y).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    params = sum(p.numel() * p.element_size() for p in model.local_parameters())
    states = sum(
        t.numel() * t.element_size()
        for state in opt.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0  # the moments, not the step counts
    )
    pp = config["pipeline_parallel_degree"]
    stages = [model.partition_plan.stage_modules(s) for s in range(pp)] if pp > 1 else None
    return params, states, stages, losses


@pytest.mark.parametrize(
    "pp,zero,checkpointing", [(2, False, False), (2, False, True), (1, True, False)]
)
def test_a_plan_runs_as_planned(pools, pp, zero, checkpointing):
    chosen = _pick(_plans(), pp, zero, checkpointing)
    results = pools.run(2, _run_worker, chosen.config, chosen.checkpointing)
    for rank, (params, states, stages, losses) in enumerate(results):
        ledger = chosen.predicted["ledger"][rank]
        assert params == ledger["parameters"], (rank, params, ledger)
        assert states == pytest.approx(ledger["optimizer"], rel=1e-6), (rank, states, ledger)
        if pp > 1:
            assert stages == chosen.stages
        assert all(torch.isfinite(torch.tensor(losses)))
