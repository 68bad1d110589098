"""Tensor-parallel throughput, bytes and memory: smp against torch.distributed.tensor.parallel.

Two gloo processes on CPU (one thread each) train the same GPT-like language model at tp = 2:

  - smp: ``smp.nn.DistributedTransformerLMHead`` (vocab-parallel embedding and cross-entropy,
    column/row-parallel attention and MLP), ``optimize="speed"`` and ``"memory"``, with the TP
    ranks sharing one batch (``prescaled_batch=True``, Megatron's semantics) and with smp's
    default (each rank brings half of the group's batch);
  - torch: the same architecture in plain PyTorch, parallelised with ``parallelize_module``:
    ColwiseParallel for Q, K, V and MLP-in, RowwiseParallel for attention-out and MLP-out, a
    RowwiseParallel embedding and a ColwiseParallel output projection with ``loss_parallel``.

Every variant processes the same number of samples per step per TP group. Reported: samples/s
and the ratio to torch; the bytes each layer communicates per rank (ring algorithm model,
measured by a CountingGroup around smp's TP group) against Megatron's minimum (two all-reduces
of the activations per layer forward, two backward); per-rank parameter bytes against the
unsharded model.

    .venv/bin/python benchmarks/tensor_parallel.py [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, smp_training, timed  # noqa: E402

SIZES = dict(layers=4, heads=8, hidden=512, intermediate=2048, vocab=8192, seq=128)


# ---- the torch model --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln1(x)

        def heads(t):  # local heads: -1 adapts to the shard
            return t.view(b, s, -1, t.size(-1) // (self.local_heads())).transpose(1, 2)

        q, k, v = heads(self.q(y)), heads(self.k(y)), heads(self.v(y))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(ctx.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def local_heads(self) -> int:
        return getattr(self, "_local_heads", self.heads)


class TorchLM(nn.Module):
    def __init__(self, layers, heads, hidden, intermediate, vocab, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, intermediate) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _torch_tp(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = TorchLM(**SIZES)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in enumerate(model.blocks):
        block._local_heads = SIZES["heads"] // world
        for name in ("q", "k", "v", "fc1"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("o", "fc2"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids, labels):
        opt.zero_grad()
        logits = model(ids)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        opt.step()

    params = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    return step, params


# ---- smp --------------------------------------------------------------------------------------


def _smp_model(optimize: str, group=None):
    from smp.nn import DistributedTransformerLMHead

    torch.manual_seed(0)
    s = SIZES
    return DistributedTransformerLMHead(
        num_layers=s["layers"], num_attention_heads=s["heads"],
        attention_head_size=s["hidden"] // s["heads"], hidden_size=s["hidden"],
        intermediate_size=s["intermediate"], vocab_size=s["vocab"], num_positions=s["seq"],
        attention_dropout_prob=0.0, hidden_dropout_prob=0.0, embedding_dropout_prob=0.0,
        causal_mask_size=s["seq"], optimize=optimize, group=group,
    )  # fmt: skip


def _smp_step(optimize: str):
    model, step = smp_training(
        _smp_model(optimize), lambda model, ids, labels: model(ids, labels=labels).mean(), 1e-4
    )
    return step, sum(p.numel() for p in model.parameters())


def _bytes_per_layer(optimize: str, batch: int, world: int) -> dict:
    """Ring-model bytes one rank sends per layer (forward + backward), from counted ops."""
    import smp
    from smp import _C
    from smp.nn import DistributedTransformer

    counting = _C.CountingGroup(smp.get_tp_process_group())
    s = SIZES
    totals = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = DistributedTransformer(
            num_layers=layers, num_attention_heads=s["heads"],
            attention_head_size=s["hidden"] // s["heads"], hidden_size=s["hidden"],
            intermediate_size=s["intermediate"], attention_dropout_prob=0.0,
            hidden_dropout_prob=0.0, causal_mask_size=s["seq"], optimize=optimize,
            group=counting.group,
        )  # fmt: skip
        x = torch.randn(batch, s["seq"], s["hidden"], requires_grad=True)
        counting.reset()
        model(x).sum().backward()
        sent = 0.0
        for kind, (_, nbytes) in counting.counts().items():
            if kind == "allreduce":
                sent += 2 * (world - 1) / world * nbytes
            elif kind == "_allgather_base":
                sent += (world - 1) * nbytes  # input is this rank's shard
            elif kind == "_reduce_scatter_base":
                sent += (world - 1) / world * nbytes
        totals[layers] = sent
    return totals[2] - totals[1]


def _worker(rank: int, world: int, steps: int, batch: int, rounds: int) -> dict:
    import smp

    warmup = 2
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(
        0, SIZES["vocab"], (steps + warmup, batch, SIZES["seq"] + 1), generator=g
    )
    shared = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    half = batch // world
    own = [
        (ids[rank * half : (rank + 1) * half], lab[rank * half : (rank + 1) * half])
        for ids, lab in shared
    ]

    # Each smp variant alternates with torch, round by round, so drift in machine load hits
    # both alike; torch keeps its best over all rounds (which only favours torch).
    variants = {}
    torch_step, torch_params = _torch_tp(rank, world)
    torch_seconds = float("inf")
    for optimize in ("speed", "memory"):
        for prescaled in (True, False):
            smp.init(
                {
                    "tensor_parallel_degree": world,
                    "optimize": optimize,
                    "prescaled_batch": prescaled,
                }
            )
            step, smp_params = _smp_step(optimize)
            label = f"smp {optimize:6s} " + ("(same batch)" if prescaled else "(own samples)")
            seconds = float("inf")
            for _ in range(rounds):
                seconds = min(seconds, timed(step, shared if prescaled else own, warmup))
                torch_seconds = min(torch_seconds, timed(torch_step, shared, warmup))
            variants[label] = seconds
            smp.shutdown()
    variants["torch TP (same batch on both ranks)"] = torch_seconds

    smp.init({"tensor_parallel_degree": world})
    # smp's default semantics: each rank brings batch / world samples, the group batch is `batch`.
    nbytes = {m: _bytes_per_layer(m, batch // world, world) for m in ("speed", "memory")}
    smp.shutdown()
    activation = batch * SIZES["seq"] * SIZES["hidden"] * 4
    megatron = 2 * 2 * (2 * (world - 1) / world * activation)  # 2 all-reduces fwd + 2 bwd
    torch_full = sum(p.numel() for p in TorchLM(**SIZES).parameters())
    smp_full = torch_full - SIZES["vocab"] * SIZES["hidden"]  # smp's head is tied to the embedding
    samples = steps * batch
    return {
        "samples_per_s": {k: samples / v for k, v in variants.items()},
        "bytes_per_layer": nbytes,
        "megatron_min_bytes_per_layer": megatron,
        "param_bytes_per_rank": {"smp": smp_params * 4, "torch": torch_params * 4},
        "param_bytes_unsharded": {"smp": smp_full * 4, "torch": torch_full * 4},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="samples per TP group per step")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds, best kept")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    r = run_ranks(_worker, 2, 2, args.steps, args.batch, args.rounds)
    s = SIZES
    print(
        f"tp 2 (gloo, CPU, 1 thread each); LM {s['layers']} layers, hidden {s['hidden']}, "
        f"vocab {s['vocab']}, seq {s['seq']}; {args.batch} samples per step per TP group"
    )
    torch_rate = r["samples_per_s"]["torch TP (same batch on both ranks)"]
    for label, rate in r["samples_per_s"].items():
        print(f"  {label:38s} {rate:7.2f} samples/s   {rate / torch_rate:5.3f}x torch")
    mb = 1 / 2**20
    print(
        f"bytes sent per rank per layer (fwd+bwd, ring model); Megatron minimum "
        f"{r['megatron_min_bytes_per_layer'] * mb:.2f} MiB"
    )
    for mode, nbytes in r["bytes_per_layer"].items():
        print(
            f"  {mode:6s} {nbytes * mb:7.2f} MiB   "
            f"{nbytes / r['megatron_min_bytes_per_layer']:.3f}x minimum"
        )
    for who, nbytes in r["param_bytes_per_rank"].items():
        unsharded = r["param_bytes_unsharded"][who]
        print(
            f"parameters per rank, {who:5s} {nbytes * mb:7.2f} MiB  "
            f"({nbytes / unsharded:.3f} of the unsharded {unsharded * mb:.2f} MiB)"
        )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
