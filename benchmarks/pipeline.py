"""Pipeline runtime baseline: throughput at p = 2 and the cost of one cross-stage call.

1. Samples/s of the demo GPT (8 layers, n_embd 256, 32 samples of 64 tokens per step) trained
   with smp at pipeline_parallel_degree = 2, microbatches = 8 (2 gloo processes, one thread
   each), against the same model and batch in one process (one thread).
2. Round trip of one cross-stage call to a trivial module: a root on stage 0 calls a module
   pinned on stage 1 many times in an evaluation step; time per call.

    .venv/bin/python benchmarks/pipeline.py [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks  # noqa: E402

BATCH, SEQ = 32, 64


def _gpt():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, n_layer=8, n_head=4, n_embd=256))


def _data(steps: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def single_process(steps: int, warmup: int) -> float:
    from model import lm_loss

    torch.set_num_threads(1)
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data(steps + warmup)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - start)


class Trivial(nn.Module):
    def forward(self, x):
        return x


class Caller(nn.Module):
    def __init__(self, calls: int):
        super().__init__()
        self.calls = calls
        self.trivial = Trivial()

    def forward(self, x):
        for _ in range(self.calls):
            x = self.trivial(x)
        return x


def pinged_model(calls: int):
    """A Caller whose root is on stage 0 and trivial module on stage 1, wrapped (smp.init done),
    and the step function that runs it: ``ping(model, x)`` makes ``calls`` cross-stage calls."""
    import smp

    caller = Caller(calls)
    smp.set_partition(caller, 0)
    smp.set_partition(caller.trivial, 1)

    @smp.step
    def ping(model, x):
        return model(x)

    return smp.DistributedModel(caller), ping


def _worker(rank: int, steps: int, warmup: int) -> dict | None:
    from model import lm_loss

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 8})
    model = smp.DistributedModel(_gpt())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    data = _data(steps + warmup)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    dist.barrier()
    samples_per_s = steps * BATCH / (time.perf_counter() - start)
    report = model.partition_report()
    smp.shutdown()

    calls = 200
    smp.init({"pipeline_parallel_degree": 2})
    pinged, ping = pinged_model(calls)
    x = torch.zeros(1, 1)
    with torch.no_grad():
        ping(pinged, x)  # partitions
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            ping(pinged, x)
        round_trip = (time.perf_counter() - start) / (5 * calls)
    smp.shutdown()
    return {
        "pp2_samples_per_s": samples_per_s,
        "round_trip_us": round_trip * 1e6,
        "partition": report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run_ranks(_worker, 2, args.steps, args.warmup)
    result["single_samples_per_s"] = single_process(args.steps, args.warmup)
    result["ratio_pp2_over_single"] = result["pp2_samples_per_s"] / result["single_samples_per_s"]
    print(result.pop("partition"))
    print(f"GPT 8 layers n_embd 256, {BATCH} x {SEQ} tokens per step, gloo, 1 thread per process")
    print(f"one process            {result['single_samples_per_s']:8.1f} samples/s")
    print(f"smp pp=2, 8 microbatch {result['pp2_samples_per_s']:8.1f} samples/s")
    print(f"pp=2 / one process     {result['ratio_pp2_over_single']:.3f}")
    print(f"cross-stage call round trip (trivial module): {result['round_trip_us']:.0f} us")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
