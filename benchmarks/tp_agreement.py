"""What the TP ranks' agreement on a region's arguments costs (smp/tp/agreement.py, design.md §6.3).

Two gloo processes on CPU (one thread each), tp = 2, a Hugging Face Llama whose decoder layers are
split over the TP group (smp's default batch semantics: each rank brings its own samples):

  1. per region call, for the arguments a Llama decoder layer receives (hidden states, mask,
     rotary embeddings, position ids, the key/value cache, use_cache): the agreement as built
     (describe the arguments, hash them, all-gather 16 bytes), its local part alone (describe and
     hash), and a bare all-gather of 16 bytes; the bytes it sends, counted by a CountingGroup;
  2. per training step: smp as built, and with the agreement skipped (a measurement only: the
     ranks are assumed to agree), both ranks' batches with padding (the agreed path);
  3. the same step with padding on one rank only: each layer runs each rank's arguments in turn.

    .venv/bin/python benchmarks/tp_agreement.py [--calls 2000] [--steps 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, timed  # noqa: E402

SIZES = dict(layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vocab=512, seq=128)
BATCH = 4  # samples per rank


def _model():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=SIZES["vocab"],
        hidden_size=SIZES["hidden"],
        intermediate_size=SIZES["intermediate"],
        num_hidden_layers=SIZES["layers"],
        num_attention_heads=SIZES["heads"],
        num_key_value_heads=SIZES["kv_heads"],
        max_position_embeddings=SIZES["seq"],
    )
    return transformers.LlamaForCausalLM(config)


def _batch(seed: int, padded: bool):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SIZES["vocab"], (BATCH, SIZES["seq"]), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1:, -SIZES["seq"] // 4 :] = 0
    return ids, mask, torch.where(mask.bool(), ids, torch.full_like(ids, -100))


def _per_call(seconds: float, calls: int) -> float:
    return seconds / calls * 1e6


def _bench(rank: int, calls: int, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    import smp
    from smp import _C
    from smp.tp import agreement as tp_agreement
    from smp.tp import region

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    smp.init({"tensor_parallel_degree": 2})
    torch.manual_seed(0)
    original = _model()
    model = copy.deepcopy(original)
    for layer in model.model.layers:
        smp.set_tensor_parallelism(layer)
    model = smp.DistributedModel(model)
    layer = model.module.model.layers[0]

    # The arguments of a decoder layer, as Hugging Face passes them.
    seen = {}
    hook = original.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.update(args=a, kwargs=kw), with_kwargs=True
    )
    ids, mask, _ = _batch(rank, padded=True)
    with torch.no_grad():
        original(input_ids=ids, attention_mask=mask)
    hook.remove()
    args, kwargs = seen["args"], seen["kwargs"]

    out = {}
    group = smp.get_tp_process_group()
    digest = tp_agreement._Call.describe(layer, args, kwargs).digest()
    for name, call in (
        ("describe and hash", lambda: tp_agreement._Call.describe(layer, args, kwargs).digest()),
        ("all-gather of 16 bytes", lambda: tp_agreement._exchange(group, digest)),
        (
            "agreement as built",
            lambda: tp_agreement._agree(layer, tp_agreement._Call.describe(layer, args, kwargs)),
        ),
    ):
        for _ in range(calls // 10):
            call()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        dist.barrier()
        out[name] = _per_call(time.perf_counter() - start, calls)

    counting = _C.CountingGroup(group)
    counted = types.SimpleNamespace(tp_group=counting.group, tp_size=2, tp_rank=rank)
    tp_agreement._agree(counted, tp_agreement._Call.describe(layer, args, kwargs))
    out["bytes"] = counting.counts()
    out["spec bytes"] = len(pickle.dumps(tp_agreement._Call.describe(layer, args, kwargs).spec))

    @smp.step
    def train_step(model, ids, mask, labels):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        model.backward(loss)
        return loss

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(ids, mask, labels):
        optimizer.zero_grad()
        train_step(model, ids, mask, labels)
        optimizer.step()

    agree = region._agree  # what run_region calls (imported there from smp.tp.agreement)
    variants = {
        "agreed (padding on both ranks)": (True, agree),
        "agreement skipped (padding on both ranks)": (True, lambda module, mine: None),
        "in turn (padding on rank 0 only)": (False, agree),
    }
    best = {}
    for _ in range(rounds):
        for name, (both, agreement) in variants.items():
            region._agree = agreement
            batches = [_batch(100 * s + rank, both or rank == 0) for s in range(steps + 2)]
            seconds = timed(step, batches, warmup=2) / steps
            best[name] = min(best.get(name, seconds), seconds)
    region._agree = agree
    out["steps"] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    result = run_ranks(_bench, 2, ns.calls, ns.steps, ns.rounds)
    print(
        f"tp 2 (gloo, CPU, 1 thread each); Llama {SIZES['layers']} layers, hidden "
        f"{SIZES['hidden']}, seq {SIZES['seq']}, {BATCH} samples per rank"
    )
    print("per region call (a Llama decoder layer's arguments):")
    for name in ("describe and hash", "all-gather of 16 bytes", "agreement as built"):
        print(f"  {name:<28} {result[name]:8.1f} us")
    print(f"  collectives of one agreed call: {result['bytes']} (op: (calls, input bytes))")
    print(f"  description sent when the ranks differ: {result['spec bytes']} bytes per rank")
    print(f"per training step ({SIZES['layers']} regions), best of the rounds:")
    base = result["steps"]["agreement skipped (padding on both ranks)"]
    for name, seconds in result["steps"].items():
        print(f"  {name:<44} {seconds * 1e3:8.1f} ms   {seconds / base:.3f}x")


if __name__ == "__main__":
    main()
