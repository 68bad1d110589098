"""smp on one GPU: the fused kernels against their ATen compositions, and smp's training step
against the same loop in plain torch. Rounds alternate between the two sides; ratios are medians.

    python benchmarks/gpu.py                      # on cuda:0, the sizes of the issue
    python benchmarks/gpu.py --device cpu --small # the same code on the CPU, small sizes (a check)
    python benchmarks/gpu.py --only kernels --json out.json

Sections:
  kernels  fused vocab cross-entropy (smp.kernels.vocab_cross_entropy) against smp's ATen
           composition and F.cross_entropy on float32 logits, and fused bias + GeLU against
           F.gelu(x + b): forward + backward time, and on CUDA the peak memory above the inputs.
  step     a GPT (examples/gpt, ~1 B parameters in the full size) in bf16 autocast with AdamW:
           smp.DistributedModel + @smp.step with microbatches 1 and 4, against plain torch doing
           the same microbatches; tokens/s and their ratio.
  roundtrip  two processes sharing the device over gloo (pp 2, "device": the device's type): a
           root on stage 0 calls a trivial module on stage 1 many times per step, with a small
           tensor and with a 1 MiB one (device tensors staged through the host, design.md §4.8);
           time per call, beside a bare gloo send + receive of the same tensor each way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls (after one untimed call)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _peak(fn, device) -> int | None:
    """Bytes allocated at the peak of one call of ``fn`` above what was allocated before it: the
    caching allocator's peak on CUDA; on the CPU the process's peak resident memory (Linux: the
    high-water mark reset through /proc/self/clear_refs; large tensors are mmapped, so a freed
    one leaves the resident set)."""
    if device.type != "cuda":
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            base = _status_kib("VmRSS:")
            fn()
            return (_status_kib("VmHWM:") - base) * 1024
        except OSError:
            return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def _rounds(sides: dict, device, rounds: int, iters: int) -> dict:
    """Alternating rounds of every side; per side the round times and their median."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(_timed(fn, device, iters))
    return {name: {"rounds_s": t, "median_s": statistics.median(t)} for name, t in times.items()}


def bench_kernels(device, small: bool, rounds: int) -> dict:
    import smp
    from smp import kernels
    from smp.tp.functional import _composed_cross_entropy, tp_group

    smp.init({})
    out = {}
    # A TP-2 slice of GPT-2's padded vocabulary, for 8192 tokens.
    tokens, vocab = (2048, 8192) if small else (8192, 50304 // 2)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16, generator=g)
    target = torch.randint(0, vocab, (tokens,), device=device, generator=g)

    def ce(run):
        def once():
            leaf = logits.detach().requires_grad_()
            run(leaf).sum().backward()

        return once

    sides = {
        "fused": ce(lambda x: kernels.vocab_cross_entropy(x, target, 0)),
        "smp_composed": ce(lambda x: _composed_cross_entropy(x, target, 0, tp_group(), -100)),
        "torch_f32": ce(lambda x: F.cross_entropy(x.float(), target, reduction="none")),
    }
    result = _rounds(sides, device, rounds, iters=3 if small else 10)
    for name, fn in sides.items():
        result[name]["peak_bytes"] = _peak(fn, device)
    result["shape"] = [tokens, vocab]
    result["fused_speedup_vs_composed"] = (
        result["smp_composed"]["median_s"] / result["fused"]["median_s"]
    )
    out["cross_entropy"] = result

    shape = (4, 256, 1024) if small else (8, 1024, 4 * 2048 // 2)  # MLP width of a TP-2 rank
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)
    bias = torch.randn(shape[-1], device=device, generator=g)
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)

    def bg(run):
        def once():
            xl, bl = x.detach().requires_grad_(), bias.detach().requires_grad_()
            run(xl, bl).backward(grad)

        return once

    sides = {
        "fused": bg(lambda a, b: kernels.bias_gelu(a, b, "tanh")),
        "composed": bg(lambda a, b: F.gelu(a + b.to(a.dtype), approximate="tanh")),
    }
    result = _rounds(sides, device, rounds, iters=3 if small else 20)
    for name, fn in sides.items():
        result[name]["peak_bytes"] = _peak(fn, device)
    result["shape"] = list(shape)
    result["fused_speedup"] = result["composed"]["median_s"] / result["fused"]["median_s"]
    out["bias_gelu"] = result
    smp.shutdown()
    return out


def _step_pair(cfg, x, y, microbatches: int, device, rounds: int, iters: int) -> dict:
    """Plain torch and smp training the same GPT on the same batch, alternating rounds."""
    from model import GPT, lm_loss

    import smp

    fused = device.type == "cuda"
    torch.manual_seed(0)
    plain = GPT(cfg).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=fused)

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = lm_loss(plain(xm), ym)
            (loss / microbatches).backward()
        plain_opt.step()

    smp.init({"microbatches": microbatches, "bf16": True})
    try:
        torch.manual_seed(0)
        model = smp.DistributedModel(GPT(cfg))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused))

        @smp.step
        def train(model, x, y):
            loss = lm_loss(model(x), y)
            model.backward(loss)
            return loss

        def smp_step():
            opt.zero_grad(set_to_none=True)
            train(model, x, y).reduce_mean()
            opt.step()

        times = _rounds({"torch": plain_step, "smp": smp_step}, device, rounds, iters)
    finally:
        smp.shutdown()
    tokens = x.numel()
    return {
        **times,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tokens_per_s": {k: tokens / v["median_s"] for k, v in times.items()},
        "ratio": times["torch"]["median_s"] / times["smp"]["median_s"],
    }


def bench_step(device, small: bool, rounds: int) -> dict:
    from model import GPTConfig

    if small:
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
        batch, seq, iters = 8, 64, 2
    else:
        cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=18, n_head=16, n_embd=2048)
        batch, seq, iters = 8, 1024, 5
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=g)
    results = {"config": vars(cfg) | {"batch": batch, "seq": seq}}
    for microbatches in (1, 4):
        results[f"microbatches_{microbatches}"] = _step_pair(
            cfg, x, y, microbatches, device, rounds, iters
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _roundtrip_worker(rank: int, device_type: str, small: bool, rounds: int) -> dict:
    import torch.distributed as dist

    # benchmarks/pipeline.py: a root calling a trivial module, and a bare gloo round trip
    from pipeline import exchange, pinged_model

    import smp

    calls = 20 if small else 200
    smp.init({"pipeline_parallel_degree": 2, "backend": "gloo", "device": device_type})
    device = smp.state.get_state().device
    model, ping = pinged_model(calls)

    result = {}
    for name, shape in (("small", (1, 1)), ("1MiB", (256, 1024))):
        x = torch.zeros(shape, device=device)
        with torch.no_grad():
            ping(model, x)  # partitions (the first time), warms up
            times = []
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                ping(model, x)
                _sync(device)
                times.append((time.perf_counter() - start) / calls)
        # The wire alone: this tensor to the peer and back over the same gloo world, staged
        # through the host as the transport stages it.
        bare = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                host = x.cpu()
                exchange(rank, host)
                host.to(device)
            bare.append((time.perf_counter() - start) / calls)
        result[name] = {
            "smp_call_us": statistics.median(times) * 1e6,
            "bare_gloo_us": statistics.median(bare) * 1e6,
            "rounds_us": [t * 1e6 for t in times],
        }
    smp.shutdown()
    return result


def bench_roundtrip(device, small: bool, rounds: int) -> dict:
    from _launch import run_ranks

    return run_ranks(_roundtrip_worker, 2, device.type, small, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (a check, not numbers)")
    parser.add_argument("--only", default="kernels,step,roundtrip")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report["torch"] = torch.__version__
    for section in args.only.split(","):
        fn = {"kernels": bench_kernels, "step": bench_step, "roundtrip": bench_roundtrip}[section]
        report[section] = fn(device, args.small, args.rounds)
        print(f"--- {section}")
        print(json.dumps(report[section], indent=1, default=str))
    if "kernels" in report:
        ce, bg = report["kernels"]["cross_entropy"], report["kernels"]["bias_gelu"]
        print(
            f"cross-entropy {ce['shape']}: fused {ce['fused']['median_s'] * 1e3:.3f} ms, "
            f"composed {ce['smp_composed']['median_s'] * 1e3:.3f} ms "
            f"({ce['fused_speedup_vs_composed']:.2f}x), F.cross_entropy "
            f"{ce['torch_f32']['median_s'] * 1e3:.3f} ms; peak bytes: fused "
            f"{ce['fused']['peak_bytes']}, composed {ce['smp_composed']['peak_bytes']}, "
            f"F.cross_entropy {ce['torch_f32']['peak_bytes']}"
        )
        print(
            f"bias+gelu {bg['shape']}: fused {bg['fused']['median_s'] * 1e3:.3f} ms, composed "
            f"{bg['composed']['median_s'] * 1e3:.3f} ms ({bg['fused_speedup']:.2f}x)"
        )
    if "step" in report:
        for key in ("microbatches_1", "microbatches_4"):
            r = report["step"][key]
            print(
                f"step, {key.replace('_', ' ')}: smp {r['tokens_per_s']['smp']:.0f} tokens/s, "
                f"torch {r['tokens_per_s']['torch']:.0f} tokens/s, ratio {r['ratio']:.3f}"
            )
    if "roundtrip" in report:
        for size, r in report["roundtrip"].items():
            print(
                f"cross-stage call round trip, {size} tensor: smp {r['smp_call_us']:.0f} us, "
                f"bare gloo send + receive {r['bare_gloo_us']:.0f} us"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
