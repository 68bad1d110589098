"""The tensor memory a rank really holds, for checking the planner's ledger (design.md §13.2).

:class:`LiveMemory` is a dispatch mode counting the bytes of every tensor storage an op reads or
writes, from the op until the storage is freed, and their peak. Torch's ``MemTracker``
(``torch.distributed._tools``) does this per module and phase, but refuses a module called
twice while it tracks (every microbatch of a step calls each module again), hence this one.

What it sees: storages made or used by ops on threads where the mode is active (smp's pipeline
workers take it with the step's thread state, design.md §4.7), and the tensors given when it
starts (parameters, gradients, optimizer state). A storage allocated by C++ off those threads
(a received message) counts from the first op that uses it. A storage resized in place keeps
the size it had when first seen.

    live = LiveMemory([*model.parameters(), *optimizer_state_tensors])
    with live:
        train_step(model, x, y); optimizer.step()
    live.peak_bytes
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveMemory"]


class LiveMemory(TorchDispatchMode):
    """Bytes of tensor storage alive on ``device`` ("cpu", "cuda", ...) while the mode is on,
    and their peak (``current_bytes``, ``peak_bytes``)."""

    def __init__(self, tensors: Iterable[torch.Tensor | None] = (), device: str = "cpu"):
        super().__init__()
        self.device_type = torch.device(device).type
        self.current_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()
        self._sizes: dict[StorageWeakRef, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def _see(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        with self._lock:
            if key in self._sizes:
                return
            size = storage.nbytes()
            self._sizes[key] = size
            self.current_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: StorageWeakRef) -> None:
        with self._lock:
            self.current_bytes -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                self._see(t)
        return out

    def reset_peak(self) -> None:
        """Starts a new peak from what is alive now."""
        with self._lock:
            self.peak_bytes = self.current_bytes
