"""Pipeline runtime baseline: throughput at p = 2 and the cost of one cross-stage call.

1. Samples/s of the demo GPT (8 layers, n_embd 256, 32 samples of 64 tokens per step) trained
   with smp at pipeline_parallel_degree = 2, microbatches = 8 (2 gloo processes, one thread
   each), against the same model and batch in one process (one thread: rank 0 of the same
   processes while rank 1 waits), in alternating rounds; the ratio is the median of the
   rounds' ratios, every round printed. Also timed there: the batch in the same 8 microbatches
   with gradients accumulated, which prices the smaller pieces apart from the pipeline.
2. Round trip of one cross-stage call to a trivial module: a root on stage 0 calls a module
   pinned on stage 1 many times in an evaluation step; time per call, beside a bare gloo round
   trip between the same processes (a 4 KiB tensor each way, the size of smp's message header),
   and what each costs each rank: CPU time (user + system) and voluntary context switches per
   round trip (getrusage over the timed calls; Linux: TCP segments sent per round trip).

    .venv/bin/python benchmarks/pipeline.py [--steps 10] [--rounds 5] [--only roundtrip]
                                            [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
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
from _launch import output_loss, run_ranks, smp_training  # noqa: E402

BATCH, SEQ, MICROBATCHES = 32, 64, 8


def _gpt():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, n_layer=8, n_head=4, n_embd=256))


def _data(steps: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def single_process(steps: int, warmup: int, microbatches: int = 1) -> float:
    """Samples/s of the model in this process, each batch in ``microbatches`` pieces whose
    gradients accumulate (1: the whole batch at once)."""
    from model import lm_loss

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data(steps + warmup)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (lm_loss(model(xs), ys) / microbatches).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - start)


class Trivial(nn.Module):
    def forward(self, x):
        return x


class AddOne(nn.Module):
    def forward(self, x):
        return x + 1


class Resolve(nn.Module):
    """Reads its input (an op the runtime does not send to the value's stage), so a call's output
    must arrive before it can run."""

    def forward(self, x):
        return torch.relu(x)


class Caller(nn.Module):
    """``calls`` calls of ``trivial``, each taking the last one's output.

    Without ``wait`` (the benchmark's historic round trip), ``trivial`` returns its input and
    each output is passed on unseen: the runtime need not wait for a reply before the next call,
    so the calls go out back to back. With ``wait``, ``trivial`` adds one and a module on the
    caller's stage reads each output, so every call waits for its reply: a synchronous round
    trip."""

    def __init__(self, calls: int, wait: bool = False):
        super().__init__()
        self.calls = calls
        self.trivial = AddOne() if wait else Trivial()
        self.here = Resolve() if wait else None

    def forward(self, x):
        for _ in range(self.calls):
            x = self.trivial(x)
            if self.here is not None:
                x = self.here(x)
        return x


def pinged_model(calls: int, wait: bool = False):
    """A Caller whose root is on stage 0 and trivial module on stage 1, wrapped (smp.init done),
    and the step function that runs it: ``ping(model, x)`` makes ``calls`` cross-stage calls."""
    import smp

    caller = Caller(calls, wait)
    smp.set_partition(caller, 0)
    smp.set_partition(caller.trivial, 1)

    @smp.step
    def ping(model, x):
        return model(x)

    return smp.DistributedModel(caller), ping


class _Cost:
    """CPU time and voluntary context switches of this process (every thread) between
    construction and :meth:`per`, and TCP segments sent on the machine (Linux; -1 elsewhere)."""

    def __init__(self):
        self.usage, self.segments = resource.getrusage(resource.RUSAGE_SELF), _tcp_out_segments()

    def per(self, n: int) -> dict:
        now = resource.getrusage(resource.RUSAGE_SELF)
        segments = _tcp_out_segments()
        return {
            "cpu_us": (now.ru_utime + now.ru_stime - self.usage.ru_utime - self.usage.ru_stime)
            / n
            * 1e6,
            "switches": (now.ru_nvcsw - self.usage.ru_nvcsw) / n,
            "tcp_segments": (segments - self.segments) / n if segments >= 0 else -1.0,
        }


def _tcp_out_segments() -> int:
    try:
        with open("/proc/net/snmp") as f:
            rows = [line.split() for line in f if line.startswith("Tcp:")]
        return int(rows[1][rows[0].index("OutSegs")])
    except (OSError, IndexError, ValueError):
        return -1


def _train(steps: int, warmup: int) -> tuple[float, str, float]:
    """Samples/s at pp = 2, the partition report, and this rank's CPU seconds per step (every
    thread)."""
    from model import lm_loss

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES})
    model, step = smp_training(_gpt(), output_loss(lm_loss), 1e-3)
    data = _data(steps + warmup)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            dist.barrier()
            cost, start = _Cost(), time.perf_counter()
        step(x, y)
    dist.barrier()
    samples_per_s = steps * BATCH / (time.perf_counter() - start)
    cpu_s = cost.per(steps)["cpu_us"] / 1e6
    report = model.partition_report()
    smp.shutdown()
    return samples_per_s, report, cpu_s


def _gathered(cost: dict) -> list[dict]:
    costs: list = [None] * dist.get_world_size()
    dist.all_gather_object(costs, cost)
    return costs


def exchange(rank: int, tensor: torch.Tensor) -> None:
    """One bare gloo round trip between ranks 0 and 1: ``tensor`` to the other and back."""
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    else:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)


def _calls(calls: int, steps: int, wait: bool) -> tuple[float, dict]:
    """Seconds per call and what each costs this rank, over ``steps`` steps of ``calls``."""
    import smp

    smp.init({"pipeline_parallel_degree": 2})
    pinged, ping = pinged_model(calls, wait)
    x = torch.zeros(1, 1)
    with torch.no_grad():
        ping(pinged, x)  # partitions
        ping(pinged, x)  # the runtime learns which outputs are passed on unseen
        dist.barrier()
        cost, start = _Cost(), time.perf_counter()
        for _ in range(steps):
            ping(pinged, x)
        seconds = (time.perf_counter() - start) / (steps * calls)
        per_call = cost.per(steps * calls)
    smp.shutdown()
    return seconds, per_call


def _round_trips(rank: int, calls: int = 200, steps: int = 5) -> dict:
    round_trip, smp_cost = _calls(calls, steps, wait=True)
    chained, chained_cost = _calls(calls, steps, wait=False)

    buffer, n = torch.zeros(512, dtype=torch.int64), 5 * calls  # 4 KiB, as smp's header
    dist.barrier()
    cost, start = _Cost(), time.perf_counter()
    for _ in range(n):
        exchange(rank, buffer)
    bare = (time.perf_counter() - start) / n
    bare_cost = cost.per(n)
    return {
        "round_trip_us": round_trip * 1e6,
        "chained_call_us": chained * 1e6,
        "bare_gloo_round_trip_us": bare * 1e6,
        "round_trip_cost": _gathered(smp_cost),
        "chained_call_cost": _gathered(chained_cost),
        "bare_gloo_cost": _gathered(bare_cost),
    }


def _worker(rank: int, steps: int, warmup: int, rounds: int, only: str | None) -> dict | None:
    result: dict = {}
    if only != "roundtrip":
        single, accumulated, pp2, cpu = [], [], [], []
        for _ in range(rounds):  # alternating, in the same processes: the machine's speed drifts
            dist.barrier()
            if rank == 0:  # one process, one thread; rank 1 waits in the barrier
                single.append(single_process(steps, warmup))
                accumulated.append(single_process(steps, warmup, MICROBATCHES))
            dist.barrier()
            samples_per_s, result["partition"], cpu_s = _train(steps, warmup)
            pp2.append(samples_per_s)
            cpu.append(cpu_s)
        cpus = _gathered(cpu)  # [rank][round]
        if rank == 0:  # the result returned
            result["single_samples_per_s"], result["pp2_samples_per_s"] = single, pp2
            result["accumulated_samples_per_s"] = accumulated
            result["pp2_cpu_s_per_step"] = cpus
            result["ratios_pp2_over_single"] = [b / a for a, b in zip(single, pp2)]
            result["ratio_pp2_over_single"] = statistics.median(result["ratios_pp2_over_single"])
    result.update(_round_trips(rank))
    return result


def _print_round_trips(result: dict) -> None:
    print(
        f"cross-stage call round trip (x + 1, read at once): {result['round_trip_us']:.0f} us; "
        f"bare gloo round trip (4 KiB each way): {result['bare_gloo_round_trip_us']:.0f} us\n"
        f"chained calls of a trivial module (identity, outputs passed on; before 2026-12-05 "
        f"the 'round trip'): {result['chained_call_us']:.0f} us per call"
    )
    print("per call or round trip  rank  CPU us  context switches  TCP segments (machine)")
    rows = (
        ("smp call, round trip", "round_trip_cost"),
        ("smp call, chained", "chained_call_cost"),
        ("bare gloo", "bare_gloo_cost"),
    )
    for name, key in rows:
        for rank, cost in enumerate(result[key]):
            print(
                f"  {name:<21} {rank:>3} {cost['cpu_us']:7.0f} {cost['switches']:17.1f} "
                f"{cost['tcp_segments']:13.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["roundtrip"], help="skip the throughput comparison")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run_ranks(_worker, 2, args.steps, args.warmup, args.rounds, args.only)
    if args.only is None:
        print(result.pop("partition"))
        print(
            f"GPT 8 layers n_embd 256, {BATCH} x {SEQ} tokens per step, gloo, 1 thread per "
            f"process; {args.rounds} alternating rounds"
        )

        def row(values: list[float], spec: str) -> str:
            return " ".join(format(v, spec) for v in values)

        single, pp2 = result["single_samples_per_s"], result["pp2_samples_per_s"]
        print(f"one process, samples/s       {row(single, '6.1f')}")
        print(f"one process, 8 microbatches  {row(result['accumulated_samples_per_s'], '6.1f')}")
        print(f"smp pp=2, 8 microbatches     {row(pp2, '6.1f')}")
        print(f"pp=2 / one process           {row(result['ratios_pp2_over_single'], '6.3f')}")
        print(f"pp=2 / one process, median   {result['ratio_pp2_over_single']:.3f}")
        accumulated = result["accumulated_samples_per_s"]
        print(
            "pp=2 / one process with 8 microbatches, median "
            f"{statistics.median(b / a for a, b in zip(accumulated, pp2)):.3f}"
        )
        work = [BATCH / a for a in accumulated]  # one thread: about its CPU time
        print(f"one process, 8 microbatches, wall s/step  {row(work, '6.3f')}")
        for rank, per_round in enumerate(result["pp2_cpu_s_per_step"]):
            print(f"smp pp=2, stage {rank}, CPU s/step            {row(per_round, '6.3f')}")
    _print_round_trips(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
