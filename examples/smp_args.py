"""What the examples share: the command-line configuration (``--config FILE`` / ``--pp`` /
``--tp`` / ``--microbatches``), the rank's device, the learning-rate warmup, the loss summary.

When any of ``--pp``, ``--tp``, ``--microbatches`` is given, they build the dict given to
``smp.init`` (over the keys of ``--config``'s file, if given too). Otherwise ``smp.init()`` reads
the configuration as an SMP v1 script's does: ``--config FILE`` sets ``SMP_CONFIG`` to the file,
else ``SM_HP_MP_PARAMETERS`` as the SageMaker launcher sets it, else smp's defaults.

The examples pass their ``smp`` module in, so that their v1 form differs in its import alone.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import ModuleType

import torch


def add_smp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON file of smp keys: sets SMP_CONFIG")
    parser.add_argument("--pp", type=int, help="pipeline_parallel_degree")
    parser.add_argument("--tp", type=int, help="tensor_parallel_degree")
    parser.add_argument("--microbatches", type=int, help="microbatches per step")


def init_smp(smp: ModuleType, args: argparse.Namespace) -> None:
    flags = {
        key: value
        for key, value in (
            ("pipeline_parallel_degree", args.pp),
            ("tensor_parallel_degree", args.tp),
            ("microbatches", args.microbatches),
        )
        if value is not None
    }
    if flags:
        base = json.loads(args.config.read_text()) if args.config else {}
        smp.init({**base, **flags})
    else:
        if args.config:
            os.environ["SMP_CONFIG"] = str(args.config.resolve())
        smp.init()  # as under SageMaker: SMP_CONFIG or SM_HP_MP_PARAMETERS, else defaults


def first_and_last_loss(smp: ModuleType, losses: list[float], window: int) -> tuple[float, float]:
    """The mean of the first and of the last ``window`` losses (at most a third of them), each
    averaged over the data-parallel ranks: the same on every rank, so every rank exits alike."""
    window = max(1, min(window, len(losses) // 3))
    mine = (sum(losses[:window]) / window, sum(losses[-window:]) / window)
    every = smp.allgather(mine, smp.DP_GROUP)
    return sum(f for f, _ in every) / len(every), sum(la for _, la in every) / len(every)


def rank_device(smp: ModuleType) -> torch.device:
    """``cuda:<local rank>`` (made current) where there is a GPU, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
        return torch.device("cuda", smp.local_rank())
    return torch.device("cpu")


def warmup_then_linear(optimizer: torch.optim.Optimizer, steps: int):
    """A LambdaLR: linear warmup over a tenth of ``steps``, then linear decay to a tenth."""
    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, max(0.1, 1 - (s - warmup) / max(1, steps - warmup))),
    )
