"""A model built in bfloat16 (``smp.model_creation(dtype=torch.bfloat16)``) trains with float32
master weights held by ``smp.DistributedOptimizer``.

At pp 2 x tp 2, every rank with its own samples, against one process doing the same by hand
(the bfloat16 model's gradients copied to float32 masters, SGD with momentum on the masters,
the masters copied back): the losses, the bfloat16 parameters and the float32 masters after
3 steps, to bfloat16's tolerance. The masters survive a checkpoint bit for bit (a fresh model
and optimizer resume them, not the bfloat16-rounded parameters), and a
``model.load_state_dict`` after the optimizer was built moves the masters with it (else the
next step would undo the load).
"""

from __future__ import annotations

import copy

import torch
from models import build_model, gpt_train_step, loss_fn, make_batch, split_gpt_blocks

STEPS = 3
TOL = dict(rtol=3e-2, atol=3e-3)


def _bf16_gpt(smp):
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16):
        return build_model("gpt")


def _sgd(params):
    # Not AdamW: its per-element normalisation turns bfloat16 noise in near-zero gradients
    # into updates of +-lr, so the comparison would test Adam's conditioning, not smp.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _worker(directory: str):
    import smp
    from smp.checkpoints.keys import MASTER_KEY

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    module = _bf16_gpt(smp)
    reference = copy.deepcopy(module)
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(_sgd(model.parameters()))
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    dtypes = ({str(p.dtype) for p in model.parameters()}, {str(p.dtype) for p in masters})

    reference_masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    reference_optimizer = _sgd(reference_masters)
    train_step = gpt_train_step(smp)

    replicas = smp.dp_size()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = train_step(model, *make_batch("gpt", 4, step, seed=50 + smp.dp_rank()))
        loss = sum(smp.allgather(loss.reduce_mean().item(), smp.DP_GROUP)) / replicas
        optimizer.step()
        reference.zero_grad()
        expected = sum(
            loss_fn("gpt", reference(x), y)
            for x, y in (make_batch("gpt", 4, step, seed=50 + r) for r in range(replicas))
        )
        (expected / replicas).backward()
        for master, p in zip(reference_masters, reference.parameters()):
            master.grad = p.grad.float()
        reference_optimizer.step()
        with torch.no_grad():
            for master, p in zip(reference_masters, reference.parameters()):
                p.copy_(master)
        assert abs(loss - expected.item() / replicas) <= 3e-2 * abs(loss), (step, loss, expected)

    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, **TOL, msg=lambda m, n=name: n + m)
    full_masters = optimizer.state_dict()["state"]
    for index, master in enumerate(reference_masters):
        torch.testing.assert_close(
            full_masters[index][MASTER_KEY],
            master.detach(),
            **TOL,
            msg=lambda m, i=index: f"{i}{m}",
        )

    # A checkpoint keeps the float32 masters, not the bfloat16-rounded parameters.
    smp.save_checkpoint(directory, "bf16")
    before = {n: p.detach().clone() for n, p in _named_masters(model, optimizer)}
    fresh = smp.DistributedModel(_split(_bf16_gpt(smp), smp))
    fresh_optimizer = smp.DistributedOptimizer(_sgd(fresh.parameters()))
    smp.resume_from_checkpoint(directory)
    train_step(fresh, *make_batch("gpt", 4, 0))  # partitions; the checkpoint loads first
    after = dict(_named_masters(fresh, fresh_optimizer))
    masters_kept = all(torch.equal(after[n], v) for n, v in before.items())

    # model.load_state_dict after the optimizer exists: the masters follow the loaded weights.
    fresh.load_state_dict(full)
    follows = all(
        torch.equal(m, fresh_optimizer.model_parameter(m).float())
        for _, m in _named_masters(fresh, fresh_optimizer)
    )
    return dtypes, masters_kept, follows


def _split(module, smp):
    split_gpt_blocks(smp, module)
    return module


def _named_masters(model, optimizer):
    names = {id(p): n for n, p in model.module.named_parameters()}
    for group in optimizer.param_groups:
        for m in group["params"]:
            p = optimizer.model_parameter(m)
            if p.numel() > 0:
                yield names[id(p)], m


def test_bf16_model_with_float32_master_weights_matches_one_process(pools, tmp_path):
    for dtypes, masters_kept, follows in pools.run(4, _worker, str(tmp_path), timeout_s=300):
        assert dtypes == ({"torch.bfloat16"}, {"torch.float32"}), dtypes
        assert masters_kept
        assert follows
