"""Partition quality and speed.

Quality: GPT-2-, BERT- and Llama-shaped models (12–96 layers, built on the meta device: no
weights are allocated) are traced and partitioned by smp for p ∈ {2, 4, 8}. For each case the
benchmark prints the maximum stage cost of

  - smp's plan,
  - equal parameter counts per stage (cut where the cumulative parameter share crosses k/p),
  - equal layer counts per stage (what users hand-write today),

each divided by the optimum: the exact min-max contiguous partition of the same node sequence
(execution order) under the same costs, computed by dynamic programming. Target: smp ≤ 1.05.

Speed: runs the C++ benchmark (build/smp_partition_bench) on random trees of 1k–100k nodes.

    .venv/bin/python benchmarks/partition.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import smp  # noqa: E402
from smp import _C  # noqa: E402

# ---- model shapes ---------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, d, heads, fused):
        super().__init__()
        self.heads = heads
        if fused:
            self.c_attn = nn.Linear(d, 3 * d)
        else:
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d)

    def forward(self, x):
        if hasattr(self, "c_attn"):
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t, d = x.shape
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(d), dim=-1)
        return self.o_proj((att @ split(v)).transpose(1, 2).reshape(b, t, d))


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads, kind):
        super().__init__()
        norm = RMSNorm if kind == "llama" else nn.LayerNorm
        self.ln_1, self.ln_2 = norm(d), norm(d)
        self.attn = Attention(d, heads, fused=kind == "gpt2")
        if kind == "llama":
            hidden = int(8 * d / 3)
            self.gate, self.up, self.down = (
                nn.Linear(d, hidden),
                nn.Linear(d, hidden),
                nn.Linear(hidden, d),
            )
        else:
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.kind = kind

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        if self.kind == "llama":
            return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        return x + self.proj(torch.nn.functional.gelu(self.fc(h)))


class LM(nn.Module):
    def __init__(self, kind, layers, d, heads, vocab, seq):
        super().__init__()
        self.kind = kind
        self.wte = nn.Embedding(vocab, d)
        if kind != "llama":
            self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads, kind) for _ in range(layers))
        self.ln_f = RMSNorm(d) if kind == "llama" else nn.LayerNorm(d)
        if kind == "bert":
            self.pooler = nn.Linear(d, d)
        else:
            self.lm_head = nn.Linear(d, vocab, bias=False)
            if kind == "gpt2":
                self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids):
        x = self.wte(ids)
        if self.kind != "llama":
            x = x + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return torch.tanh(self.pooler(x[:, 0])) if self.kind == "bert" else self.lm_head(x)


SHAPES = {
    "gpt2": dict(d=768, heads=12, vocab=50257, seq=1024),
    "bert": dict(d=768, heads=12, vocab=30522, seq=512),
    "llama": dict(d=2048, heads=16, vocab=32000, seq=2048),
}

# ---- baselines --------------------------------------------------------------------------------


def _max_stage_cost(costs: list[float], stages: list[int], p: int) -> float:
    load = [0.0] * p
    for c, s in zip(costs, stages):
        load[s] += c
    return max(load)


def equal_params(plan, p: int) -> list[int]:
    total = sum(plan.node_param_bytes) or 1.0
    stages, seen = [], 0.0
    for b in plan.node_param_bytes:
        stages.append(min(p - 1, int(p * (seen + b / 2) / total)))
        seen += b
    return stages


def equal_layers(plan, p: int, layers: int) -> list[int]:
    stages, current = [], 0
    for name in plan.node_names:
        head = name.split(" + ")[0]
        parts = head.split(".")
        if len(parts) >= 2 and parts[0] == "h" and parts[1].isdigit():
            current = min(p - 1, int(parts[1]) * p // layers)
        stages.append(current)
    return stages


def quality(layer_counts, stage_counts) -> list[dict]:
    rows = []
    for kind, shape in SHAPES.items():
        for layers in layer_counts:
            with torch.device("meta"):
                model = LM(kind, layers, **shape)
            ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
            for p in stage_counts:
                plan = smp.plan_partition(model, ids, p)
                costs = plan.node_costs
                optimum = _max_stage_cost(costs, _C.optimal_contiguous_partition(costs, p), p)
                row = dict(
                    model=kind,
                    layers=layers,
                    stages=p,
                    smp=max(plan.stage_cost) / optimum,
                    equal_params=_max_stage_cost(costs, equal_params(plan, p), p) / optimum,
                    equal_layers=_max_stage_cost(costs, equal_layers(plan, p, layers), p) / optimum,
                )
                rows.append(row)
                print(
                    f"{kind:>6} {layers:>3} layers  p={p}  smp {row['smp']:.3f}   "
                    f"equal params {row['equal_params']:.3f}   "
                    f"equal layers {row['equal_layers']:.3f}",
                    flush=True,
                )
    return rows


def speed() -> str:
    for candidate in (
        ROOT / "build" / "smp_partition_bench",
        ROOT / "build-core" / "smp_partition_bench",
    ):
        if candidate.exists():
            return subprocess.run(
                [str(candidate)], check=True, capture_output=True, text=True
            ).stdout
    return "smp_partition_bench not built (run make build)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print("max stage cost / optimum of the exact contiguous partition (1.000 is optimal)")
    rows = quality(args.layers, args.stages)
    worst = max(r["smp"] for r in rows)
    print(f"worst smp ratio: {worst:.3f} (target <= 1.05)")
    print("\nC++ partitioning time on random trees:")
    timing = speed()
    print(timing)
    if args.json:
        args.json.write_text(json.dumps({"quality": rows, "timing": timing}, indent=2))


if __name__ == "__main__":
    main()
