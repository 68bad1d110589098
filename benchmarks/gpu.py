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
  pipeline two processes sharing the device over gloo (pp 2, "device": the device's type, device
           tensors staged through the host): a GPT in 8 microbatches trained with AdamW for
           --pipeline-steps steps (200 by default), the first steps' losses against one process
           on the same device; time per step (median of the last half) and the peak memory.
           What it checks on a GPU: the stream discipline of design.md §4.8 over many steps,
           no hang, no stall, exact.
  tp_syncs two processes sharing the device over gloo (tp 2): a training step of L and of 2L
           smp.nn transformer layers under torch.cuda.set_sync_debug_mode("warn"), counting
           the synchronizing CUDA operations per step, all and those made by smp/tp's region
           agreement (design.md §6.3: none, whatever L). CPU: nothing to count (reported so).
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


def _pipeline_worker(rank: int, device_type: str, small: bool, steps: int) -> dict:
    import torch.distributed as dist
    from model import GPT, GPTConfig, lm_loss

    import smp

    torch.backends.cuda.matmul.allow_tf32 = False  # exact against one process
    torch.backends.cudnn.allow_tf32 = False
    if small:
        cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64, dropout=0.0)
        batch, seq = 16, 32
    else:
        cfg = GPTConfig(
            vocab_size=8192, block_size=512, n_layer=8, n_head=8, n_embd=1024, dropout=0.0
        )
        batch, seq = 16, 512
    checked = min(steps, 5)  # steps compared with one process
    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": 8, "backend": "gloo", "device": device_type}
    )
    device = smp.state.get_state().device
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(cfg))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        return tokens[:, :-1], tokens[:, 1:]

    losses, times = [], []
    for step in range(steps):
        x, y = batch_of(step)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = train(model, x, y).reduce_mean()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if rank == 0 and (step + 1) % max(1, steps // 10) == 0:
            print(f"pipeline: step {step + 1}/{steps}, {times[-1] * 1e3:.1f} ms", flush=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    smp.shutdown()
    result = {"rank": rank, "steps": steps, "peak_bytes": peak}
    result["step_ms_median_last_half"] = statistics.median(times[steps // 2 :]) * 1e3
    if rank == 0:
        # One process on the same device, the same batches accumulated in 8 microbatches.
        torch.manual_seed(0)
        reference = GPT(cfg).to(device)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-4)
        diffs = []
        for step in range(checked):
            x, y = batch_of(step)
            ref_opt.zero_grad(set_to_none=True)
            total = 0.0
            for xm, ym in zip(x.chunk(8), y.chunk(8)):
                loss = lm_loss(reference(xm), ym)
                (loss / 8).backward()
                total += float(loss) / 8
            ref_opt.step()
            diffs.append(abs(total - losses[step]))
        result["loss_max_abs_diff_first_steps"] = max(diffs)
        result["losses_first_steps"] = losses[:checked]
    return result


def bench_pipeline(device, small: bool, rounds: int, steps: int) -> dict:
    from _launch import run_ranks

    return run_ranks(_pipeline_worker, 2, device.type, small, steps)


def _tp_syncs_worker(rank: int, device_type: str, small: bool) -> dict:
    import os
    import warnings

    from torch import nn

    import smp
    from smp.nn import DistributedTransformerLayer

    hidden, seq, local_batch = (32, 8, 2) if small else (1024, 512, 4)
    layer = dict(
        num_attention_heads=4 if small else 16,
        attention_head_size=hidden // (4 if small else 16),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        attention_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        causal_mask_size=seq,
    )
    smp.init({"tensor_parallel_degree": 2, "backend": "gloo", "device": device_type})
    device = smp.state.get_state().device
    agreement = os.path.join(os.path.dirname(smp.__file__), "tp", "agreement.py")
    result = {}

    @smp.step
    def train(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    for layers in (2, 4):
        torch.manual_seed(0)
        stack = nn.Sequential(*(DistributedTransformerLayer(**layer) for _ in range(layers)))
        model = smp.DistributedModel(stack)

        x = torch.randn(local_batch, seq, hidden, device=device)
        train(model, x)  # warm-up: the first call partitions and places
        if device.type != "cuda":
            result[layers] = "n/a (no CUDA device: nothing synchronizes)"
            continue
        _sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train(model, x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        result[layers] = {
            "all": len(syncs),
            "agreement": sum(w.filename == agreement for w in syncs),
            "where": sorted({f"{os.path.basename(w.filename)}:{w.lineno}" for w in syncs}),
        }
    smp.shutdown()
    return result


def bench_tp_syncs(device, small: bool, rounds: int) -> dict:
    from _launch import run_ranks

    return run_ranks(_tp_syncs_worker, 2, device.type, small)


def bench_roundtrip(device, small: bool, rounds: int) -> dict:
    from _launch import run_ranks

    return run_ranks(_roundtrip_worker, 2, device.type, small, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small sizes (a check, not numbers)")
    parser.add_argument("--only", default="kernels,step,roundtrip,pipeline,tp_syncs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipeline-steps", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    report["torch"] = torch.__version__
    for section in args.only.split(","):
        fn = {
            "kernels": bench_kernels,
            "step": bench_step,
            "roundtrip": bench_roundtrip,
            "pipeline": lambda d, small, r: bench_pipeline(d, small, r, args.pipeline_steps),
            "tp_syncs": bench_tp_syncs,
        }[section]
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
    if "pipeline" in report:
        r0 = report["pipeline"]
        print(
            f"pipeline pp 2 x 8 microbatches, {r0['steps']} steps on one device: "
            f"{r0['step_ms_median_last_half']:.1f} ms per step (rank 0), first steps' loss "
            f"vs one process max |diff| {r0['loss_max_abs_diff_first_steps']:.2e}"
        )
    if "tp_syncs" in report:
        for layers, r in report["tp_syncs"].items():
            print(f"tp 2, {layers} layers: synchronizing CUDA operations per step {r}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
