"""Tests of smp._C.allreduce_mean_ over real gloo process groups.

What C++'s grad_reduce_test cannot check (it has no gloo, see the note there): that a Python
``torch.distributed.ProcessGroup`` crosses into C++ (the default group and ``dist.new_group``),
that the result matches ``dist.all_reduce`` on gloo, and that the GIL is released while waiting.

Which ``_C`` is tested: if the environment variable ``SMP_C_PATH`` names a directory, the
``_C*.so`` in it is loaded by path, without importing the ``smp`` package (an explicit path wins
over whatever ``smp._C`` is importable, e.g. a stale in-tree build); otherwise ``smp._C``.

    SMP_C_PATH=build-helper-comm/pkg python -m pytest tests/python/unit/test_grad_reduce.py -q
"""

from __future__ import annotations

import datetime
import glob
import importlib.util
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TIMEOUT = datetime.timedelta(seconds=60)  # a hang fails the test instead of blocking the suite


def _load_c():
    path = os.environ.get("SMP_C_PATH")
    if not path:
        from smp import _C

        return _C
    candidates = sorted(glob.glob(os.path.join(path, "_C*.so")))
    if not candidates:
        raise ImportError(f"SMP_C_PATH={path!r} holds no _C*.so")
    # The spec's last name component must be "_C": it selects the PyInit__C entry point.
    spec = importlib.util.spec_from_file_location("smp._C", candidates[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_C = _load_c()


def _tensors(rank: int) -> list[torch.Tensor]:
    """Mixed dtypes and sizes around a 64-byte bucket; tensor i on rank r is (i + 1) * arange + r.

    Bytes: 0: f32 32, 1: f64 32, 2: f32 64 (fills a bucket), 3: f32 68 and 4: f64 72 (over a
    bucket: their own), 5: f32 16, 6: f64 0 (skipped), 7: f64 16, 8: f32 4 (0-dim).
    With 64-byte buckets: {0} {1, 7} {2} {3} {4} {5, 8}, i.e. 6 collectives.
    """
    specs = [
        ((2, 4), torch.float32), ((4,), torch.float64), ((4, 4), torch.float32),
        ((17,), torch.float32), ((3, 3), torch.float64), ((2, 2), torch.float32),
        ((0,), torch.float64), ((2,), torch.float64), ((), torch.float32),
    ]  # fmt: skip
    out = []
    for i, (shape, dtype) in enumerate(specs):
        numel = 1 if shape == () else int(torch.Size(shape).numel())
        out.append((torch.arange(numel, dtype=dtype) * (i + 1)).reshape(shape) + rank)
    return out


_NUM_COLLECTIVES_64 = 6  # for _tensors with bucket_bytes=64, see its docstring


# ---- one process, world size 1 -----------------------------------------------------------


@pytest.fixture
def world_of_one():
    """A gloo default group of one rank in this process, destroyed after the test."""
    assert not dist.is_initialized(), "a previous test leaked a process group"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=_TIMEOUT)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


def test_default_group_of_one_only_divides(world_of_one):
    tensors = _tensors(0)
    expected = [t / 4.0 for t in tensors]
    storages = [t.data_ptr() for t in tensors]
    assert _C.allreduce_mean_(tensors, world_of_one, 4.0, 64) == 0  # nothing to communicate
    for got, want, ptr in zip(tensors, expected, storages):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.data_ptr() == ptr  # in place


def test_new_group_of_one(world_of_one):
    group = dist.new_group([0])
    tensors = [torch.full((3,), 6.0), torch.full((2, 2), 3.0, dtype=torch.float64)]
    assert _C.allreduce_mean_(tensors, group, 3.0, 1 << 20) == 0
    torch.testing.assert_close(tensors[0], torch.full((3,), 2.0))
    torch.testing.assert_close(tensors[1], torch.full((2, 2), 1.0, dtype=torch.float64))


def test_empty_list(world_of_one):
    assert _C.allreduce_mean_([], world_of_one, 1.0, 64) == 0


@pytest.mark.parametrize(
    ("tensors", "divisor", "bucket_bytes", "parts"),
    [
        ([torch.ones(2)], 0.0, 64, ["divisor", "> 0"]),
        ([torch.ones(2)], -1.0, 64, ["divisor"]),
        ([torch.ones(2)], float("nan"), 64, ["divisor"]),
        ([torch.ones(2)], 1.0, 0, ["bucket_bytes", "got 0"]),
        ([torch.ones(2)], 1.0, -8, ["bucket_bytes", "got -8"]),
        (
            [torch.ones(2), torch.ones(3, 4, dtype=torch.float64).t()],
            1.0, 64, ["tensor 1", "[4, 3]", "Double", "not contiguous"],
        ),
        ([torch.ones(2), torch.ones(2, 3).to_sparse()], 1.0, 64, ["tensor 1", "[2, 3]", "Sparse"]),
        ([torch.ones(5, dtype=torch.int64)], 1.0, 64, ["tensor 0", "[5]", "Long"]),
    ],
)  # fmt: skip
def test_user_mistakes_raise_value_error(world_of_one, tensors, divisor, bucket_bytes, parts):
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError) as info:
        _C.allreduce_mean_(tensors, world_of_one, divisor, bucket_bytes)
    for part in parts:
        assert part in str(info.value)
    for t, b in zip(tensors, before):  # checked before anything is touched
        assert torch.equal(t.to_dense(), b.to_dense())


def test_group_must_be_a_process_group(world_of_one):
    with pytest.raises(TypeError):
        _C.allreduce_mean_([torch.ones(2)], "world", 1.0, 64)


# ---- two processes ----------------------------------------------------------------------


def _two_rank_worker(rank: int, world_size: int, store_path: str) -> None:
    """Runs in a spawned process; an exception here fails the parent's mp.spawn."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    try:
        default_group = dist.distributed_c10d._get_default_group()
        sub_group = dist.new_group(list(range(world_size)))
        for group, divisor, bucket_bytes, num_collectives in [
            (default_group, float(world_size), 64, _NUM_COLLECTIVES_64),  # a true mean
            (sub_group, 2.5, 64, _NUM_COLLECTIVES_64),
            (sub_group, 1.0, 1 << 20, 2),  # one bucket per dtype
            (default_group, 3.0, 1, 8),  # one bucket per non-empty tensor
        ]:
            tensors = _tensors(rank)
            # Reference: torch's own all_reduce, one tensor at a time, then the division.
            expected = [t.clone() for t in tensors]
            for t in expected:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                t.div_(divisor)
            got = _C.allreduce_mean_(tensors, group, divisor, bucket_bytes)
            assert got == num_collectives, (rank, bucket_bytes, got)
            for i, (t, e) in enumerate(zip(tensors, expected)):
                torch.testing.assert_close(t, e, msg=lambda m, i=i: f"rank {rank} tensor {i}: {m}")

        # The GIL is released while C++ waits: rank 1 joins the collective late, and meanwhile
        # rank 0's main thread keeps running Python. (With the GIL held, gloo collectives already
        # time out in the loop above; this also covers a backend where they would not.)
        tensors = [torch.full((4,), float(rank + 1))]
        if rank == 0:
            result = {}
            worker = threading.Thread(
                target=lambda: result.update(n=_C.allreduce_mean_(tensors, default_group, 2.0, 64))
            )
            worker.start()
            ticks = 0
            while worker.is_alive():
                ticks += 1
                time.sleep(0.001)
            worker.join()
            assert result["n"] == 1
            assert ticks > 50, f"main thread starved while waiting ({ticks} ticks): GIL held?"
        else:
            time.sleep(1.0)
            assert _C.allreduce_mean_(tensors, default_group, 2.0, 64) == 1
        torch.testing.assert_close(tensors[0], torch.full((4,), 1.5))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_processes_match_dist_all_reduce(tmp_path):
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
