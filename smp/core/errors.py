"""Errors raised by more than one layer."""

from __future__ import annotations

__all__ = ["StepFailedError"]


class StepFailedError(RuntimeError):
    """A step function (or the partitioning run inside the first step) failed on another rank;
    the message carries that rank's error."""
