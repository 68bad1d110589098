"""smp.DistributedOptimizer as SMP v1 made it: the user's optimizer itself (a torch Optimizer that
LR schedulers take), with state_dict() the full state gathered over the pipeline and
tensor-parallel groups, and load_state_dict() taking it back."""

from __future__ import annotations

import pytest
import torch
from models import build_model, gpt_train_step, loss_fn, make_batch, parity_adamw, split_gpt_blocks

from smp.checkpoints.keys import PARTIAL_KEY


def _optimizer_worker(pp: int, tp: int):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2})
    torch.manual_seed(0)
    reference = build_model("gpt")
    torch.manual_seed(0)
    module = build_model("gpt")
    if tp > 1:
        split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW) and isinstance(
        optimizer, smp.DistributedOptimizer
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference_optimizer = parity_adamw(reference.parameters())
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, 1, gamma=0.5)

    train_step = gpt_train_step(smp)

    for step in range(2):
        x, y = make_batch("gpt", 4, step)
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()
        scheduler.step()
        reference_optimizer.zero_grad()
        loss_fn("gpt", reference(x), y).backward()
        reference_optimizer.step()
        reference_scheduler.step()
    assert optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"]

    full = optimizer.state_dict()
    expected = reference_optimizer.state_dict()
    assert len(full["state"]) == len(expected["state"])  # every stage's entries, once
    shapes = sorted(tuple(p.shape) for p in reference.parameters())
    assert sorted(tuple(e["exp_avg"].shape) for e in full["state"].values()) == shapes
    if tp == 1:  # the same parameters in the same order: compare entry by entry
        for index, entry in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    full["state"][index][key], entry[key], rtol=1e-4, atol=1e-6
                )
    before = optimizer.local_state_dict()
    optimizer.load_state_dict(full)  # the full state back: each rank takes its part
    after = optimizer.local_state_dict()
    assert sorted(before["state"]) == sorted(after["state"])
    for index, entry in before["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(after["state"][index][key], value, rtol=0, atol=0)
    return len(before["state"])


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_the_optimizer_is_a_torch_optimizer_with_the_full_state(pools, pp, tp):
    locals_ = pools.run(pp * tp, _optimizer_worker, pp, tp, timeout_s=300)
    assert all(n > 0 for n in locals_), locals_


def _model_surface_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    module = build_model("gpt")
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    calls = []
    removed = model.register_post_partition_hook(lambda m, opt: calls.append("removed"))
    model.register_post_partition_hook(lambda m, opt: calls.append("kept"))
    removed.remove()
    assert model.get_module() is model.module
    modules = list(model.distributed_modules())
    assert len(modules) == len(model.distributed_modules) > 0
    assert all(
        model.get_module().get_submodule(p) is m for p, m in zip(model.distributed_modules, modules)
    )
    split = [n for n, p in model.module.named_parameters() if model.is_distributed_parameter(p)]
    assert split and not any(model.is_distributed_buffer(b) for b in model.module.buffers())

    train_step = gpt_train_step(smp)

    train_step(model, *make_batch("gpt", 4, 0))
    local = dict(model.local_named_modules())
    assert local and all(model._owns(name) for name in local)
    assert len(local) < len(dict(model.module.named_modules()))  # the other stage's are not
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree > 1"):
        model.register_comm_hook(None, lambda *a: None)

    # The scaled-batch classes: shards and replicated tensors inside the region reduce over rdp.
    names = dict(model.named_parameters())
    scaled = dict(model.scaled_batch_reducer_named_parameters())
    default = dict(model.default_reducer_named_parameters())
    assert scaled and default and set(scaled) | set(default) == set(names)
    assert not set(scaled) & set(default)
    assert all(model.is_scaled_batch_parameter(p) for p in scaled.values())
    assert not any(model.is_scaled_batch_parameter(p) for p in default.values())
    assert all(model.is_scaled_batch_parameter(names[f"module.{n}"]) for n in split)

    # A partial state dict (v1's marker) loads back on its own rank; another rank's does not.
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    partial = {k: v.clone() for k, v in model.local_state_dict().items() if k != PARTIAL_KEY}
    assert model.local_state_dict()[PARTIAL_KEY] is True
    assert optimizer.local_state_dict()[PARTIAL_KEY] is True
    with torch.no_grad():
        for p in model.local_parameters():
            p.add_(1.0)
    model.load_state_dict({**partial, PARTIAL_KEY: True})
    for key, value in model.local_state_dict().items():
        if key != PARTIAL_KEY:
            assert torch.equal(value, partial[key]), key
    parts = smp.allgather(partial, smp.PP_GROUP)
    with pytest.raises(ValueError, match="partial state dict"):
        model.load_state_dict({**parts[1 - smp.pp_rank()], PARTIAL_KEY: True})
    optimizer.load_state_dict(optimizer.local_state_dict())

    # cpu(): every stage's tensors on every rank (TP shards stay shards).
    full = model.state_dict()
    assert any(p.numel() == 0 for p in model.module.parameters())
    assert model.cpu() is model
    for name, p in model.module.named_parameters():
        assert p.numel() > 0, name
        if not model.is_distributed_parameter(p):
            assert torch.equal(p, full[name]), name
    return calls


def test_the_v1_model_surface(pools):
    """get_module, distributed_modules() (the modules, callable as in SMP v1),
    is_distributed_parameter / _buffer, local_named_modules, a removable post-partition hook,
    the scaled-batch reducers, partial state dicts with v1's marker, cpu() gathering."""
    assert pools.run(4, _model_surface_worker, timeout_s=300) == [["kept"]] * 4
