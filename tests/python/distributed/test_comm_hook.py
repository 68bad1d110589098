"""``model.register_comm_hook``: gradients reduced by the user's hook (SMP v1's, DDP's API).

torch's own ``allreduce_hook`` on smp's dp group with one microbatch, and a hook that also
averages over microbatches at pp 2 x dp 2, give what smp's own reduction gives; a hook is
called per bucket, with DDP's bucket methods; bad hooks and tensor parallelism fail clearly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from models import build_model, gpt_train_step, make_batch, split_gpt_blocks


def _train(smp, pp: int, hook=None, bucket_cap_mb: float = 25) -> tuple[dict, list]:
    torch.manual_seed(0)
    module = build_model("gpt")
    if pp > 1:
        split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module, bucket_cap_mb=bucket_cap_mb)
    calls: list = []
    if hook is not None:
        model.register_comm_hook(smp.get_dp_process_group(), hook(calls))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    train_step = gpt_train_step(smp)

    for step in range(2):
        optimizer.zero_grad()
        train_step(model, *make_batch("gpt", 4, step, seed=7 + smp.dp_rank()))
        optimizer.step()
    return model.state_dict(), calls


def _torch_hook_worker():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import smp

    smp.init({"microbatches": 1})
    expected, _ = _train(smp, 1)

    def counting(calls):
        def hook(state, bucket):
            calls.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
            assert sum(g.numel() for g in bucket.gradients()) == bucket.buffer().numel()
            return allreduce_hook(state, bucket)

        return hook

    got, calls = _train(smp, 1, counting, bucket_cap_mb=0.01)  # small buckets: several
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    return calls


def test_torchs_allreduce_hook_gives_smps_reduction(pools):
    for calls in pools.run(2, _torch_hook_worker, timeout_s=120):
        steps = [c for c in calls if c[0] == 0]
        assert len(steps) == 2 and len(calls) > 2, calls  # several buckets per step
        assert [c[1] for c in calls].count(True) == 2


def _averaging_hook(calls):
    import smp

    def hook(group, bucket):
        calls.append(bucket.index())
        buffer = bucket.buffer().div_(smp.dp_size() * smp.num_microbatches())
        return dist.all_reduce(buffer, group=group, async_op=True).get_future()

    return hook


def _pipelined_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    expected, _ = _train(smp, 2)
    got, calls = _train(smp, 2, _averaging_hook)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    return len(calls)


def test_a_hook_at_pp2_dp2(pools):
    assert all(n >= 2 for n in pools.run(4, _pipelined_worker, timeout_s=300))


def _bad_hooks_worker():
    import smp

    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    with pytest.raises(NotImplementedError, match="tensor_parallel_degree > 1"):
        model.register_comm_hook(None, lambda s, b: None)
    smp.shutdown()
    smp.init({})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="must be callable"):
        model.register_comm_hook(None, 3)
    model.register_comm_hook(None, lambda s, b: b.buffer())  # not a future

    @smp.step
    def train_step(model, x):
        model.backward(model(x).sum())

    with pytest.raises(TypeError, match="must return a torch.futures.Future"):
        train_step(model, torch.ones(2, 4))
    return True


def test_bad_hooks_fail_clearly(pools):
    assert pools.run(2, _bad_hooks_worker, timeout_s=120) == [True, True]
