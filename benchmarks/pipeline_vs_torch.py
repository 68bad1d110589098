"""Pipeline throughput: smp's module server against torch.distributed.pipelining.

The demo GPT (8 layers, n_embd 384, untied output head so the model is a straight chain) at
p = 2 with 8 microbatches of 4 sequences x 128 tokens, 2 gloo processes with one thread each:

  - smp: ``pipeline_parallel_degree=2``, ``microbatches=8``, "interleaved" (1F1B-like) policy;
    the partitioner places the modules; once with asynchronous cross-stage calls (the default)
    and once with ``pipeline_async_calls=False`` (every call waits for its reply);
  - torch: ``torch.distributed.pipelining`` with ``Schedule1F1B``, the model cut by hand at the
    boundary smp's partitioner chose, so both run the same stages;
  - ideal: ``m / (m + p - 1)`` of perfect scaling, computed from the measured forward + backward
    time of each stage alone (one process): samples / ((m + p - 1) x slowest stage per microbatch).

Reports samples/s, each against torch and as a fraction of the ideal.

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, timed  # noqa: E402

MICRO, SEQ, M, P = 4, 128, 8, 2
BATCH = MICRO * M


def _gpt():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, n_layer=8, n_head=6, n_embd=384))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # a straight chain
    return model


class _Stage(nn.Module):
    """Blocks [lo, hi) of the GPT, with the embeddings first or the head last."""

    def __init__(self, gpt, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.wte, self.wpe = (gpt.wte, gpt.wpe) if first else (None, None)
        self.blocks = nn.ModuleList(gpt.h[lo:hi])
        self.ln_f, self.lm_head = (gpt.ln_f, gpt.lm_head) if last else (None, None)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1)))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def _data(steps: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _boundary(rank: int, steps: int) -> int:
    """smp's partition of the model: the first block index on stage 1."""
    import smp

    smp.init({"pipeline_parallel_degree": P, "microbatches": M})
    model = smp.DistributedModel(_gpt())
    from model import lm_loss

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = _data(1)[0]
    train_step(model, x, y)
    assignment = model.partition_plan.assignment
    smp.shutdown()
    first_on_1 = min(i for i in range(8) if assignment[f"h.{i}"] == 1)
    assert all(assignment[f"h.{i}"] == (i >= first_on_1) for i in range(8)), assignment
    assert assignment["wte"] == 0 and assignment["lm_head"] == 1, assignment
    return first_on_1


def _worker(rank: int, steps: int, rounds: int, trace: str | None) -> dict:
    from model import lm_loss
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import smp

    warmup = 2
    data = _data(steps + warmup)
    cut = _boundary(rank, steps)

    def smp_runner(async_calls: bool):
        smp.init(
            {"pipeline_parallel_degree": P, "microbatches": M, "pipeline_async_calls": async_calls}
        )
        model = smp.DistributedModel(_gpt())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(model, x, y):
            loss = lm_loss(model(x), y)
            model.backward(loss)
            return loss

        def smp_step(x, y):
            opt.zero_grad()
            train_step(model, x, y)
            opt.step()

        return smp_step

    gpt = _gpt()
    stage_module = _Stage(gpt, 0 if rank == 0 else cut, cut if rank == 0 else 8, rank == 0,
                          rank == 1)  # fmt: skip
    stage = PipelineStage(stage_module, rank, P, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=lm_loss)
    torch_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    def torch_step(x, y):
        torch_opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        torch_opt.step()

    smp_s = sync_s = torch_s = float("inf")
    for _ in range(rounds):
        step = smp_runner(async_calls=False)
        sync_s = min(sync_s, timed(step, data, warmup))
        smp.shutdown()
        step = smp_runner(async_calls=True)
        smp_s = min(smp_s, timed(step, data, warmup))
        torch_s = min(torch_s, timed(torch_step, data, warmup))
        step(*data[0])
        timeline = smp.last_step_timeline()
        smp.shutdown()
    if rank == 0 and trace:
        timeline.save_chrome_trace(trace)
    return {
        "cut": cut,
        "smp_s": smp_s,
        "smp_sync_s": sync_s,
        "torch_s": torch_s,
        "smp_timeline": timeline.summary(),
    }


def _stage_times(cut: int, reps: int = 5) -> tuple[float, float, float]:
    """(stage 0, stage 1, whole-model forward) seconds per microbatch, one process."""
    from model import lm_loss

    torch.set_num_threads(1)
    gpt = _gpt()
    x, y = (t[:MICRO] for t in _data(1)[0])
    s0, s1 = _Stage(gpt, 0, cut, True, False), _Stage(gpt, cut, 8, False, True)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    h = s0(x).detach()

    def run0():
        s0(x).sum().backward()

    def run1():
        lm_loss(s1(h.requires_grad_()), y).backward()

    def forward():
        with torch.no_grad():
            gpt(x)

    return best(run0), best(run1), best(forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", help="write smp's last step as a Chrome trace (JSON) here")
    args = parser.parse_args()
    r = run_ranks(_worker, 2, args.steps, args.rounds, args.trace)
    t0, t1, fwd = _stage_times(r["cut"])
    samples = args.steps * BATCH
    ideal = samples / (args.steps * (M + P - 1) * max(t0, t1))
    smp_rate, torch_rate = samples / r["smp_s"], samples / r["torch_s"]
    sync_rate = samples / r["smp_sync_s"]
    print(f"GPT 8 layers n_embd 384 (untied head), p={P}, m={M} microbatches of {MICRO} x {SEQ} "
          f"tokens; gloo, 1 thread per process")  # fmt: skip
    print(f"stage boundary (smp's partitioner): blocks 0-{r['cut'] - 1} | {r['cut']}-7")
    print(f"one microbatch forward, whole model: {fwd * 1e3:.1f} ms; fwd+bwd per stage: "
          f"{t0 * 1e3:.1f} / {t1 * 1e3:.1f} ms")  # fmt: skip
    print(f"ideal (m/(m+p-1) from stage times)    {ideal:7.2f} samples/s")
    print(f"torch.distributed.pipelining 1F1B     {torch_rate:7.2f} samples/s   "
          f"{torch_rate / ideal:.3f} of ideal")  # fmt: skip
    print(f"smp, synchronous calls                {sync_rate:7.2f} samples/s   "
          f"{sync_rate / ideal:.3f} of ideal   {sync_rate / torch_rate:.3f}x torch")  # fmt: skip
    print(f"smp, asynchronous calls (default)     {smp_rate:7.2f} samples/s   "
          f"{smp_rate / ideal:.3f} of ideal   {smp_rate / torch_rate:.3f}x torch")  # fmt: skip
    print("smp's last step (smp.last_step_timeline()):\n" + r["smp_timeline"])
    if args.json:
        r.update(ideal=ideal, smp=smp_rate, smp_sync=sync_rate, torch=torch_rate)
        r.update(stage_s=[t0, t1], forward_s=fwd)
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
