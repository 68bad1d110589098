"""Data-parallel throughput: smp against torch DistributedDataParallel, same model, same run.

Two gloo processes on CPU (one thread each) train the demo GPT for the same number of steps,
first with smp (``microbatches=1``: smp's bucketed all-reduce after the step) and then with DDP
(overlapping bucketed all-reduce during backward), and report samples/s and the ratio.

    .venv/bin/python benchmarks/data_parallel.py [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, timed  # noqa: E402


def _model(seed: int):
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128))


def _batches(steps: int, batch: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, 256, (steps, batch, 65), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _worker(rank: int, world: int, steps: int, batch: int, rounds: int) -> dict | None:
    from model import lm_loss

    import smp

    warmup = 3
    batches = _batches(steps + warmup, batch, rank)

    smp.init({"microbatches": 1})
    model = smp.DistributedModel(_model(0))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    def smp_step(x, y):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()

    ddp = torch.nn.parallel.DistributedDataParallel(_model(0))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def ddp_step(x, y):
        ddp_opt.zero_grad()
        lm_loss(ddp(x), y).backward()
        ddp_opt.step()

    # Alternate the two, best of `rounds` each, so drift in machine load hits both alike.
    smp_seconds = ddp_seconds = float("inf")
    for _ in range(rounds):
        smp_seconds = min(smp_seconds, timed(smp_step, batches, warmup))
        ddp_seconds = min(ddp_seconds, timed(ddp_step, batches, warmup))
    smp.shutdown()
    samples = steps * batch * world
    return {"smp_samples_per_s": samples / smp_seconds, "ddp_samples_per_s": samples / ddp_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run_ranks(_worker, 2, 2, args.steps, args.batch, args.rounds)
    result["ratio_smp_over_ddp"] = result["smp_samples_per_s"] / result["ddp_samples_per_s"]
    print(f"world 2 (gloo, CPU, 1 thread each), GPT 0.8M params, {args.batch} samples/rank/step")
    print(f"smp  {result['smp_samples_per_s']:8.1f} samples/s")
    print(f"DDP  {result['ddp_samples_per_s']:8.1f} samples/s")
    print(f"smp / DDP = {result['ratio_smp_over_ddp']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
