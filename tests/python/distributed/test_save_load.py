"""``smp.save`` / ``smp.load`` (SMP v1's): one file per model-parallel rank with ``partial=True``,
one file for all with ``partial=False``; writes are atomic.

At pp 2 x tp 2: every rank saves its ``local_state_dict()`` and the optimizer's (partial), rank 0
the full ``state_dict()``; after training on, loading the partial files restores each rank's
part exactly, and the full file loads into one process's plain model (torch's own
``load_state_dict``). A write that fails midway leaves the previous file whole; a missing partial
file is an error naming the rank and what to do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import build_model, gpt_train_step, make_batch, split_gpt_blocks


def _worker(directory: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    module = build_model("gpt")
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    train_step = gpt_train_step(smp)

    def train(steps: int, first: int):
        for step in range(first, first + steps):
            optimizer.zero_grad()
            train_step(model, *make_batch("gpt", 4, step))
            optimizer.step()

    train(2, 0)
    base = os.path.join(directory, "ckpt.pt")
    written = smp.save(
        {"model": model.local_state_dict(), "opt": optimizer.local_state_dict()}, base
    )
    assert written == f"{base}_{smp.mp_rank()}"
    full = model.state_dict()
    if smp.rank() == 0:
        smp.save(full, os.path.join(directory, "full.pt"), partial=False)
    smp.barrier()
    expected = {k: v.clone() for k, v in model.local_state_dict().items() if k != "_smp_is_partial"}

    train(2, 2)  # the parameters move on
    part = smp.load(base)
    model.load_state_dict(part["model"])
    optimizer.load_state_dict(part["opt"])
    for key, value in model.local_state_dict().items():
        if key != "_smp_is_partial":
            assert torch.equal(value, expected[key]), key

    # A save that fails midway leaves the previous file whole and no temporary file.
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    before = Path(written).read_bytes()
    with pytest.raises(RuntimeError, match="cannot pickle"):
        smp.save({"model": model.local_state_dict(), "bad": Unpicklable()}, base)
    assert Path(written).read_bytes() == before
    # No temporary file of this rank's write is left (each write's has a name of its own).
    assert not list(Path(directory).glob(f".{Path(written).name}.tmp*"))

    with pytest.raises(FileNotFoundError, match=f"model-parallel rank {smp.mp_rank()}"):
        smp.load(os.path.join(directory, "absent.pt"))
    return smp.mp_rank()


def test_save_and_load_partial_and_full(pools, tmp_path):
    ranks = pools.run(4, _worker, str(tmp_path), timeout_s=300)
    assert sorted(ranks) == [0, 1, 2, 3]  # one partial file per model-parallel rank
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt.pt_0", "ckpt.pt_1", "ckpt.pt_2", "ckpt.pt_3", "full.pt",
    ]  # fmt: skip
    # The full file is the plain model's: torch's own load_state_dict takes it in one process.
    reference = build_model("gpt")
    reference.load_state_dict(torch.load(tmp_path / "full.pt"))
