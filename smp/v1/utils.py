"""Helpers of SMP v1's ``smdistributed.modelparallel.torch.utils`` that v1 training scripts
import (``rmsg`` in their logging, ``get_distribution_axis`` in their fp16 utilities)."""

from __future__ import annotations

import torch

from smp.state import is_initialized

__all__ = ["rmsg", "get_distribution_axis"]


def rmsg(msg: str) -> str:
    """``msg`` prefixed with this process's rank and its pp / tp / dp ranks."""
    if not is_initialized():
        return msg
    from smp import comm

    return f"[{comm.rank()}:pp{comm.pp_rank()}:tp{comm.tp_rank()}:dp{comm.dp_rank()}] {msg}"


def get_distribution_axis(param: torch.Tensor) -> int | None:
    """The dimension along which ``param`` is split over the tensor-parallel group, or None
    when every rank holds it whole."""
    split = getattr(param, "_smp_tp_split", None)
    return None if split is None else int(split[0])
