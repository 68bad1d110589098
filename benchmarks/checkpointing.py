"""Activation checkpointing on the demo GPT in one process: smp's against torch's own
``torch.utils.checkpoint`` (non-reentrant) on the same blocks.

Reports, per round (rounds alternate plain / torch / smp): seconds per training step; then the
recompute cost of each (checkpointed step time minus the plain step time, medians) and smp's
cost over torch's (target <= 1.05), and the activation bytes each keeps per step: the tensors
saved for backward outside the checkpointed blocks plus the inputs a checkpointed block keeps,
against the block-boundary tensors (one B x T x C tensor per block; target <= 1.1).

    .venv/bin/python benchmarks/checkpointing.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

from model import GPT, GPTConfig, lm_loss  # noqa: E402

import smp  # noqa: E402
from smp.memory import activations  # noqa: E402


def _torch_checkpointed(model: GPT) -> GPT:
    for block in model.h:
        forward = block.forward
        block.forward = lambda x, f=forward: torch.utils.checkpoint.checkpoint(
            f, x, use_reentrant=False
        )
    return model


def _kept_bytes(model: GPT, ids: torch.Tensor) -> tuple[int, int]:
    """Bytes kept for backward by one forward: tensors saved outside checkpointed regions
    (through an outer saved-tensor hook: torch's checkpoint saves its inputs there too) plus
    the inputs smp's frames keep; and the frames' part alone."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    frames = []
    original = activations.Frame.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        frames.append(self)

    activations.Frame.__init__ = record
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    finally:
        activations.Frame.__init__ = original
    in_frames: dict[int, int] = {}
    for frame in frames:
        for t in activations.tree.tensors(frame.inputs):
            in_frames[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    del loss
    return sum({**seen, **in_frames}.values()), sum(in_frames.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4,
                    n_embd=args.width, dropout=0.1)  # fmt: skip
    base = GPT(cfg)
    models = {"plain": copy.deepcopy(base), "torch": _torch_checkpointed(copy.deepcopy(base))}
    models["smp"] = copy.deepcopy(base)
    smp.set_activation_checkpointing(models["smp"].h)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1))

    def step(model):
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    for model in models.values():
        step(model)  # warm up
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.rounds):
        row = []
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model)
            times[name].append((time.perf_counter() - start) / args.steps)
            row.append(f"{name} {times[name][-1]:.3f} s")
        print(f"round {r}: " + ", ".join(row), flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    cost = {k: median[k] - median["plain"] for k in ("torch", "smp")}
    measured = {k: _kept_bytes(m, ids) for k, m in models.items()}
    kept = {k: v[0] for k, v in measured.items()}
    blocks_kept = measured["smp"][1]
    boundary = args.layers * args.batch * args.seq * args.width * 4
    result = {
        "median_step_s": median,
        "recompute_cost_s": cost,
        "smp_cost_over_torch": cost["smp"] / cost["torch"] if cost["torch"] > 0 else None,
        "kept_bytes": kept,
        "block_boundary_bytes": boundary,
        "smp_block_inputs_bytes": blocks_kept,
        "smp_block_inputs_over_boundaries": blocks_kept / boundary,
        "smp_kept_over_torch": kept["smp"] / kept["torch"],
        "config": vars(args),
    }
    print(f"median step: plain {median['plain']:.3f} s, torch checkpoint {median['torch']:.3f} s, "
          f"smp {median['smp']:.3f} s")  # fmt: skip
    print(f"recompute cost: torch {cost['torch']:.3f} s, smp {cost['smp']:.3f} s, "
          f"smp / torch = {result['smp_cost_over_torch']:.3f}")  # fmt: skip
    print(f"activation bytes kept per step: plain {kept['plain'] / 2**20:.1f} MiB, torch "
          f"{kept['torch'] / 2**20:.1f} MiB, smp {kept['smp'] / 2**20:.1f} MiB; block "
          f"boundaries {boundary / 2**20:.1f} MiB")  # fmt: skip
    print(f"kept by smp's checkpointed blocks: {blocks_kept / 2**20:.2f} MiB = "
          f"{blocks_kept / boundary:.3f} x the block boundaries (the rest is the embedding and "
          "the head, not checkpointed)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
