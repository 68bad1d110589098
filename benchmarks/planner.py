"""The planner's predictions against what runs do (design.md §13): every gate of its targets that
can be measured here, printed with its numbers.

1. **Full-scale memory** (no run): a Megatron-style GPT-3 layer at tp 8 traced on fake tensors,
   times the schedule IR's in-flight count, against Korthikanti et al. 2022's Figure 1.
2. **This machine** (`--runs`, world 2, one process per core, gloo): for each layout of a small
   GPT and an unmodified Hugging Face Llama (pp, tp, dp in {1, 2}; ZeRO-1, sdp; the dynamic and
   static schedules; checkpointing; microbatch sizes), smp runs the plan (``smp.init(config)``,
   ``plan.apply``) for a few steps: each rank's tensor peak (``smp.planner.live.LiveMemory``)
   against its ledger, and the median step time against the predicted one, with the
   ``this-machine`` profile (calibrated on first use).
3. **Search time**: ``smp.plan`` for a GPT-3 175B-shaped model on `--search-gpus` H100s.

    .venv/bin/python benchmarks/planner.py [--runs 24] [--steps 4] [--skip-search] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks  # noqa: E402

GIB = 1024**3
SEQ, VOCAB, BATCH = 128, 512, 16


# ---- 1. full-scale memory ------------------------------------------------------------------------


def full_scale() -> list[dict]:
    from smp.planner.literature import full_scale_memory

    return full_scale_memory()


# ---- 2. runs on this machine ---------------------------------------------------------------------


def _gpt():
    from model import GPT, GPTConfig

    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128))


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt": _gpt, "llama": _llama}


def _loss(name, model, ids, labels):
    if name == "llama":
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    from model import lm_loss

    return lm_loss(model(ids), labels)


def _run(rank: int, name: str, chosen, batch: int, steps: int) -> dict:
    import smp
    from smp.planner.live import LiveMemory

    smp.init(chosen.config)
    torch.manual_seed(0)
    module = MODELS[name]()
    chosen.apply(module)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss(name, model, ids, labels)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(smp.rdp_rank())
    ids, labels = (torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(2))

    def step():
        train_step(model, ids, labels)
        opt.step()
        opt.zero_grad()

    step()  # partitions, and makes the optimizer state
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    state = [
        t for s in opt.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    live = LiveMemory([*model.local_parameters(), *module.buffers(), *state, ids, labels])
    with live:
        step()
    peaks = [None, None]
    torch.distributed.all_gather_object(peaks, live.peak_bytes)
    smp.shutdown()
    return {"seconds": statistics.median(times), "peaks": peaks}


def _candidates(name: str, cluster, limit: int) -> list:
    import smp

    ids = torch.zeros(2, SEQ, dtype=torch.long)
    model = MODELS[name]()
    if name == "llama":
        example, run = {"input_ids": ids, "labels": ids, "use_cache": False}, None
    else:
        from model import lm_loss

        example, run = (ids,), (lambda m, x: lm_loss(m(x), ids))
    plans = smp.plan(
        model, example, cluster, BATCH, num_devices=2, device="cpu", run=run, max_plans=1000
    )
    # A spread of layouts: every (pp, tp, sharding, schedule, checkpointing) once, at the
    # smallest and the largest microbatch size.
    seen, picked = set(), []
    for p in sorted(plans, key=lambda p: p.predicted["microbatch_size"]):
        c = p.config
        key = (
            c["pipeline_parallel_degree"], c["tensor_parallel_degree"],
            c.get("shard_optimizer_state", False), c.get("sharded_data_parallel_degree", 1),
            c.get("pipeline_schedule"), bool(p.checkpointing),
            p.predicted["microbatch_size"] in (1, 2),
        )  # fmt: skip
        if key not in seen:
            seen.add(key)
            picked.append(p)
    return picked[:limit]


def runs(limit: int, steps: int) -> list[dict]:
    from smp.planner import get_cluster

    cluster = get_cluster("this-machine", num_devices=2)
    rows = []
    for name in MODELS:
        for chosen in _candidates(name, cluster, limit // len(MODELS)):
            batch = BATCH // chosen.predicted["data_parallel_degree"]
            try:
                got = run_ranks(_run, 2, name, chosen, batch, steps)
            except Exception as exc:  # noqa: BLE001 - reported in the table, the rest go on
                print(f"  {name:5s} {chosen.summary().split(':')[0]:62s} FAILED: {exc}", flush=True)
                rows.append({"model": name, "plan": chosen.summary(), "error": str(exc)})
                continue
            predicted = [
                ledger["total"] - ledger["reserved"] for ledger in chosen.predicted["ledger"]
            ]
            row = {
                "model": name,
                "plan": chosen.summary().split(":")[0],
                "config": chosen.config,
                "predicted_s": chosen.predicted["step_time_s"],
                "measured_s": got["seconds"],
                "predicted_peak": predicted,
                "measured_peak": got["peaks"],
            }
            row["time_error"] = row["predicted_s"] / row["measured_s"] - 1
            row["memory_error"] = [p / m - 1 for p, m in zip(predicted, got["peaks"])]
            rows.append(row)
            print(
                f"  {name:5s} {row['plan']:62s} step {row['measured_s'] * 1e3:7.1f} ms "
                f"(predicted {row['predicted_s'] * 1e3:7.1f}, {row['time_error']:+6.1%}); peak "
                + ", ".join(
                    f"{m / 2**20:.1f} MiB ({e:+.1%})"
                    for m, e in zip(got["peaks"], row["memory_error"])
                ),
                flush=True,
            )
    return rows


# ---- 3. search time ------------------------------------------------------------------------------


def search(gpus: int) -> dict:
    import transformers

    import smp

    config = transformers.GPT2Config(
        n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.zeros(1, 2048, dtype=torch.long)
    start = time.perf_counter()
    plans = smp.plan(model, {"input_ids": ids, "labels": ids}, "h100", 1536, num_devices=gpus)
    seconds = time.perf_counter() - start
    best = plans[0].summary() if plans.plans else "none fits"
    return {"gpus": gpus, "seconds": seconds, "best": best, "rejected": len(plans.rejected)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=24, help="layouts run on this machine")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    parser.add_argument("--search-gpus", type=int, default=1024)
    parser.add_argument("--skip-search", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    out: dict = {}

    print("1. full-scale memory: a traced GPT-3 layer at tp 8 against Korthikanti et al. 2022")
    out["full_scale"] = full_scale()
    for row in out["full_scale"]:
        print(
            f"  {row['model']:5s} states {row['states_gib']:7.2f} GiB ({row['states_error']:+.2%})"
            f"  activations {row['activations_gib']:7.2f} GiB ({row['activations_error']:+.2%})"
        )
    print(f"2. this machine: {args.runs} layouts at world 2, {args.steps} timed steps each")
    out["runs"] = rows = runs(args.runs, args.steps)
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    if failed:
        print(f"  {len(failed)} layouts failed to run")
    errors = sorted(abs(r["time_error"]) for r in rows)
    memory = [e for r in rows for e in r["memory_error"]]
    under = sum(1 for e in memory if e < 0)
    if rows:
        p95 = errors[min(len(errors) - 1, math.ceil(0.95 * len(errors)) - 1)]
        print(
            f"  step time |error|: median {statistics.median(errors):.1%}, 95th percentile "
            f"{p95:.1%} (targets 3 % and 8 %)"
        )
        print(
            f"  peak memory error per rank: {min(memory):+.1%} to {max(memory):+.1%}; ranks "
            f"above their ledger: {under} of {len(memory)} (target: none; |error| <= 2 %)"
        )
    if not args.skip_search:
        out["search"] = found = search(args.search_gpus)
        print(
            f"3. search: GPT-3 175B on {found['gpus']} H100s in {found['seconds']:.1f} s "
            f"(target <= 1 s); best: {found['best']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
