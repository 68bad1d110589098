"""An unmodified Hugging Face Llama through smp's pipeline against torch.distributed.pipelining.

The model as a new user builds it: ``LlamaForCausalLM`` from a config (8 layers, hidden 256,
FFN 704, 8 heads / 4 KV heads, vocabulary 4096, untied head, every other setting the default),
trained with ``model(input_ids=x, labels=x).loss`` (the loss in the root's forward) at p = 2,
m = 8 microbatches of 2 x 128 tokens, one gloo process per stage with one thread each, AdamW.
torch runs ``Schedule1F1B`` over hand-written stages of the same modules (embedding, the
rotary embedding and the causal mask on each stage, the layers, norm + head + loss on the last)
cut at the layer where smp's partition puts most of the cut. Rounds alternate: smp's default,
smp's static ZB-H1, torch; each round also times every stage's forward + backward alone
(all stages at once), from which the round's ideal m/(m+p-1) is computed.

Also reported, per microbatch: the bytes that cross between the stages in smp's step (both
directions, the transport's tensors) and in torch's (the activations and their gradients).

    .venv/bin/python benchmarks/pipeline_hf_llama.py [--steps 4] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, timed  # noqa: E402

MICRO, SEQ, M, P = 2, 128, 8, 2
BATCH = MICRO * M
VOCAB, HIDDEN = 4096, 256
CONFIG_OVERRIDES: dict = {}  # --no-cache: {"use_cache": False}
VARIANTS = {"default": {}, "static_zbh1": {"pipeline": "static", "pipeline_schedule": "zbh1"}}
LABELS = {
    "default": "smp, default",
    "static_zbh1": "smp, static ZB-H1 program",
    "torch": "torch.distributed.pipelining 1F1B",
}


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=False, **CONFIG_OVERRIDES,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _data(steps: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),) for _ in range(steps)]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What LlamaForCausalLM computes from ``labels=ids``: next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


class _Stage(nn.Module):
    """Layers [lo, hi) of the Llama; the embedding first, the norm and head last. Every stage
    computes the rotary embedding and the causal mask of its input, as LlamaModel does."""

    def __init__(self, llama, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = llama.model
        self.config = llama.config
        self.first, self.last = first, last
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm, self.head = (inner.norm, llama.lm_head) if last else (None, None)

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        h = self.embed(x) if self.first else x
        positions = torch.arange(h.size(1)).unsqueeze(0)
        mask = create_causal_mask(self.config, h, None, None, position_ids=positions)
        rotary = self.rotary(h, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return self.head(self.norm(h)) if self.last else h


def _cut() -> tuple[int, dict]:
    """The first layer of stage 1 in smp's partition (a layer whose modules straddle the cut
    goes where its own module is assigned), and how smp placed the layers."""
    import smp

    smp.init({"pipeline_parallel_degree": P, "microbatches": M})
    model = smp.DistributedModel(_llama())

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    train_step(model, *_data(1)[0])
    assignment = model.partition_plan.assignment
    smp.shutdown()
    stages = [assignment[f"model.layers.{i}"] for i in range(8)]
    split = sorted(path for path, s in assignment.items() if path.startswith("model.layers."))
    straddling = sorted(
        {p.split(".")[2] for p in split if assignment[p] != assignment[".".join(p.split(".")[:3])]}
    )
    return stages.index(1), {"layers": stages, "straddling_layers": straddling}


def _bytes_sent(step, batch) -> int:
    """Bytes of the tensors this rank's pipeline sends to other stages in one step."""
    from smp.pipeline.sender import Sender

    sent = [0]
    original = Sender.send

    def send(self, peer, header, tensors, wait=False):
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        return original(self, peer, header, tensors, wait)

    Sender.send = send
    try:
        step(*batch)
    finally:
        Sender.send = original
    return sent[0]


def _worker(rank: int, steps: int, rounds: int, overrides: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import smp

    CONFIG_OVERRIDES.update(overrides)
    warmup = 2
    data = _data(steps + warmup)
    cut, placement = _cut()

    def smp_runner(options: dict):
        smp.init({"pipeline_parallel_degree": P, "microbatches": M, **options})
        model = smp.DistributedModel(_llama())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(model, ids):
            loss = model(input_ids=ids, labels=ids).loss
            model.backward(loss)
            return loss

        def smp_step(ids):
            opt.zero_grad()
            train_step(model, ids)
            opt.step()

        return smp_step

    llama = _llama()
    bounds = [(0, cut), (cut, 8)]
    stage_module = _Stage(llama, *bounds[rank], rank == 0, rank == P - 1)
    stage = PipelineStage(stage_module, rank, P, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=_loss)
    torch_opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    def torch_step(ids):
        torch_opt.zero_grad()
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])
        torch_opt.step()

    rounds_s: dict[str, list[float]] = {name: [] for name in (*VARIANTS, "torch")}
    alone_s: list[float] = []
    smp_bytes = 0
    for _ in range(rounds):
        for name, options in VARIANTS.items():
            step = smp_runner(options)
            rounds_s[name].append(timed(step, data, warmup))
            if name == "default" and not smp_bytes:  # one more step, counted
                smp_bytes = _bytes_sent(step, data[0]) / M
            smp.shutdown()
        rounds_s["torch"].append(timed(torch_step, data, warmup))
        alone_s.append(_stage_alone(stage_module, rank, data[0][0]))
    stages_alone = [None] * P
    dist.all_gather_object(stages_alone, alone_s)
    all_bytes = [None] * P
    dist.all_gather_object(all_bytes, smp_bytes)
    activation = MICRO * SEQ * HIDDEN * 4  # what crosses in torch's step, each way
    return {
        "cut": cut,
        "placement": placement,
        "rounds_seconds": rounds_s,
        "stages_alone_s": [list(r) for r in zip(*stages_alone)],  # [round][stage]
        "smp_bytes_per_microbatch": sum(all_bytes),
        "torch_bytes_per_microbatch": 2 * activation,
    }


def _stage_alone(module: nn.Module, rank: int, ids: torch.Tensor, pieces: int = 2 * M) -> float:
    """Median seconds of one microbatch's forward + backward of this stage alone (all stages
    at once, each on its own core)."""
    x = ids[:MICRO]
    hidden = torch.randn(MICRO, SEQ, HIDDEN, generator=torch.Generator().manual_seed(rank))
    times = []
    dist.barrier()
    for i in range(pieces + 1):
        start = time.perf_counter()
        out = module(x if rank == 0 else hidden.clone().requires_grad_())
        (_loss(out, x) if rank == P - 1 else out.sum()).backward()
        if i:
            times.append(time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    dist.barrier()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="use_cache=False (the default config keeps HF's use_cache=True, as users leave it)",
    )
    args = parser.parse_args()
    overrides = {"use_cache": False} if args.no_cache else {}
    r = run_ranks(_worker, P, args.steps, args.rounds, overrides)
    samples = args.steps * BATCH
    rounds = r["rounds_seconds"]
    ideal = [samples / (args.steps * (M + P - 1) * max(alone)) for alone in r["stages_alone_s"]]
    of_ideal = {name: [samples / t / i for t, i in zip(rounds[name], ideal)] for name in rounds}
    x_torch = {name: [t / s for t, s in zip(rounds["torch"], rounds[name])] for name in VARIANTS}
    median = statistics.median
    print(f"HF LlamaForCausalLM, 8 layers, hidden {HIDDEN}, vocab {VOCAB} (untied), "
          f"{'use_cache=False' if args.no_cache else 'default config'}, p={P}, m={M} "
          f"microbatches of {MICRO} x {SEQ} tokens; gloo, 1 thread per process")  # fmt: skip
    print(f"smp's layers per stage: {r['placement']['layers']} (layers split across the cut: "
          f"{r['placement']['straddling_layers'] or 'none'}); torch's stages cut before layer "
          f"{r['cut']}")  # fmt: skip
    alone = "   ".join(" / ".join(f"{t * 1e3:.1f}" for t in rnd) for rnd in r["stages_alone_s"])
    print(f"fwd+bwd per microbatch of each stage alone, ms, round by round: {alone}")
    print(f"{'':36s}{'of ideal':>10s}{'x torch':>9s}   (medians of the rounds; then each round)")
    for name in ("torch", *VARIANTS):
        ratio = f"{median(x_torch[name]):9.3f}" if name != "torch" else f"{'':9s}"
        rows = " ".join(f"{x:.3f}" for x in of_ideal[name])
        against = " ".join(f"{x:.3f}" for x in x_torch.get(name, []))
        against = f"  x torch {against}" if against else ""
        print(f"{LABELS[name]:36s}{median(of_ideal[name]):10.3f}{ratio}   of ideal {rows}{against}")
    smp_mib = r["smp_bytes_per_microbatch"] / 2**20
    torch_mib = r["torch_bytes_per_microbatch"] / 2**20
    print(f"bytes between the stages per microbatch: smp {smp_mib:.2f}, torch {torch_mib:.2f} MiB")
    if args.json:
        r.update(ideal=ideal, of_ideal=of_ideal, x_torch=x_torch)
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
