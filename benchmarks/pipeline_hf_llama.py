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
directions, the transport's tensors) and in torch's (the activations and their gradients); and
per step, the CPU time each stage's process spent (every thread), and of it gloo's threads.
``--breakdown`` splits that CPU further, for both libraries: autograd's engine (every backward
pass, timed on the thread that runs it), the decoder layers' forwards (hooks on each layer), and
the rest (embedding, rotary embedding, mask, norm, head and loss, the optimizer, the runtime).

    .venv/bin/python benchmarks/pipeline_hf_llama.py [--steps 4] [--rounds 3] [--json out.json]

``--overhead`` runs the same model with almost no compute (hidden 32, 8 tokens, vocabulary 64):
the same modules, calls and messages, so a step's time is the runtimes' own cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _launch import run_ranks, smp_training, timed  # noqa: E402

MICRO, SEQ, M, P = 2, 128, 8, 2
BATCH = MICRO * M
VOCAB, HIDDEN = 4096, 256
CONFIG_OVERRIDES: dict = {}  # --no-cache: {"use_cache": False}


def _shrink() -> None:
    """--overhead: the same model and calls with almost no compute (module docstring)."""
    global SEQ, HIDDEN, VOCAB
    SEQ, HIDDEN, VOCAB = 8, 32, 64


VARIANTS = {"default": {}, "static_zbh1": {"pipeline": "static", "pipeline_schedule": "zbh1"}}
LABELS = {
    "default": "smp, default",
    "static_zbh1": "smp, static ZB-H1 program",
    "torch": "torch.distributed.pipelining 1F1B",
}


def _llama():
    """The model; with --breakdown its decoder layers' forwards are timed (``_Breakdown``)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=False, **CONFIG_OVERRIDES,
    )  # fmt: skip
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config)
    if _BREAKDOWN is not None:
        _BREAKDOWN.hook_layers(llama)
    return llama


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


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds of this process so far, every thread; of them, its gloo threads')."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    gloo = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if not f.read().startswith("gloo"):
                    continue
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            gloo += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return usage.ru_utime + usage.ru_stime, gloo


class _Breakdown:
    """--breakdown: the CPU seconds this process spends in autograd's engine and in the decoder
    layers' forwards, each timed on the thread that runs it (``time.thread_time``). With one
    thread per process the CPU engine runs a backward on the calling thread, so that thread's
    time is the backward's. The engine is wrapped where torch and smp call it; the layers get a
    forward pre-hook and hook each (smp's served calls run them, and so the hooks, on the
    owning stage's workers)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engine = self.layers = 0.0
        self.started = threading.local()

    def totals(self) -> tuple[float, float]:
        with self.lock:
            return self.engine, self.layers

    def _add(self, field: str, seconds: float) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + seconds)

    def install_engine(self) -> None:
        import torch.autograd.graph

        from smp.pipeline import segments

        engine = torch.autograd.graph._engine_run_backward

        def timed_engine(*args, **kwargs):
            start = time.thread_time()
            try:
                return engine(*args, **kwargs)
            finally:
                self._add("engine", time.thread_time() - start)

        for module in (torch.autograd.graph, torch.autograd, segments):
            module._engine_run_backward = timed_engine

    def hook_layers(self, llama) -> None:
        def before(module, args, kwargs):
            self.started.value = time.thread_time()

        def after(module, args, kwargs, output):
            self._add("layers", time.thread_time() - self.started.value)

        for layer in llama.model.layers:
            layer.register_forward_pre_hook(before, with_kwargs=True)
            layer.register_forward_hook(after, with_kwargs=True)


_BREAKDOWN: _Breakdown | None = None  # --breakdown


def _timed_with_cpu(step, data, warmup: int) -> tuple[float, tuple[float, ...]]:
    """``timed``'s seconds, and (CPU seconds per step of this process, of its gloo threads, and
    with --breakdown of autograd's engine and of the layers' forwards) over the whole call (the
    warm-up steps included: the same for every variant)."""
    before = _cpu_seconds() + (_BREAKDOWN.totals() if _BREAKDOWN else ())
    seconds = timed(step, data, warmup)
    after = _cpu_seconds() + (_BREAKDOWN.totals() if _BREAKDOWN else ())
    return seconds, tuple((a - b) / len(data) for a, b in zip(after, before))


def _traffic(step, batch, paths: list[str]) -> dict[str, list[int]]:
    """What this rank's pipeline sends to other stages in one step, by message: "REQUEST
    <module path>" (the module index resolved with ``paths``), "REPLY", "GRAD_OUT", "GRAD_IN",
    ... -> [bytes of its tensors, messages]."""
    from smp.pipeline import protocol
    from smp.pipeline.sender import Sender

    kinds = {protocol.REQUEST: "REQUEST", protocol.REPLY: "REPLY", protocol.GRAD_OUT: "GRAD_OUT"}
    kinds.update({protocol.GRAD_IN: "GRAD_IN", protocol.STEP_END: "STEP_END"})
    sent: dict[str, list[int]] = {}
    original = Sender.send

    def send(self, peer, header, tensors, wait=False):
        label = kinds.get(int(header[0]), f"kind {int(header[0])}")
        if label == "REQUEST":
            index = int(header[3])
            label += " " + (paths[index] or "<root>" if index >= 0 else "(FETCH)")
        entry = sent.setdefault(label, [0, 0])
        entry[0] += sum(t.numel() * t.element_size() for t in tensors)
        entry[1] += 1
        return original(self, peer, header, tensors, wait)

    Sender.send = send
    try:
        step(*batch)
    finally:
        Sender.send = original
    return sent


def _worker(rank: int, steps: int, rounds: int, overrides: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import smp
    from smp.state import get_state

    global _BREAKDOWN
    if overrides.pop("overhead", False):
        _shrink()
    if overrides.pop("breakdown", False):
        _BREAKDOWN = _Breakdown()
        _BREAKDOWN.install_engine()
    if overrides.pop("resend", False):  # --resend: every request carries all its tensors
        from smp.pipeline.runtime import PipelineRuntime

        PipelineRuntime.send_once = False
    if overrides.pop("send_unread", False):  # --send-unread: no argument kept until read
        from smp.pipeline.runtime import PipelineRuntime

        PipelineRuntime.keep_unread = False
    if overrides.pop("no_batch", False):  # --no-batch: one wire message per message
        from smp.pipeline import sender

        sender._BATCH = 1
    CONFIG_OVERRIDES.update(overrides)
    warmup = 2
    data = _data(steps + warmup)
    cut, placement = _cut()

    def smp_runner(options: dict):
        smp.init({"pipeline_parallel_degree": P, "microbatches": M, **options})
        return smp_training(
            _llama(), lambda model, ids: model(input_ids=ids, labels=ids).loss, 1e-4
        )[1]

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
    cpu_s: dict[str, list[tuple[float, float]]] = {name: [] for name in rounds_s}
    alone_s: list[float] = []
    traffic = None
    for _ in range(rounds):
        for name, options in VARIANTS.items():
            step = smp_runner(options)
            seconds, cpu = _timed_with_cpu(step, data, warmup)
            rounds_s[name].append(seconds)
            cpu_s[name].append(cpu)
            if name == "default" and traffic is None:  # one more step, counted
                runtime = next(iter(get_state().runtimes))
                traffic = _traffic(step, data[0], runtime.paths)
            smp.shutdown()
        seconds, cpu = _timed_with_cpu(torch_step, data, warmup)
        rounds_s["torch"].append(seconds)
        cpu_s["torch"].append(cpu)
        alone_s.append(_stage_alone(stage_module, rank, data[0][0]))
    stages_alone = [None] * P
    dist.all_gather_object(stages_alone, alone_s)
    all_traffic = [None] * P
    dist.all_gather_object(all_traffic, traffic)
    all_cpu = [None] * P
    dist.all_gather_object(all_cpu, cpu_s)
    activation = MICRO * SEQ * HIDDEN * 4  # what crosses in torch's step, each way
    return {
        "cut": cut,
        "placement": placement,
        "rounds_seconds": rounds_s,
        "stages_alone_s": [list(r) for r in zip(*stages_alone)],  # [round][stage]
        "smp_bytes_per_microbatch": sum(b for t in all_traffic for b, _ in t.values()) / M,
        "smp_traffic_per_step": all_traffic,  # [stage] -> message label -> [bytes, messages]
        "cpu_seconds_per_step": all_cpu,  # [stage][variant] -> per round (process, gloo)
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


def _print_breakdown(cpu: list[dict]) -> None:
    """--breakdown's table: each stage's CPU per step (medians of the rounds) split into
    autograd's engine, the layers' forwards, gloo's threads and the rest, and smp's excess."""
    median = statistics.median
    names = ("torch", *VARIANTS)
    print("CPU seconds per step by part, medians of the rounds (rest: everything else, gloo's "
          "threads not included)")  # fmt: skip
    print(f"{'':12s}{'':36s}{'all':>8s}{'engine':>8s}{'layers':>8s}{'gloo':>8s}{'rest':>8s}")
    for stage, per_variant in enumerate(cpu):
        parts = {}
        for name in names:
            rows = per_variant[name]
            total, gloo, engine, layers = (median(c[i] for c in rows) for i in range(4))
            parts[name] = (total, engine, layers, gloo, total - engine - layers - gloo)
        for name in names:
            cells = "".join(f"{x:8.3f}" for x in parts[name])
            print(f"  stage {stage}   {LABELS[name]:36s}{cells}")
        for name in VARIANTS:
            excess = "".join(f"{a - b:+8.3f}" for a, b in zip(parts[name], parts["torch"]))
            print(f"  stage {stage}   {LABELS[name] + ' - torch':36s}{excess}")


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
    parser.add_argument(
        "--resend",
        action="store_true",
        help="send a tensor again with every request that takes it (before tensors were sent "
        "once per microbatch and owner, design.md §4.6)",
    )
    parser.add_argument(
        "--send-unread",
        action="store_true",
        help="send every request tensor, also those the owner does not read (before they were "
        "kept by the caller and fetched when read, design.md §4.6)",
    )
    parser.add_argument(
        "--no-batch",
        action="store_true",
        help="send every message alone (before, what queued up for a peer went as one batch, "
        "design.md §4.8)",
    )
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="the same model with almost no compute (hidden 32, 8 tokens, vocabulary 64): "
        "the runtimes' own cost per step",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="split each stage's CPU per step into autograd's engine, the decoder layers' "
        "forwards and the rest, for both libraries",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin each process, and every thread it starts, to a CPU of its own (as taskset "
        "would), for both libraries",
    )
    args = parser.parse_args()
    if args.pin:
        os.environ["SMP_BENCH_PIN"] = "1"  # read by the spawned processes (_launch.py)
    overrides = {"use_cache": False} if args.no_cache else {}
    if args.overhead:
        _shrink()
        overrides["overhead"] = True
    if args.resend:
        overrides["resend"] = True
    if args.send_unread:
        overrides["send_unread"] = True
    if args.no_batch:
        overrides["no_batch"] = True
    if args.breakdown:
        overrides["breakdown"] = True
    r = run_ranks(_worker, P, args.steps, args.rounds, overrides)
    samples = args.steps * BATCH
    rounds = r["rounds_seconds"]
    ideal = [samples / (args.steps * (M + P - 1) * max(alone)) for alone in r["stages_alone_s"]]
    of_ideal = {name: [samples / t / i for t, i in zip(rounds[name], ideal)] for name in rounds}
    x_torch = {name: [t / s for t, s in zip(rounds["torch"], rounds[name])] for name in VARIANTS}
    median = statistics.median
    print(f"HF LlamaForCausalLM, 8 layers, hidden {HIDDEN}, vocab {VOCAB} (untied), "
          f"{'use_cache=False' if args.no_cache else 'default config'}, p={P}, m={M} "
          f"microbatches of {MICRO} x {SEQ} tokens; gloo, 1 thread per process"
          f"{', each process pinned to a CPU' if args.pin else ''}")  # fmt: skip
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
    print("smp's messages per microbatch, by stage and kind (requests by module): KiB, count")
    for stage, traffic in enumerate(r["smp_traffic_per_step"]):
        rows = sorted(traffic.items(), key=lambda kv: -kv[1][0])
        print(f"  stage {stage}: " + ", ".join(
            f"{label} {b / M / 1024:.0f} KiB x {n / M:g}" for label, (b, n) in rows
        ))  # fmt: skip
    print("CPU seconds per step, medians of the rounds: stage 0 + stage 1 = both (of it gloo's)")
    for name in ("torch", *VARIANTS):
        per_stage = [
            [median(c[0] for c in stage[name]), median(c[1] for c in stage[name])]
            for stage in r["cpu_seconds_per_step"]
        ]
        parts = " + ".join(f"{cpu:.3f}" for cpu, _ in per_stage)
        total = sum(cpu for cpu, _ in per_stage)
        gloo = sum(g for _, g in per_stage)
        print(f"{LABELS[name]:36s}{parts} = {total:.3f} ({gloo:.3f})")
    if args.breakdown:
        _print_breakdown(r["cpu_seconds_per_step"])
    if args.json:
        r.update(ideal=ideal, of_ideal=of_ideal, x_torch=x_torch)
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
