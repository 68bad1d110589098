"""A plan runs as planned: ``smp.init(plan.config)`` starts it, smp partitions the model as the
planner priced it, and each rank holds the parameters and optimizer state its ledger predicts
(design.md §13.3)."""

from __future__ import annotations

import pytest
import torch
from models import build_model, gpt_train_step, lm_loss, make_batch, step_peak

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


def _pick(plans, pp: int, zero: bool, checkpointing: bool, tp: int = 1):
    for p in plans:
        c = p.config
        if (
            c["pipeline_parallel_degree"] == pp
            and c["tensor_parallel_degree"] == tp
            and c.get("shard_optimizer_state", False) == zero
            and bool(p.checkpointing) == checkpointing
            and c.get("pipeline_schedule") in (None, "1f1b")
        ):
            return p
    raise AssertionError(
        f"no plan with pp {pp}, tp {tp}, ZeRO-1 {zero}, checkpointing {checkpointing}"
    )


def _shard(x, y):
    """This replica's part of the batch: the TP ranks of a replica share theirs
    (``prescaled_batch``, which tensor-parallel plans set)."""
    if smp.state.get_state().config.prescaled_batch:
        size, rank = smp.rdp_size(), smp.rdp_rank()
    else:
        size, rank = smp.dp_size(), smp.dp_rank()
    return x.chunk(size)[rank], y.chunk(size)[rank]


def _start(chosen, module):
    """``module`` trained as ``chosen`` plans: smp initialised with its config, the model
    prepared by ``apply``, wrapped, with AdamW and the GPT's training step."""
    smp.init(chosen.config)
    chosen.apply(module)  # tensor parallelism and checkpointing as planned
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, opt, gpt_train_step(smp)


def _run_worker(chosen):
    torch.manual_seed(0)
    model, opt, train_step = _start(chosen, build_model("gpt"))
    losses = []
    for i in range(2):
        x, y = _shard(*make_batch("gpt", 8, i))
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
    pp = chosen.config["pipeline_parallel_degree"]
    stages = [model.partition_plan.stage_modules(s) for s in range(pp)] if pp > 1 else None
    return params, states, stages, losses


@pytest.mark.parametrize(
    "pp,zero,checkpointing,tp",
    [(2, False, False, 1), (2, False, True, 1), (1, True, False, 1), (1, False, False, 2)],
)
def test_a_plan_runs_as_planned(pools, pp, zero, checkpointing, tp):
    chosen = _pick(_plans(), pp, zero, checkpointing, tp)
    results = pools.run(2, _run_worker, chosen)
    for rank, (params, states, stages, losses) in enumerate(results):
        ledger = chosen.predicted["ledger"][rank]
        assert params == ledger["parameters"], (rank, params, ledger)
        assert states == pytest.approx(ledger["optimizer"], rel=1e-6), (rank, states, ledger)
        if pp > 1:
            assert stages == chosen.stages
        assert all(torch.isfinite(torch.tensor(losses)))


def _gpt4():
    from model import GPT, GPTConfig

    return GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=4, n_head=4, n_embd=128))


def _peak_worker(chosen, batch):
    torch.manual_seed(0)
    module = _gpt4()
    model, opt, train_step = _start(chosen, module)

    g = torch.Generator().manual_seed(smp.rdp_rank())  # each replica its own data
    x, y = (torch.randint(0, 512, (batch, 128), generator=g) for _ in range(2))
    return step_peak(model, module, opt, train_step, x, y)[0]


# (pp, sharding, microbatch size, pipeline schedule, checkpointing, tp): layouts whose peaks the
# first ledgers under-predicted (sdp accumulating, the dynamic pipeline's stage 1, weight
# gradients kept apart with checkpointing), and plain ones.
_LAYOUTS = [
    (1, "zero", 8, None, False, 1),
    (1, "sdp", 2, None, False, 1),
    (1, "sdp", 2, None, True, 1),
    (2, "none", 8, None, False, 1),
    (2, "none", 8, None, True, 1),
    (2, "none", 2, "1f1b", True, 1),
    (2, "none", 2, "gpipe", False, 1),
    (1, "none", 8, None, False, 2),
    (1, "none", 2, None, True, 2),
]


@pytest.mark.parametrize("layout", _LAYOUTS, ids=lambda layout: "-".join(map(str, layout)))
def test_no_rank_holds_more_than_its_ledger(pools, layout):
    pp, sharding, size, schedule, checkpointing, tp = layout
    x, y = (torch.randint(0, 512, (2, 128)) for _ in range(2))
    plans = smp.plan(
        _gpt4(), (x,), _CLUSTER, 16, num_devices=2, device="cpu",
        run=lambda m, ids: lm_loss(m(ids), y), max_plans=1000,
    )  # fmt: skip

    def matches(p):
        c = p.config
        shard = (
            "sdp"
            if c.get("sharded_data_parallel_degree", 1) > 1
            else ("zero" if c.get("shard_optimizer_state") else "none")
        )
        return (
            c["pipeline_parallel_degree"] == pp
            and c["tensor_parallel_degree"] == tp
            and shard == sharding
            and p.predicted["microbatch_size"] == size
            and c.get("pipeline_schedule") == schedule
            and bool(p.checkpointing) == checkpointing
        )

    chosen = next(p for p in plans if matches(p))
    batch = 16 // chosen.predicted["data_parallel_degree"]  # per replica
    peaks = pools.run(2, _peak_worker, chosen, batch)
    for rank, peak in enumerate(peaks):
        ledger = chosen.predicted["ledger"][rank]
        predicted = ledger["total"] - ledger["reserved"]  # tensors only: the tracker's view
        assert peak <= predicted, (rank, peak, ledger)
