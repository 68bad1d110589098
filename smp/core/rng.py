"""The random streams a step draws from: torch's CPU and CUDA generators and smp's
tensor-parallel generators (:func:`tp_rng`), taken and put back together (:func:`random_streams`,
:func:`set_random_streams`) by activation checkpointing's recompute, the tracer, the step's
rewind and checkpoints."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from smp.state import get_state, is_initialized

__all__ = ["tp_rng", "random_streams", "set_random_streams", "streams_without_init"]

_unseeded: dict[str, torch.Generator] | None = None  # streams_without_init's generators


@contextlib.contextmanager
def streams_without_init() -> Iterator[None]:
    """Inside, :func:`tp_rng` works before ``smp.init`` with generators of its own (seed 0):
    for the planner, which runs tensor-parallel modules on fake tensors before any process
    group exists, where what is drawn does not matter."""
    global _unseeded
    outer, _unseeded = _unseeded, {}
    try:
        yield
    finally:
        _unseeded = outer


def tp_rng(kind: str, device: torch.device | str | None = None) -> torch.Generator:
    """The TP-aware generator ``kind`` of this rank, on ``device`` (default: the CPU).

    "replicated": the same stream on every rank of a TP group, for dropout on tensors every rank
    holds whole (so the masks agree). "sharded": a different stream on every TP rank, for
    tensors split across the group or holding different samples. Both derive from
    ``tensor_parallel_seed``, the pipeline stage and the rdp rank, and restart at every
    ``smp.init``, so runs are reproducible. Each device has its own generator of each kind,
    seeded alike, so a CUDA tensor's mask is drawn on its GPU (no host mask, no copy) and still
    agrees across the group where it must.
    """
    if not is_initialized():
        if _unseeded is not None:
            return _unseeded.setdefault(f"{kind}@{device}", torch.Generator().manual_seed(0))
        raise RuntimeError("smp.nn dropout needs smp.init(...) first (it seeds the TP generators)")
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    state = get_state()
    generators = getattr(state, "tp_generators", None)
    if generators is None:
        generators = state.tp_generators = {}
    key = kind if device.type == "cpu" else f"{kind}@{device}"
    if key not in generators:
        if kind not in ("replicated", "sharded"):
            raise ValueError(f'TP generator kind must be "replicated" or "sharded", got {kind!r}')
        base = (
            state.config.tensor_parallel_seed * 1_000_003
            + state.axis_rank("pp") * 7919
            + state.axis_rank("rdp") * 104_729
        )
        if kind == "sharded":
            base += 2718 + 31 * (state.axis_rank("tp") + 1)
        generators[key] = torch.Generator(device=device).manual_seed(base)
    return generators[key]


def random_streams() -> dict:
    """Every random stream this rank's steps draw from: torch's CPU generator, the CUDA ones
    (once CUDA is initialised) and the TP generators (None until first drawn from)."""
    generators = getattr(get_state(), "tp_generators", None) if is_initialized() else None
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "tp": None if generators is None else {k: g.get_state() for k, g in generators.items()},
    }


def set_random_streams(saved: dict) -> None:
    """Puts back what :func:`random_streams` took. TP generators that did not exist then are
    dropped, so they start afresh from their seed when next used, as they would have."""
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] is not None:
        torch.cuda.set_rng_state_all(saved["cuda"])
    if is_initialized():
        if saved["tp"] is None:
            get_state().tp_generators = None
        else:
            generators = getattr(get_state(), "tp_generators", None) or {}
            for key in [k for k in generators if k not in saved["tp"]]:
                del generators[key]
            for key, value in saved["tp"].items():
                kind, _, device = key.partition("@")
                tp_rng(kind, device or None).set_state(value)
