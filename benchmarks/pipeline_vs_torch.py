"""Pipeline throughput: smp's module server against torch.distributed.pipelining.

The demo GPT (8 layers, n_embd 384, untied output head so the model is a straight chain) at
p = 2 (or ``--stages 4``) with 8 microbatches of 4 sequences x 128 tokens, one gloo process per
stage with one thread each:

  - smp: ``pipeline_parallel_degree=2``, ``microbatches=8``, "interleaved" (1F1B-like) policy;
    the partitioner places the modules; with its defaults (asynchronous cross-stage calls, and
    weight gradients apart from input gradients on the later stages: a zero-bubble split),
    without the split (``deferred_weight_microbatches=0``), with
    ``pipeline_async_calls=False`` too (every call waits for its reply), and with the
    "static" policy ordering each stage's work by its program in the IR's 1F1B and ZB-H1
    schedules;
  - torch: ``torch.distributed.pipelining`` with ``Schedule1F1B``, the model cut by hand at the
    boundaries smp's partitioner chose, so both run the same stages;
  - ideal: ``m / (m + p - 1)`` of perfect scaling, computed from the forward + backward time of
    each stage alone (no communication; median of 2m microbatches), measured in every round,
    after torch's run, by every rank at once, as the stages run in the pipeline:
    samples / ((m + p - 1) x slowest stage per microbatch). With more processes than cores
    (p = 4 here on 2 cores) the ranks take turns, the stages share cores in the pipeline and
    nobody reaches it; the ratio to torch is the comparison that means something then.

Reports samples/s (best round), and, round by round, each run as a fraction of that round's
ideal and smp's against torch (a round runs every variant, then torch, then times the stages
alone, so it compares runs seconds apart on a machine whose speed drifts: the medians of those
are the numbers to go by); then what each stage's pieces cost per microbatch inside the
pipeline in both libraries (smp's from its last step's timeline, torch's from timing its
stage's forward and backward chunks), and, when every stage has a core, how long each
library's pieces would take in other orders with communication free (the schedule IR's
simulator with costs per stage): the order smp ran them in, and static 1F1B and ZB-H1
programs. A step close to the best order leaves nothing for a static schedule to gain; the
rest is the pieces' own cost.

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--stages 2] [--steps 6] [--rounds 3]
        [--json out.json] [--trace step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from _launch import output_loss, run_ranks, smp_training, timed  # noqa: E402

MICRO, SEQ, M = 4, 128, 8
# smp's variants, in the order each round runs them (config options; row labels below, with
# torch's).
VARIANTS = {
    "sync": {"pipeline_async_calls": False, "deferred_weight_microbatches": 0},
    "no_split": {"deferred_weight_microbatches": 0},
    "static_1f1b": {"pipeline": "static", "pipeline_schedule": "1f1b"},
    "static_zbh1": {"pipeline": "static", "pipeline_schedule": "zbh1"},
    "default": {},
}
LABELS = {
    "sync": "smp, synchronous calls, no split",
    "no_split": "smp, async calls, no split",
    "static_1f1b": "smp, static 1F1B program",
    "static_zbh1": "smp, static ZB-H1 program",
    "default": "smp, default (async, split)",
    "torch": "torch.distributed.pipelining 1F1B",
}
BATCH = MICRO * M
LAYERS, N_EMBD = 8, 384


def _core_per_stage(p: int) -> bool:
    """Whether every stage's process can have a core of its own."""
    return p <= (os.cpu_count() or 1)


def _gpt():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=SEQ, n_layer=LAYERS, n_head=6, n_embd=N_EMBD))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # a straight chain
    return model


class _Stage(nn.Module):
    """Blocks [lo, hi) of the GPT, with the embeddings first and the head last."""

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


def _cuts(p: int) -> list[int]:
    """smp's partition of the model: the first block index of each stage (and LAYERS)."""
    import smp

    smp.init({"pipeline_parallel_degree": p, "microbatches": M})
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
    stages = [assignment[f"h.{i}"] for i in range(LAYERS)]
    assert stages == sorted(stages) and set(stages) == set(range(p)), assignment
    assert assignment["wte"] == 0 and assignment["lm_head"] == p - 1, assignment
    return [stages.index(s) for s in range(p)] + [LAYERS]


def _worker(rank: int, p: int, steps: int, rounds: int, trace: str | None) -> dict:
    from model import lm_loss
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import smp

    warmup = 2
    data = _data(steps + warmup)
    cuts = _cuts(p)

    def smp_runner(options: dict):
        smp.init({"pipeline_parallel_degree": p, "microbatches": M, **options})
        return smp_training(_gpt(), output_loss(lm_loss), 1e-4)[1]

    gpt = _gpt()
    stage_module = _Stage(gpt, cuts[rank], cuts[rank + 1], rank == 0, rank == p - 1)
    stage = PipelineStage(stage_module, rank, p, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=lm_loss)
    torch_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    # Per torch step: seconds in forward and backward chunks (the pieces), and in schedule.step.
    torch_pieces: list[dict[str, float]] = []

    def timed_chunks(kind: str, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                torch_pieces[-1][kind] += time.perf_counter() - start

        return run

    stage.forward_one_chunk = timed_chunks("F", stage.forward_one_chunk)
    stage.backward_one_chunk = timed_chunks("B", stage.backward_one_chunk)

    def torch_step(x, y):
        torch_opt.zero_grad()
        torch_pieces.append({"F": 0.0, "B": 0.0, "span": 0.0})
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        torch_pieces[-1]["span"] = time.perf_counter() - start
        torch_opt.step()

    best = {name: float("inf") for name in (*VARIANTS, "torch")}
    rounds_s: dict[str, list[float]] = {name: [] for name in best}  # every round's seconds
    alone_s: list[float] = []  # this stage's fwd+bwd per microbatch alone, round by round
    for _ in range(rounds):
        del torch_pieces[:]  # the last round's steps are kept
        for name, options in VARIANTS.items():  # the default last: its timeline is kept
            step = smp_runner(options)
            rounds_s[name].append(timed(step, data, warmup))
            best[name] = min(best[name], rounds_s[name][-1])
            if name != "default":
                smp.shutdown()
        rounds_s["torch"].append(timed(torch_step, data, warmup))
        best["torch"] = min(best["torch"], rounds_s["torch"][-1])
        alone_s.append(_stage_alone(stage_module, rank, p, data[0]))
        step(*data[0])
        timeline = smp.last_step_timeline()
        smp.shutdown()
    if rank == 0 and trace:
        timeline.save_chrome_trace(trace)
    costs = [
        (c.forward, c.full_backward, c.backward_input, c.backward_weight)
        for c in timeline.stage_costs()
    ]
    recorded = [[str(a) for a in program] for program in timeline.to_schedule()]
    steps_of_torch = [None] * p  # every stage's torch pieces, step by step
    dist.all_gather_object(steps_of_torch, torch_pieces[warmup:])
    stages_alone = [None] * p  # [stage][round]
    dist.all_gather_object(stages_alone, alone_s)
    return {
        "cuts": cuts,
        "seconds": best,
        "rounds_seconds": rounds_s,
        "smp_timeline": timeline.summary(),
        "smp_span_s": timeline.end - timeline.start,
        "smp_pieces": max(len(acts) for acts in timeline.ranks.values()),
        "smp_stage_costs": costs,
        "smp_schedule": recorded,
        "torch_pieces": steps_of_torch,
        "stages_alone_s": [list(r) for r in zip(*stages_alone)],  # [round][stage]
    }


def _stage_alone(module: nn.Module, rank: int, p: int, batch, pieces: int = 2 * M) -> float:
    """Median seconds of one microbatch's forward + backward of this rank's stage alone, no
    communication: ``pieces`` of them, after one to warm up. With a core per stage every rank
    measures at once, as the stages run in the pipeline (sharing the memory system); otherwise
    the ranks take turns."""
    from model import lm_loss

    x, y = (t[:MICRO] for t in batch)
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(MICRO, SEQ, N_EMBD, generator=g)
    times = []

    def measure():
        for i in range(pieces + 1):
            start = time.perf_counter()
            h = x if rank == 0 else hidden.clone().requires_grad_()
            out = module(h)
            (lm_loss(out, y) if rank == p - 1 else out.sum()).backward()
            if i:
                times.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)

    concurrent = _core_per_stage(p)
    for turn in range(1 if concurrent else p):
        dist.barrier()
        if concurrent or turn == rank:
            measure()
    dist.barrier()
    return statistics.median(times)


def _torch_costs(r: dict) -> tuple[list[tuple[float, float]], float]:
    """torch's pieces: per stage (forward, backward) seconds per microbatch, and the seconds of
    its schedule.step (the slowest stage's), each the median over the last round's steps."""
    median = statistics.median
    per_stage = [
        tuple(median([step[k] / M for step in steps]) for k in "FB") for steps in r["torch_pieces"]
    ]
    spans = [
        max(stage[i]["span"] for stage in r["torch_pieces"])
        for i in range(len(r["torch_pieces"][0]))
    ]
    return per_stage, median(spans)


def _orders(
    r: dict, p: int, torch_stage: list[tuple[float, float]], torch_span: float
) -> dict[str, tuple[float, float | None]]:
    """Seconds each library's pieces (per-stage costs per microbatch) would take in other
    orders, communication free, against what the step took: smp's from its last step's
    timeline, torch's from its chunks; the order smp ran them in, and static 1F1B and ZB-H1
    programs (torch's backward is not split, so no ZB-H1 for it). ``torch_stage`` and
    ``torch_span``: :func:`_torch_costs`."""
    from smp import _C

    ir = _C.schedule
    smp_costs = [
        ir.ActionCosts(forward=f, full_backward=b, backward_input=i, backward_weight=w)
        for f, b, i, w in r["smp_stage_costs"]
    ]
    torch_costs = [ir.ActionCosts(forward=f, full_backward=b) for f, b in torch_stage]
    recorded = [[ir.parse_action(a) for a in program] for program in r["smp_schedule"]]
    one_f_one_b = ir.one_f_one_b(p, M)
    return {
        "as run (the step's span)": (r["smp_span_s"], torch_span),
        "smp's order, replayed": (ir.simulate(recorded, smp_costs).makespan, None),
        "static 1F1B": (
            ir.simulate(one_f_one_b, smp_costs).makespan,
            ir.simulate(one_f_one_b, torch_costs).makespan,
        ),
        "static ZB-H1": (ir.simulate(ir.zero_bubble_h1(p, M), smp_costs).makespan, None),
    }


def _forward_time(reps: int = 5) -> float:
    """Seconds of one microbatch's forward of the whole model, one process (best of ``reps``)."""
    torch.set_num_threads(1)
    gpt = _gpt()
    x = _data(1)[0][0][:MICRO]
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            start = time.perf_counter()
            gpt(x)
            times.append(time.perf_counter() - start)
    return min(times[1:])


def _recording_cost(n: int = 100_000) -> float:
    """Seconds the runtime's timeline recorder spends per piece (one begin and one end)."""
    from smp.pipeline.workers import _Recorder

    recorder = _Recorder()
    start = time.perf_counter()
    for _ in range(n):
        recorder.begin("F", 0)
        recorder.end()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2, choices=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", help="write smp's last step as a Chrome trace (JSON) here")
    args = parser.parse_args()
    p = args.stages
    r = run_ranks(_worker, p, p, args.steps, args.rounds, args.trace)
    fwd = _forward_time()
    samples = args.steps * BATCH
    rate = {name: samples / seconds for name, seconds in r["seconds"].items()}
    rounds = r["rounds_seconds"]
    # Each round's ideal: from the stage times measured alone in that round (the machine's speed
    # drifts, so a round's runs are compared with the stage times of the same minutes).
    ideal = [samples / (args.steps * (M + p - 1) * max(alone)) for alone in r["stages_alone_s"]]
    of_ideal = {
        name: [samples / t / i for t, i in zip(rounds[name], ideal)]
        for name in ("torch", *VARIANTS)
    }
    # Rounds alternate the libraries, so a round's ratio compares runs a few seconds apart.
    x_torch = {name: [t / s for t, s in zip(rounds["torch"], rounds[name])] for name in VARIANTS}
    cuts = r["cuts"]
    print(f"GPT 8 layers n_embd 384 (untied head), p={p}, m={M} microbatches of {MICRO} x {SEQ} "
          f"tokens; gloo, 1 thread per process")  # fmt: skip
    blocks = " | ".join(f"{cuts[i]}-{cuts[i + 1] - 1}" for i in range(p))
    print(f"stage boundaries (smp's partitioner): blocks {blocks}")
    print(f"one microbatch forward, whole model: {fwd * 1e3:.1f} ms")
    alone = "   ".join(" / ".join(f"{t * 1e3:.1f}" for t in rnd) for rnd in r["stages_alone_s"])
    how = "all stages at once" if _core_per_stage(p) else "one stage at a time"
    print(f"fwd+bwd per microbatch of each stage alone ({how}), ms, round by round: {alone}")
    print("ideal (m/(m+p-1) from those), samples/s, round by round: "
          + " ".join(f"{i:.2f}" for i in ideal))  # fmt: skip
    median = statistics.median
    print(f"{'':38s}{'samples/s':>10s}{'of ideal':>10s}{'x torch':>9s}   (best round; medians of "
          "the rounds' ratios)")  # fmt: skip
    for name in ("torch", *VARIANTS):
        ratio = f"{median(x_torch[name]):9.3f}" if name != "torch" else f"{'':9s}"
        print(f"{LABELS[name]:38s}{rate[name]:10.2f}{median(of_ideal[name]):10.3f}{ratio}")
    print("round by round (each round runs every variant, then torch, then the stages alone):")
    for name in ("torch", *VARIANTS):
        against = " ".join(f"{x:.3f}" for x in x_torch[name]) if name != "torch" else ""
        print(f"  {LABELS[name]:36s}of ideal " + " ".join(f"{x:.3f}" for x in of_ideal[name])
              + (f"   x torch {against}" if against else ""))  # fmt: skip
    print("smp's last step (smp.last_step_timeline()):\n" + r["smp_timeline"])
    per_piece = _recording_cost()
    print(f"  recording it: {per_piece * 1e6:.2f} us per piece x {r['smp_pieces']} pieces on the "
          f"busiest rank = {100 * per_piece * r['smp_pieces'] / r['smp_span_s']:.4f} % of the "
          "step")  # fmt: skip
    print("per microbatch in the pipeline, ms (smp: that step; torch: median step):")
    torch_stage, torch_span = _torch_costs(r)
    for stage, ((f, b, i, w), (tf, tb)) in enumerate(zip(r["smp_stage_costs"], torch_stage)):
        split = f" (split ones: input {i * 1e3:.1f} + weight {w * 1e3:.1f})" if w else ""
        print(f"  stage {stage}  forward smp {f * 1e3:6.1f} torch {tf * 1e3:6.1f}  backward smp "
              f"{b * 1e3:6.1f} torch {tb * 1e3:6.1f}  sum smp / torch "
              f"{(f + b) / (tf + tb):.3f}{split}")  # fmt: skip
    orders = {}
    if _core_per_stage(p):
        print("each library's pieces in other orders, ms (simulated from those costs, "
              "communication free):")  # fmt: skip
        orders = _orders(r, p, torch_stage, torch_span)
        print(f"  {'':26s}{'smp':>8s}{'torch':>9s}")
        for name, (mine, theirs) in orders.items():
            theirs_text = f"{theirs * 1e3:9.1f}" if theirs is not None else f"{'-':>9s}"
            print(f"  {name:26s}{mine * 1e3:8.1f}{theirs_text}")
    if args.json:
        r.update(ideal=ideal, rates=rate, of_ideal=of_ideal, forward_s=fwd, orders=orders)
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
