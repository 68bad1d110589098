"""Partition quality, crossings and speed.

Quality: GPT-2-, BERT- and Llama-shaped models (12–96 layers, built on the meta device: no
weights are allocated) are traced and partitioned by smp for p ∈ {2, 4, 8} with crossings not
priced (the guarantee on compute balance). For each case the benchmark prints the maximum stage
cost of

  - smp's plan,
  - equal parameter counts per stage (cut where the cumulative parameter share crosses k/p),
  - equal layer counts per stage (what users hand-write today),

each divided by the optimum: the exact min-max contiguous partition of the same node sequence
(execution order) under the same costs, computed by dynamic programming. Target: smp ≤ 1.05.

Crossings: unmodified Hugging Face GPT-2, Llama and BERT (built from configs, on the meta device
or small on the CPU: nothing is downloaded) are partitioned for p ∈ {2, 4} with crossings free
(the plan before they were priced) and priced (smp's default: the partitioner's CrossingCosts);
the meta-device shapes also at an assumed accelerator rate of 100 TFLOP/s.
For each plan: the decoder/encoder layers cut inside, where the layer-level cuts fall, the
crossings per pair of stages per microbatch (calls, forward and backward bytes), the imbalance
(max/mean stage cost) and the largest stage load (cost + crossings).

Speed: runs the C++ benchmark (build/smp_partition_bench) on random trees of 1k–100k nodes.

    .venv/bin/python benchmarks/partition.py [--json out.json] [--skip-quality]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from smp.partitioning.plan import (  # noqa: E402
    CrossingCosts,
    _build_nodes,
    _core_calls,
    _core_nodes,
    _seconds_per_compute,
    build_plan,
)
from smp.partitioning.trace import trace_modules  # noqa: E402

FREE = CrossingCosts(priced=False)

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
                plan = smp.plan_partition(model, ids, p, crossing_costs=FREE)
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


# ---- crossings on Hugging Face models ---------------------------------------------------------


def _hf_models() -> dict:
    """name -> (build, layer prefix, device). The CPU models are small enough to run here (the
    first is the issue's Llama: 8 layers, hidden 256); the meta ones have the published shapes."""
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    def llama(layers, hidden, inter, heads, vocab):
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=inter,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
            )
        )

    def gpt2(**kw):
        return GPT2LMHeadModel(GPT2Config(**kw))

    def bert(**kw):
        return BertForMaskedLM(BertConfig(**kw))

    small = dict(bos_token_id=0, eos_token_id=0, vocab_size=1000)
    return {
        "llama 8x256 (cpu)": (lambda: llama(8, 256, 688, 8, 1000), "model.layers", "cpu"),
        "gpt2 8x256 (cpu)": (
            lambda: gpt2(n_layer=8, n_embd=256, n_head=8, **small),
            "transformer.h",
            "cpu",
        ),
        "bert 8x256 (cpu)": (
            lambda: bert(
                num_hidden_layers=8,
                hidden_size=256,
                num_attention_heads=8,
                intermediate_size=1024,
                vocab_size=1000,
            ),
            "bert.encoder.layer",
            "cpu",
        ),
        "gpt2 12x768 (meta)": (lambda: gpt2(), "transformer.h", "meta"),
        "llama 16x2048 (meta)": (lambda: llama(16, 2048, 5504, 16, 32000), "model.layers", "meta"),
        "bert 12x768 (meta)": (lambda: bert(), "bert.encoder.layer", "meta"),
    }


def _layer_cuts(plan, prefix: str) -> tuple[list[int], list[int]]:
    """Layers whose modules span several stages, and each layer's stage (its own module's)."""
    layers: dict[int, set[int]] = {}
    for path, stage in plan.assignment.items():
        if path.startswith(prefix + "."):
            index = path[len(prefix) + 1 :].split(".")[0]
            if index.isdigit():
                layers.setdefault(int(index), set()).add(stage)
    split = [i for i, stages in sorted(layers.items()) if len(stages) > 1]
    return split, [plan.assignment[f"{prefix}.{i}"] for i in sorted(layers)]


def _boundaries(stages: list[int]) -> str:
    """Layer stages [0, 0, 1, 1] -> "0-1 | 2-3"."""
    runs, start = [], 0
    for i in range(1, len(stages) + 1):
        if i == len(stages) or stages[i] != stages[start]:
            runs.append(f"{start}-{i - 1}" if i - 1 > start else f"{start}")
            start = i
    return " | ".join(runs)


def _priced_load(model, traces, plan, costs: CrossingCosts, memory_weight: float) -> float:
    """The largest stage load of ``plan`` with crossings priced by ``costs``: the core evaluates
    the plan with every node pinned where it is."""
    nodes, node_of_path = _build_nodes(model, traces, False, None)
    core_nodes = _core_nodes(nodes, list(plan.node_stages))
    options = _C.PartitionOptions(
        num_stages=plan.num_stages,
        memory_weight=memory_weight,
        seconds_per_compute=_seconds_per_compute(model, costs, True, False),
        crossing_latency=costs.latency_s,
        bandwidth=costs.bandwidth,
    )
    return _C.partition(core_nodes, options, _core_calls(traces, node_of_path)).max_stage_load


def crossings(stage_counts, batch: int = 4, seq: int = 128) -> list[dict]:
    memory_weight = 0.2  # smp's default (optimize="speed")
    variants = {"free": FREE, "priced": CrossingCosts()}
    rows = []
    for name, (build, prefix, device) in _hf_models().items():
        torch.manual_seed(0)
        with torch.device(device):
            model = build()
        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        traces = trace_modules(model, lambda model=model, ids=ids: model(ids))
        models = {name: variants}
        if device == "meta":  # the same shapes planned for an accelerator (assumed rate)
            models[name.replace("(meta)", "(meta, 100 TFLOP/s)")] = {
                "free": CrossingCosts(priced=False, flops_per_second=1e14),
                "priced": CrossingCosts(flops_per_second=1e14),
            }
        for label, costs_by_variant in models.items():
            for p in stage_counts:
                print(f"{label}  p={p}", flush=True)
                for variant, costs in costs_by_variant.items():
                    plan = build_plan(model, p, traces, memory_weight, crossing_costs=costs)
                    priced = dataclasses.replace(costs, priced=True)
                    load = _priced_load(model, traces, plan, priced, memory_weight)
                    split, stages = _layer_cuts(plan, prefix)
                    row = dict(
                        model=label,
                        stages=p,
                        crossings=variant,
                        layers_cut=split,
                        layer_stages=stages,
                        imbalance=plan.imbalance,
                        max_stage_load=load,
                        links=[dataclasses.asdict(link) for link in plan.links],
                    )
                    rows.append(row)
                    links = "; ".join(
                        f"{a}-{b}: {link.calls:g} calls, {link.forward_bytes / 2**20:.1f} + "
                        f"{link.backward_bytes / 2**20:.1f} MiB"
                        for link in plan.links
                        for a, b in [link.stages]
                    )
                    print(
                        f"  crossings {variant:>6}: layers cut inside {len(split)}"
                        f"{' ' + str(split) if split else ''}, layers per stage "
                        f"{_boundaries(stages)}, imbalance {plan.imbalance:.3f}, largest load "
                        f"{load:.3f}\n{'':>20}{links}",
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
    parser.add_argument("--crossing-stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    rows = []
    if not args.skip_quality:
        print(
            "max stage cost / optimum of the exact contiguous partition (1.000 is optimal), "
            "crossings free"
        )
        rows = quality(args.layers, args.stages)
        worst = max(r["smp"] for r in rows)
        print(f"worst smp ratio: {worst:.3f} (target <= 1.05)\n")
    print(
        "Hugging Face models, microbatch 4 x 128 tokens: crossings free (the plan before) and "
        "priced (smp's default). Per microbatch and pair of stages: calls, forward + backward "
        "MiB (a call is a round trip in forward and another in backward). Largest load: stage "
        "cost + crossings, priced, for both plans."
    )
    cross = crossings(args.crossing_stages)
    print("\nC++ partitioning time on random trees:")
    timing = speed()
    print(timing)
    if args.json:
        args.json.write_text(
            json.dumps({"quality": rows, "crossings": cross, "timing": timing}, indent=2)
        )


if __name__ == "__main__":
    main()
