"""Memory over a long pipelined run: does anything grow with the steps (design.md §4.7)?

The demo's GPT (4 layers, hidden 128) trains for 1,000 steps at pp = 2 on two gloo processes,
2 microbatches of 4 sequences, with a different sequence length every step (8 to 64 tokens, so
every step's activations have new shapes). After every step each rank reads its resident set
size; the report compares the peak over steps 100-200 with the peak over the last 100 steps
(flat: within 2 %), and shows the runtime's call-structure caches at the end.

    .venv/bin/python benchmarks/memory_soak.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_ranks  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def _soak(rank: int, steps: int) -> list:
    import torch.nn.functional as F
    from model import GPT, GPTConfig

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(GPTConfig(block_size=64, n_layer=4, n_embd=128, n_head=4)))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, idx, target):
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    lengths = torch.Generator().manual_seed(1)
    rss = []
    for step in range(steps):
        seq = int(torch.randint(8, 65, (1,), generator=lengths))
        idx = torch.randint(0, 256, (8, seq + 1))
        optimizer.zero_grad()
        train_step(model, idx[:, :-1], idx[:, 1:])
        optimizer.step()
        rss.append(_rss_mb())
        if rank == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: rss {rss[-1]:.1f} MB", flush=True)
    timeline = smp.last_step_timeline()
    everyone = smp.allgather(rss)
    summary = timeline.summary()
    smp.shutdown()
    return [everyone, summary]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    if args.steps < 300:
        parser.error(
            "--steps must be at least 300 (the windows are steps 100-200 and the last 100)"
        )
    everyone, summary = run_ranks(_soak, 2, args.steps)
    print(f"{args.steps} steps, pp 2, sequence length 8-64 varying every step")
    print("rank | peak RSS steps 100-200 | peak RSS last 100 | ratio")
    for rank, rss in enumerate(everyone):
        early, late = max(rss[100:200]), max(rss[-100:])
        print(f"{rank:4} | {early:18.1f} MB | {late:13.1f} MB | {late / early:.4f}")
    print(summary)


if __name__ == "__main__":
    main()
