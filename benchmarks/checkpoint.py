"""Checkpoint save and load: ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` against
torch.distributed.checkpoint (DCP) used directly on the same tensors, same run.

Four gloo processes on CPU train a GPT (default ~300 M parameters: 20 layers, hidden 1024,
vocabulary 50304) one step at pp 2 x dp 2 with AdamW, so every rank holds its stage's
parameters and optimizer state. Then, in alternating rounds: smp saves a partial checkpoint
(DCP's planner and writer, plus smp's manifest with every file's size and CRC-32C, the random
states, the temporary directory and its rename), and DCP saves the same state dict (the one smp
hands it) with its default planner and writer; each loads back what it saved (smp: checking
sizes and checksums first). Reported: medians of the rounds, the ratios, and bytes per rank.

    .venv/bin/python benchmarks/checkpoint.py [--layers 20] [--rounds 3] [--dir /tmp/ckpt]
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def _worker(rank: int, layers: int, hidden: int, rounds: int, directory: str) -> dict | None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from model import GPT, GPTConfig, lm_loss

    import smp
    from smp.checkpoints.entries import model_entries, optimizer_entries

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1})
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, n_layer=layers, n_head=16, n_embd=hidden, vocab_size=50304)
    model = smp.DistributedModel(GPT(cfg))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    optimizer.zero_grad()
    train_step(model, tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    params = torch.tensor(sum(p.numel() for p in model.local_parameters()))
    dist.all_reduce(params, group=smp.state.get_state().groups["pp"])

    state = smp.state.get_state()
    same_state = {**model_entries(model, state), **optimizer_entries(model, optimizer, state)}
    root = Path(directory)

    def timed(action) -> float:
        dist.barrier()
        start = time.perf_counter()
        action()
        dist.barrier()
        return time.perf_counter() - start

    def clear(path: Path) -> None:
        dist.barrier()
        if rank == 0 and path.exists():
            shutil.rmtree(path)
        dist.barrier()

    times: dict[str, list[float]] = {"smp_save": [], "dcp_save": [], "smp_load": [], "dcp_load": []}
    written: dict[str, int] = {}
    for _ in range(rounds):
        clear(root / "smp")
        times["smp_save"].append(timed(lambda: smp.save_checkpoint(root / "smp", "t")))
        times["smp_load"].append(timed(lambda: smp.resume_from_checkpoint(root / "smp", "t")))
        written["smp"] = sum(f.stat().st_size for f in (root / "smp" / "t").glob(f"__{rank}_*"))
        clear(root / "dcp")
        times["dcp_save"].append(timed(lambda: dcp.save(same_state, checkpoint_id=root / "dcp")))
        times["dcp_load"].append(timed(lambda: dcp.load(same_state, checkpoint_id=root / "dcp")))
        written["dcp"] = sum(f.stat().st_size for f in (root / "dcp").glob(f"__{rank}_*"))
    per_rank = [None] * smp.size()
    dist.all_gather_object(per_rank, written)
    clear(root)
    smp.shutdown()
    if rank != 0:
        return None
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"params": int(params), "times": times, "medians": medians, "bytes_per_rank": per_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/smp_checkpoint_bench"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run_ranks(_worker, 4, args.layers, args.hidden, args.rounds, str(args.dir))
    m = result["medians"]
    result["save_ratio"] = m["smp_save"] / m["dcp_save"]
    result["load_ratio"] = m["smp_load"] / m["dcp_load"]
    print(
        f"GPT {result['params'] / 1e6:.0f} M parameters + AdamW state, pp 2 x dp 2 "
        f"(4 gloo processes, CPU), medians of {args.rounds} alternating rounds"
    )
    print("         save s   load s   (rounds: save / load)")
    for who in ("smp", "dcp"):
        rounds = ", ".join(
            f"{save:.2f}/{load:.2f}"
            for save, load in zip(result["times"][f"{who}_save"], result["times"][f"{who}_load"])
        )
        print(f"{who:5s} {m[who + '_save']:8.2f} {m[who + '_load']:8.2f}   ({rounds})")
    print(f"smp / DCP: save {result['save_ratio']:.3f}, load {result['load_ratio']:.3f}")
    for rank, written in enumerate(result["bytes_per_rank"]):
        mb = {k: v / 1e6 for k, v in written.items()}
        print(f"rank {rank}: smp {mb['smp']:8.1f} MB, DCP {mb['dcp']:8.1f} MB written")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
