"""Memory per rank with the memory savers off and on: the demo GPT (default ~300 M parameters:
24 layers, hidden 1024, byte vocabulary) on 4 gloo processes, at pp 2 x dp 2 and tp 2 x dp 2
(and dp 4 for sharded data parallelism), AdamW, two training steps per configuration (one
launch each, so each peak is its own).

Counted exactly from the tensors on each rank after the second step: the parameters it holds,
their gradients, the optimizer state; the *ideal share* is the whole model's bytes divided by
the ranks that split it (pp x tp) and, for sharded optimizer state, by the data-parallel
ranks holding the same parameters too (for sharded data parallelism, with
``sharded_data_parallel_degree`` = those ranks, parameters, gradients and state alike). With
activation checkpointing: the bytes the checkpointed blocks keep per microbatch (their saved
inputs) against the block-boundary tensors (one microbatch x sequence x hidden float32 tensor
per block this rank runs). Also the process's peak resident memory, and how far it rose above
the process's before the model was built, up to the end of the partition (building, wrapping,
tracing, partitioning: the whole model on every rank, unless built under
``smp.delay_param_initialization``, the ``delayed_init`` rows), against the rank's parameter
share.

    .venv/bin/python benchmarks/memory.py [--layers 24] [--hidden 1024] [--layouts pp2xdp2,...]
        [--savers off,...] [--runs dp4/sharded_dp,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks  # noqa: E402

LAYOUTS = {"pp2xdp2": (2, 1), "tp2xdp2": (1, 2), "dp4": (1, 1)}
SAVERS = {  # (activation checkpointing, shard_optimizer_state, delayed init, sharded dp)
    "off": (False, False, False, False),
    "checkpointing": (True, False, False, False),
    "shard_optimizer_state": (False, True, False, False),
    "both": (True, True, False, False),
    "delayed_init": (False, False, True, False),
    # sharded_data_parallel_degree = every data-parallel rank holding the same parameters
    # (not with pipeline parallelism)
    "sharded_dp": (False, False, False, True),
    "sharded_dp_delayed_init": (False, False, True, True),
}
# dp 4 runs the sharded rows only: four whole models with their AdamW state do not fit here.


def _nbytes(tensors) -> int:
    from smp.dp.sharded import local_part

    seen = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            local = local_part(t)  # a sharded data parallel tensor: this rank's chunk
            seen[id(t)] = local.numel() * local.element_size()
    return sum(seen.values())


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank: int, layout: str, saver: str, layers: int, hidden: int, seq: int) -> dict:
    import torch.distributed as dist
    from model import BLOCK_TP_PLAN, GPT, Block, GPTConfig, lm_loss

    import smp
    from smp.memory import activations

    pp, tp = LAYOUTS[layout]
    checkpointing, sharded, delay, sdp = SAVERS[saver]
    microbatches, batch = 2, 4
    rdp = 4 // (pp * tp)
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True,
              "microbatches": microbatches, "shard_optimizer_state": sharded,
              "sharded_data_parallel_degree": rdp if sdp else 1})  # fmt: skip
    cfg = GPTConfig(block_size=seq, n_layer=layers, n_head=16, n_embd=hidden)
    # One-time costs that do not grow with the model belong to the process baseline: FSDP2 and
    # DTensor's modules (about 40 MiB), and the meta-device kernels and decompositions torch
    # imports the first time a model is built on the meta device (about 70 MiB, measured with a
    # second build costing 3 MiB).
    if sdp:
        importlib.import_module("torch.distributed.fsdp")
        importlib.import_module("torch.distributed.tensor")
    if delay:
        with smp.delay_param_initialization():
            GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    torch.manual_seed(0)
    baseline = _rss_peak()
    with smp.delay_param_initialization(enabled=delay):
        net = GPT(cfg)
    total_params = sum(p.numel() * p.element_size() for p in net.parameters())
    if tp > 1:
        smp.tp_register_plan(Block, **BLOCK_TP_PLAN)
        for block in net.h:
            smp.set_tensor_parallelism(block)
    if checkpointing:
        smp.set_activation_checkpointing(net.h)
    model = smp.DistributedModel(net)
    at_partition = [_rss_peak()]  # pp 1: the model is placed when wrapped
    model.register_post_partition_hook(lambda *_: at_partition.append(_rss_peak()))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    kept = [0]
    original = activations.Frame.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        kept[0] += sum(t.numel() * t.element_size() for t in activations.tree.tensors(self.inputs))

    activations.Frame.__init__ = record

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(smp.dp_rank())
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
        kept[0] = 0
        optimizer.zero_grad(set_to_none=False)
        train_step(model, tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
    activations.Frame.__init__ = original

    params = [p for p in model.parameters() if p.numel() > 0]
    plan = model.partition_plan
    owned_blocks = sum(
        1 for i in range(layers) if plan is None or plan.assignment[f"h.{i}"] == smp.pp_rank()
    )
    boundary = owned_blocks * (batch // microbatches) * seq * hidden * 4
    # AdamW keeps exp_avg and exp_avg_sq (each the parameter's size) and a scalar step.
    ideal_state = 2 * total_params / (pp * tp) / (smp.rdp_size() if sharded or sdp else 1)
    mine = {
        "rank": rank,
        "params": _nbytes(params),
        "grads": _nbytes([p.grad for p in params]),
        "optimizer": optimizer.state_bytes(),
        "ideal_params": total_params / (pp * tp) / (smp.rdp_size() if sdp else 1),
        "ideal_optimizer": ideal_state,
        "kept_per_microbatch": kept[0] / microbatches,
        "block_boundaries": boundary if checkpointing else 0,
        "peak_rss": _rss_peak(),
        "construction_peak_above_baseline": at_partition[-1] - baseline,
        "total_params_bytes": total_params,
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    smp.shutdown()
    return everyone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layouts", default="pp2xdp2,tp2xdp2")
    parser.add_argument("--savers", default=",".join(SAVERS))
    parser.add_argument("--runs", help="layout/saver pairs instead, e.g. dp4/sharded_dp,...")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {}
    runs = (
        [tuple(run.split("/")) for run in args.runs.split(",")]
        if args.runs
        else [
            (layout, saver)
            for layout in args.layouts.split(",")
            for saver in args.savers.split(",")
            if not (LAYOUTS[layout][0] > 1 and SAVERS[saver][3])  # sharded dp: not with pp
        ]
    )
    for layout, saver in runs:
        ranks = run_ranks(_worker, 4, layout, saver, args.layers, args.hidden, args.seq)
        results[f"{layout}/{saver}"] = ranks
        total = ranks[0]["total_params_bytes"]
        print(f"{layout}, {saver} (model {total / 4e6:.0f} M parameters):", flush=True)
        for r in ranks:
            static = r["params"] + r["grads"] + r["optimizer"]
            ideal = 2 * r["ideal_params"] + r["ideal_optimizer"]
            line = (
                f"  rank {r['rank']}: params {r['params'] / 2**20:7.1f} MiB, grads "
                f"{r['grads'] / 2**20:7.1f} MiB, optimizer {r['optimizer'] / 2**20:7.1f} MiB"
                f" = {static / ideal:.3f} x the ideal share; peak RSS "
                f"{r['peak_rss'] / 2**30:.2f} GiB"
            )
            if r["block_boundaries"]:
                line += (
                    f"; kept per microbatch {r['kept_per_microbatch'] / 2**20:.1f} MiB = "
                    f"{r['kept_per_microbatch'] / r['block_boundaries']:.3f} x the block "
                    "boundaries"
                )
            print(line, flush=True)
        shares = [r["construction_peak_above_baseline"] / r["params"] for r in ranks if r["params"]]
        print(
            "  building, wrapping and partitioning (to the partition's end): peak resident "
            "memory above the process's before construction = "
            + ", ".join(f"{x:.2f}" for x in shares)
            + " x each rank's parameter share",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
