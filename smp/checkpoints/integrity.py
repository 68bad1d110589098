"""What makes a checkpoint's files trustworthy: their sizes and CRC-32C checksums, loads that
run no code from the file, and the error a bad checkpoint raises."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from smp import _C
from smp.checkpoints.files import write_atomically

__all__ = ["CheckpointError"]

_BLOCK = 8 << 20  # bytes read at a time when checksumming


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or resumed (missing, incomplete, truncated, corrupted,
    or not matching the model); the message names the file or key and what is wrong."""


def _digest(path: Path) -> dict[str, int]:
    """A file's size and CRC-32C."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        return {"bytes": size, "crc32c": _crc(f, size)}


def _crc(f, count: int) -> int:
    """The CRC-32C of the next ``count`` bytes of ``f`` (smp's C++ core: the CPU's CRC
    instruction where it has one; read in blocks, the checksum runs without the GIL)."""
    crc, left = 0, count
    buffer = bytearray(min(count, _BLOCK))
    view = memoryview(buffer)
    while left > 0:
        n = f.readinto(view[: min(left, len(buffer))])
        if not n:
            break
        crc = _C.crc32c(view[:n], crc)
        left -= n
    return crc


def _torch_save(path: Path, obj: Any) -> dict[str, int]:
    write_atomically(path, lambda f: torch.save(obj, f))
    return _digest(path)


def _load_plain(source: Any, what: str, **kwargs: Any) -> Any:
    """``torch.load(source, weights_only=True)``: tensors and plain Python values, no code run
    from the checkpoint (one from a shared bucket may have been written by anyone). Types the
    user allowed with ``torch.serialization.add_safe_globals`` load too.

    Raises:
        CheckpointError: the file holds other globals; the message names them and how to allow
            them.
    """
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        try:
            if hasattr(source, "seek"):
                source.seek(0)
            refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
        except Exception:  # noqa: BLE001 - the message below still says what was refused
            refused = []
        names = ", ".join(refused) or str(exc).strip().splitlines()[-1]
        raise CheckpointError(
            f"{what} holds {names}, which smp does not load: checkpoints are read with "
            "torch.load(weights_only=True) so that a checkpoint cannot run code. If you trust "
            "this checkpoint, allow the type(s) first: torch.serialization.add_safe_globals(["
            f"{', '.join(name.rpartition('.')[2] for name in refused) or '...'}]) (or resume "
            "inside torch.serialization.safe_globals([...])); or keep only tensors and plain "
            "Python values (dict, list, tuple, str, int, float, bool, None) in user_content"
        ) from exc
