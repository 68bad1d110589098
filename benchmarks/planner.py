"""The planner's predictions against what runs do (design.md §13): every gate of its targets that
can be measured here, printed with its numbers.

1. **Full-scale memory** (no run): a Megatron-style GPT-3 layer at tp 8 traced on fake tensors,
   times the schedule IR's in-flight count, against Korthikanti et al. 2022's Figure 1.
2. **This machine** (world 2, one process per core, gloo): layouts drawn at random from the
   distinct plans (pp, tp, dp in {1, 2}; ZeRO-1, sdp; the dynamic and static schedules;
   checkpointing; microbatch sizes), each run by ``smp.init(config)`` for a few steps. The
   calibration set (``--calibration``: a GPT and an HF Llama of one shape) fits the host's costs
   (``smp.planner.fit_host_costs``); the held-out set (``--runs``: a GPT and an HF Llama of
   another shape, HF BERT and T5) is predicted with the fitted profile: the median step against
   the predicted one, and every rank's tensor peak (``smp.planner.live.LiveMemory``) against its
   ledger. ``--save-fit`` keeps the fit in the ``this-machine`` profile.
3. **Search time**: ``smp.plan`` for a GPT-3 175B-shaped model on `--search-gpus` H100s.

    .venv/bin/python benchmarks/planner.py [--calibration 32] [--runs 64] [--steps 4] [--save-fit]
        [--skip-search] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
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
#
# Two sets of models: the calibration set's runs fit the host's costs (smp.planner.fit), the
# held-out set's check the fitted model. No layout, shape or family of the held-out set is
# fitted on: the calibration models are a GPT and an HF Llama of other shapes; BERT and T5 are
# held out whole.


def _gpt(layers=4, hidden=128, heads=4, seq=SEQ):
    from model import GPT, GPTConfig

    return GPT(
        GPTConfig(block_size=seq, vocab_size=VOCAB, n_layer=layers, n_head=heads, n_embd=hidden)
    )


def _llama(layers=4, hidden=128, seq=SEQ):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=seq,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert():
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _t5():
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


# name: (builder, sequence length, held out)
MODELS = {
    "gpt-cal": (lambda: _gpt(layers=3, hidden=96, heads=2, seq=64), 64, False),
    "llama-cal": (lambda: _llama(layers=3, hidden=96, seq=64), 64, False),
    "gpt": (_gpt, SEQ, True),
    "llama": (_llama, SEQ, True),
    "bert": (_bert, SEQ, True),
    "t5": (_t5, SEQ, True),
}


def _hf_inputs(name: str, ids, labels) -> dict:
    """The keyword arguments of a Hugging Face model that computes its own loss."""
    return {"input_ids": ids, "labels": labels, **({} if name == "bert" else {"use_cache": False})}


def _loss(name, model, ids, labels):
    if name.startswith("gpt"):
        from model import lm_loss

        return lm_loss(model(ids), labels)
    return model(**_hf_inputs(name, ids, labels)).loss


def _run_one(name: str, chosen, batch: int, steps: int) -> dict:
    import smp
    from smp.planner.live import LiveMemory

    smp.init(chosen.config)
    torch.manual_seed(0)
    build, seq, _ = MODELS[name]
    module = build()
    chosen.apply(module)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss(name, model, ids, labels)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(smp.rdp_rank())
    ids, labels = (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))

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
    peaks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(peaks, live.peak_bytes)
    smp.shutdown()
    return {"seconds": statistics.median(times), "peaks": peaks}


def _run_all(rank: int, jobs: list, steps: int) -> list:
    """Every job (model name, plan, batch) in turn on these processes: one start of the
    interpreters for a model's layouts."""
    out = []
    for name, chosen, batch in jobs:
        try:
            out.append(_run_one(name, chosen, batch, steps))
        except Exception as exc:  # noqa: BLE001 - reported in the table, the rest go on
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            try:
                import smp

                smp.shutdown()
            except Exception:  # noqa: BLE001 - the next job's init reports what is left
                pass
    return out


def _plans(name: str, cluster):
    import smp

    build, seq, _ = MODELS[name]
    ids = torch.zeros(2, seq, dtype=torch.long)
    model = build()
    if name.startswith("gpt"):
        from model import lm_loss

        example, run = (ids,), (lambda m, x: lm_loss(m(x), ids))
    else:
        example, run = _hf_inputs(name, ids, ids), None
    return smp.plan(
        model, example, cluster, BATCH, num_devices=2, device="cpu", run=run, max_plans=10000
    )


def _spread(plans, limit: int, seed: str) -> list:
    """``limit`` layouts drawn at random (seeded) from the distinct (pp, tp, sharding, schedule,
    checkpointing, microbatch size) layouts: no kind or size is favoured."""
    distinct = {}
    for p in plans:
        c = p.config
        key = (
            c["pipeline_parallel_degree"], c["tensor_parallel_degree"],
            c.get("shard_optimizer_state", False), c.get("sharded_data_parallel_degree", 1),
            c.get("pipeline_schedule"), c.get("pipeline"), bool(p.checkpointing),
            p.predicted["microbatch_size"],
        )  # fmt: skip
        distinct.setdefault(key, p)
    keys = sorted(distinct, key=repr)
    return [distinct[k] for k in random.Random(seed).sample(keys, min(limit, len(keys)))]


def _measure(names: list[str], cluster, limit: int, steps: int) -> list[tuple]:
    """(model name, plan, measured result) for a spread of each model's layouts."""
    out = []
    for name in names:
        picked = _spread(_plans(name, cluster), limit, seed=name)
        # (a plan pickles without its pricing inputs, which stay here)
        jobs = [(name, p, BATCH // p.predicted["data_parallel_degree"]) for p in picked]
        results = run_ranks(_run_all, 2, jobs, steps)
        out.extend((name, p, got) for p, got in zip(picked, results))
    return out


def _row(name: str, chosen, got: dict, baseline) -> dict:
    predicted = [ledger["total"] - ledger["reserved"] for ledger in chosen.predicted["ledger"]]
    row = {
        "model": name,
        "plan": chosen.summary().split(":")[0],
        "config": chosen.config,
        "predicted_s": chosen.predicted["step_time_s"],
        "unfitted_s": baseline,
        "measured_s": got["seconds"],
        "predicted_peak": predicted,
        "measured_peak": got["peaks"],
    }
    row["time_error"] = row["predicted_s"] / row["measured_s"] - 1
    row["memory_error"] = [p / m - 1 for p, m in zip(predicted, got["peaks"])]
    print(
        f"  {name:9s} {row['plan']:64s} step {row['measured_s'] * 1e3:7.1f} ms "
        f"(predicted {row['predicted_s'] * 1e3:7.1f}, {row['time_error']:+6.1%}); peak "
        + ", ".join(
            f"{m / 2**20:.1f} MiB ({e:+.1%})" for m, e in zip(got["peaks"], row["memory_error"])
        ),
        flush=True,
    )
    return row


def runs(calibration: int, held_out: int, steps: int, save: bool) -> dict:
    from smp.planner import fit_host_costs, get_cluster
    from smp.planner.cluster import _this_machine_path

    cluster = get_cluster("this-machine", num_devices=2)
    cal_names = [n for n, (_, _, out) in MODELS.items() if not out]
    test_names = [n for n, (_, _, out) in MODELS.items() if out]
    print(f"  calibration: {calibration} layouts of {', '.join(cal_names)}", flush=True)
    measured = _measure(cal_names, cluster, calibration // len(cal_names), steps)
    failed = [(n, p, g) for n, p, g in measured if "error" in g]
    for name, p, got in failed:
        print(f"  {name:9s} {p.summary().split(':')[0]:64s} FAILED: {got['error']}", flush=True)
    samples = [(p, g["seconds"]) for _, p, g in measured if "error" not in g]
    fitted, report = fit_host_costs(cluster, samples)
    coefficients = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in report["coefficients"].items())
    print(
        f"  fitted on {report['samples']} runs: {coefficients}; calibration |error| median "
        f"{report['median_error_before']:.1%} -> {report['median_error']:.1%}, max "
        f"{report['max_error_before']:.1%} -> {report['max_error']:.1%}",
        flush=True,
    )
    if save:
        whole = get_cluster("this-machine")
        dataclasses.replace(whole, host=fitted.host, call_overhead_s=fitted.call_overhead_s).save(
            _this_machine_path()
        )
        print(f"  saved the fitted costs in {_this_machine_path()}", flush=True)
    rows = [
        _row(n, p.priced_on(fitted), g, p.predicted["step_time_s"])
        for n, p, g in measured
        if "error" not in g
    ]
    print(f"  held out: {held_out} layouts of {', '.join(test_names)}", flush=True)
    tested = _measure(test_names, fitted, held_out // len(test_names), steps)
    held = []
    for name, p, got in tested:
        if "error" in got:
            print(f"  {name:9s} {p.summary().split(':')[0]:64s} FAILED: {got['error']}", flush=True)
            continue
        held.append(_row(name, p, got, p.priced_on(cluster).predicted["step_time_s"]))
    return {
        "fit": report,
        "calibration": rows,
        "held_out": held,
        "failed": len(failed) + sum(1 for *_, g in tested if "error" in g),
    }


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


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
    parser.add_argument("--runs", type=int, default=64, help="held-out layouts run here")
    parser.add_argument(
        "--calibration", type=int, default=32, help="layouts run here to fit the host's costs"
    )
    parser.add_argument(
        "--save-fit", action="store_true",
        help="save the fitted host costs in the this-machine profile (smp.plan then uses them)",
    )  # fmt: skip
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
    print(
        f"2. this machine: {args.calibration} + {args.runs} layouts at world 2, {args.steps} "
        "timed steps each"
    )
    out["runs"] = result = runs(args.calibration, args.runs, args.steps, args.save_fit)
    rows = result["held_out"]
    if result["failed"]:
        print(f"  {result['failed']} layouts failed to run")
    if rows:
        errors = [abs(r["time_error"]) for r in rows]
        unfitted = [abs(r["unfitted_s"] / r["measured_s"] - 1) for r in rows]
        print(
            f"  step time |error| on {len(rows)} held-out layouts: median "
            f"{statistics.median(errors):.1%}, 95th percentile {_p95(errors):.1%} (targets 3 % "
            f"and 8 %; unfitted: {statistics.median(unfitted):.1%} and {_p95(unfitted):.1%})"
        )
    every = rows + result["calibration"]
    memory = [e for r in every for e in r["memory_error"]]
    if memory:
        under = sum(1 for e in memory if e < 0)
        print(
            f"  peak memory error per rank, all {len(every)} layouts: {min(memory):+.1%} to "
            f"{max(memory):+.1%}; ranks above their ledger: {under} of {len(memory)} (target: "
            "none; |error| <= 2 %)"
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
