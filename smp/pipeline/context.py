"""The thread-local state a task runs with, wherever it runs (design.md §4.7).

A pipelined step runs every forward in a pool thread: the leader's step function once per
microbatch, and each served call on its owner. In one process all of them would run on the
step's thread, under whatever that thread set: grad and inference mode, ``torch.autocast``,
saved-tensor hooks, torch function / dispatch modes, the current CUDA device. So:

- :class:`StepContext` captures the step thread's state when the step starts (torch's own record
  of it, ``at::ThreadLocalState``, plus the autocast dtypes and cache flag, which that record
  leaves out, plus the current CUDA device) and applies it around every worker of the step.
- :class:`CallMode` is what a REQUEST carries of the *caller's* thread at the call: grad mode,
  inference mode, and autocast per device type with its dtype and cache flag. The step function
  may set these itself (``with torch.autocast(...)`` inside it), so they can differ from the
  owner's step thread; the owner applies them over its own step context. Python objects (hooks,
  modes) cannot cross a process: the owner's step thread has its own, which every rank sets the
  same way when its script wraps ``smp.step`` in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from smp import _C
from smp.memory import activations

__all__ = ["CallMode", "StepContext"]

# The device types whose autocast state a REQUEST carries, and the dtypes it can name.
AUTOCAST_DEVICES = ("cpu", "cuda")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_BITS = 3  # per device type: 0 = autocast off, else 1 + index into _DTYPES
_CHECKPOINT_BIT = 3 + _DTYPE_BITS * len(AUTOCAST_DEVICES)  # then preserve_rng


@dataclasses.dataclass(frozen=True)
class CallMode:
    """A caller's thread-local state that the owner of a called module needs."""

    grad: bool
    inference: bool = False
    autocast: tuple[torch.dtype | None, ...] = (None,) * len(AUTOCAST_DEVICES)  # per device
    cache: bool = True  # autocast's weight-cast cache
    # smp.checkpoint of a module of another stage: the owner runs the call checkpointed
    # (with torch's and smp's generators restored for the recompute when preserve_rng).
    checkpoint: bool = False
    preserve_rng: bool = True

    @classmethod
    def current(cls) -> CallMode:
        autocast = tuple(
            torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
            for d in AUTOCAST_DEVICES
        )
        checkpoint, preserve_rng = activations.requested() or (False, True)
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            autocast,
            torch.is_autocast_cache_enabled(),
            checkpoint,
            preserve_rng,
        )

    def encode(self) -> int:
        """One header int; bit 0 is grad mode (what a FETCH's header holds at that place)."""
        code = int(self.grad) | int(self.inference) << 1 | int(self.cache) << 2
        for i, dtype in enumerate(self.autocast):
            if dtype is not None:
                if dtype not in _DTYPES:
                    raise ValueError(
                        f"smp pipeline: autocast dtype {dtype} on {AUTOCAST_DEVICES[i]} cannot "
                        f"be carried to another stage; use one of {list(_DTYPES)}"
                    )
                code |= (1 + _DTYPES.index(dtype)) << (3 + _DTYPE_BITS * i)
        return (
            code
            | int(self.checkpoint) << _CHECKPOINT_BIT
            | int(self.preserve_rng) << (_CHECKPOINT_BIT + 1)
        )

    @classmethod
    def decode(cls, code: int) -> CallMode:
        autocast = []
        for i in range(len(AUTOCAST_DEVICES)):
            index = (code >> (3 + _DTYPE_BITS * i)) & ((1 << _DTYPE_BITS) - 1)
            autocast.append(_DTYPES[index - 1] if index else None)
        return cls(
            bool(code & 1),
            bool(code & 2),
            tuple(autocast),
            bool(code & 4),
            bool(code >> _CHECKPOINT_BIT & 1),
            bool(code >> (_CHECKPOINT_BIT + 1) & 1),
        )


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, without initialising CUDA where nothing has."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


class StepContext:
    """The state of the thread that started a step, applied around each of its workers."""

    def __init__(self):
        self.state = _C.ThreadState()
        self.mode = CallMode.current()
        self.cuda_device = _current_cuda_device()

    @contextlib.contextmanager
    def applied(self, mode: CallMode | None = None) -> Iterator[None]:
        """Runs the body with this step's thread state, then ``mode`` (a caller's, from its
        REQUEST) over it; the thread's own state is back afterwards. Casts autocast cached
        inside are dropped at the end, as ``torch.autocast`` drops them when its outermost
        block ends: a cached cast of a parameter must not outlive the optimizer's update."""
        mode = mode or self.mode
        with _C.ThreadStateGuard(self.state), contextlib.ExitStack() as stack:
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
            if mode.inference != torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(mode.inference))
            torch.set_grad_enabled(mode.grad)  # the guard restores it
            saved = [torch.get_autocast_dtype(d) for d in AUTOCAST_DEVICES]
            saved_cache = torch.is_autocast_cache_enabled()
            for device, dtype in zip(AUTOCAST_DEVICES, mode.autocast):
                torch.set_autocast_enabled(device, dtype is not None)  # the guard restores it
                if dtype is not None:
                    torch.set_autocast_dtype(device, dtype)
            torch.set_autocast_cache_enabled(mode.cache)
            torch.autocast_increment_nesting()
            try:
                yield
            finally:
                if torch.autocast_decrement_nesting() == 0:
                    torch.clear_autocast_cache()
                torch.set_autocast_cache_enabled(saved_cache)
                for device, dtype in zip(AUTOCAST_DEVICES, saved):
                    torch.set_autocast_dtype(device, dtype)
