"""Data-parallel throughput: smp against torch DistributedDataParallel, same model, same run.

Two gloo processes on CPU (one thread each) train the demo GPT for the same number of steps with
smp (``microbatches=1``; buckets reduced during the backward, as they become final), smp with
``overlapping_allreduce=False`` (all buckets after the step) and DDP (buckets during the
backward), alternating the three each round. Prints every round and the medians; each ratio is
the median of the per-round ratios.

    .venv/bin/python benchmarks/data_parallel.py [--steps 30] [--rounds 5] [--json out.json]

``--pp 2``: pipeline stages reduced over their replicas (design.md §2, per stage): four
processes (pp 2 x dp 2, 4 microbatches), smp as it is by default (each stage's buckets during its
backward), with ``overlapping_allreduce=False`` (``allreduce_mean_`` after the step), and with
the same bucket plan issued after the step (as before the per-stage overlap). No peer runs there:
torch has no pipeline that takes this model unchanged with DDP over its stages.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import output_loss, run_ranks, smp_training, timed  # noqa: E402


def _model(seed: int):
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128))


def _batches(steps: int, batch: int, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, 256, (steps, batch, 65), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _reducing_after_step(model, smp_step):
    """``smp_step`` with the same model and optimizer reducing after the step."""

    def run(x, y):
        model.overlapping_allreduce = False
        try:
            smp_step(x, y)
        finally:
            model.overlapping_allreduce = True

    return run


def _worker(rank: int, world: int, steps: int, batch: int, rounds: int) -> dict | None:
    from model import lm_loss

    import smp

    warmup = 3
    batches = _batches(steps + warmup, batch, rank)

    smp.init({"microbatches": 1})
    model = smp.DistributedModel(_model(0))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    # Where a step's time goes, per phase (milliseconds, this rank): the backward, the outcome
    # agreement after it, and the end of the step (waiting for the reduction, copying back).
    phases: dict[str, list[float]] = {"backward": [], "agreement": [], "finish": []}

    def timing(phase: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[phase].append(1e3 * (time.perf_counter() - start))

        return run

    step_module = importlib.import_module("smp.step")  # (smp.step is also the decorator's name)
    step_module._agree_on_outcome = timing("agreement", step_module._agree_on_outcome)
    model._finish_step = timing("finish", model._finish_step)

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        timing("backward", model.backward)(loss)
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

    smp_after_step = _reducing_after_step(model, smp_step)

    # Alternate the three each round, so drift in machine load hits all alike.
    runs = {"smp": smp_step, "smp_after_step": smp_after_step, "ddp": ddp_step}
    samples = steps * batch * world
    rounds_out = []
    breakdown: dict[str, dict[str, list[float]]] = {"smp": {}, "smp_after_step": {}}
    for _ in range(rounds):
        result = {}
        for name, run in runs.items():
            for values in phases.values():
                values.clear()
            result[name] = samples / timed(run, batches, warmup)
            for phase, values in phases.items():
                if name in breakdown:
                    breakdown[name].setdefault(phase, []).extend(values[warmup:])
        rounds_out.append(result)
    smp.shutdown()
    medians = {
        name: {phase: statistics.median(v) for phase, v in by_phase.items()}
        for name, by_phase in breakdown.items()
    }
    return {"rounds": rounds_out, "phase_ms": medians}


def _pp_worker(rank: int, world: int, steps: int, batch: int, rounds: int) -> dict | None:
    from model import lm_loss

    import smp

    warmup = 3
    smp.init({"microbatches": 4, "pipeline_parallel_degree": 2, "ddp": True})
    batches = _batches(steps + warmup, batch, smp.dp_rank())
    model, smp_step = smp_training(_model(0), output_loss(lm_loss), 1e-3)
    smp_step(*batches[0])  # partitions; makes the stage's plan
    plan = model._grads.reduction

    def smp_plan_at_end(x, y):  # as before the per-stage overlap: the plan after the step
        plan.arm_counted = lambda: None
        try:
            smp_step(x, y)
        finally:
            del plan.arm_counted

    smp_after_step = _reducing_after_step(model, smp_step)

    runs = {"smp": smp_step, "smp_after_step": smp_after_step, "plan_at_end": smp_plan_at_end}
    samples = steps * batch * smp.dp_size()
    rounds_out, early = [], []
    for _ in range(rounds):
        result = {}
        for name, run in runs.items():
            result[name] = samples / timed(run, batches, warmup)
            if name == "smp":
                early.append((plan.issued_early, len(plan.buckets)))
        rounds_out.append(result)
    out = {
        "rounds": rounds_out,
        "stage": smp.pp_rank(),
        "bytes_per_stage": sum(
            p.numel() * p.element_size() for b in plan.buckets for p in b.params
        ),
        "issued_early": early,
    }
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, out)
    smp.shutdown()
    return {"ranks": gathered}


def main_pp(args) -> None:
    result = run_ranks(_pp_worker, 4, 4, args.steps, args.batch, args.rounds)
    ranks = result["ranks"]
    rounds = ranks[0]["rounds"]
    print(
        f"pp 2 x dp 2 (4 gloo processes, CPU, 1 thread each), GPT 0.8M params, 4 microbatches, "
        f"{args.batch} samples/replica/step"
    )
    print("samples/s  overlapped  after step  plan at end  overlapped/after  overlapped/at end")
    for i, r in enumerate(rounds):
        print(
            f"round {i:3d}  {r['smp']:10.1f}  {r['smp_after_step']:10.1f}  {r['plan_at_end']:11.1f}"
            f"  {r['smp'] / r['smp_after_step']:16.3f}  {r['smp'] / r['plan_at_end']:17.3f}"
        )
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"median     {median['smp']:10.1f}  {median['smp_after_step']:10.1f}"
        f"  {median['plan_at_end']:11.1f}"
    )
    for key, label in (("smp_after_step", "after step"), ("plan_at_end", "plan at end")):
        ratio = statistics.median(r["smp"] / r[key] for r in rounds)
        result[f"ratio_over_{key}"] = ratio
        print(f"overlapped / {label} = {ratio:.3f} (median of {len(rounds)} rounds)")
    for stage in (0, 1):
        r = next(x for x in ranks if x["stage"] == stage)  # its replicas' plans are the same
        issued = ", ".join(f"{a}/{b}" for a, b in r["issued_early"])
        print(
            f"stage {stage}: {r['bytes_per_stage'] / 2**20:.2f} MiB over its replicas per step; "
            f"buckets issued during the backward per round: {issued}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pp", type=int, default=1, choices=(1, 2), help="2: pp 2 x dp 2")
    args = parser.parse_args()
    if args.pp == 2:
        main_pp(args)
        return
    result = run_ranks(_worker, 2, 2, args.steps, args.batch, args.rounds)
    rounds = result["rounds"]
    print(f"world 2 (gloo, CPU, 1 thread each), GPT 0.8M params, {args.batch} samples/rank/step")
    print("samples/s  smp (overlapped)  smp (after step)      DDP   smp/DDP  after/DDP")
    for i, r in enumerate(rounds):
        print(
            f"round {i:3d}  {r['smp']:16.1f}  {r['smp_after_step']:16.1f}  {r['ddp']:7.1f}"
            f"  {r['smp'] / r['ddp']:8.3f}  {r['smp_after_step'] / r['ddp']:9.3f}"
        )
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    result["median_samples_per_s"] = median
    result["ratio_smp_over_ddp"] = statistics.median(r["smp"] / r["ddp"] for r in rounds)
    result["ratio_after_step_over_ddp"] = statistics.median(
        r["smp_after_step"] / r["ddp"] for r in rounds
    )
    print(
        f"median     {median['smp']:16.1f}  {median['smp_after_step']:16.1f}  {median['ddp']:7.1f}"
    )
    print(f"smp / DDP = {result['ratio_smp_over_ddp']:.3f} (median of {len(rounds)} rounds)")
    print(
        f"smp reducing after the step / DDP = {result['ratio_after_step_over_ddp']:.3f} "
        f"(median of {len(rounds)} rounds)"
    )
    print("per step on rank 0, ms (median)   backward  agreement  finish")
    for name, label in (("smp", "smp (overlapped)"), ("smp_after_step", "smp (after step)")):
        ms = result["phase_ms"][name]
        print(f"{label:32s} {ms['backward']:9.1f}  {ms['agreement']:9.1f}  {ms['finish']:6.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
