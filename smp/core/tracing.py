"""Whether the model runs for smp's tracing pass: the partitioner sets it, and code below the
partitioner (activation checkpointing) and the user's own code read it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["is_tracing", "tracing_pass"]

_tracing = 0  # tracing passes running


@contextlib.contextmanager
def tracing_pass() -> Iterator[None]:
    """Marks the model's forward inside as smp's tracing pass (see :func:`is_tracing`)."""
    global _tracing
    _tracing += 1
    try:
        yield
    finally:
        _tracing -= 1


def is_tracing() -> bool:
    """Whether the model runs for smp's tracing pass (partitioning), not for training: code
    that must not run then (logging, counters, data-dependent asserts) can check it."""
    return _tracing > 0
