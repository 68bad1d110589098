"""Activation offloading (``offload_activations``, ``activation_loading_horizon``; design.md §7.2).

What moves: the inputs a checkpointed call keeps for its recompute (:class:`smp.memory.activations.
Frame`), the only activations a checkpointed model keeps between its forward and its backward.
When: a microbatch's frames on this rank go to host memory when its forward here is done (a
served call replies; the leader's step function calls ``model.backward``); they come back when
the backward of a microbatch first needs one of them, together with every frame of the next
``activation_loading_horizon`` microbatches (in backward order: the microbatches go backward
in the order they went forward), so that by the time those backwards run their inputs are
back. A frame needed before it was brought back is loaded there and then (a *miss*, counted).

On CUDA the copies run on a side stream: out to pinned host memory, ordered after the compute
that produced the tensor (the side stream waits for the compute stream; the device tensor is
``record_stream``'d so its memory is reused only after the copy); back into a fresh device
tensor, with an event the compute stream waits for before the recompute reads it. Nothing
synchronises the host. On the CPU the same steps run with a host copy in each direction, so
the mechanism (what moves, when, and that the numbers do not change) is tested there.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from smp.core import tree

__all__ = ["Offloader", "current", "Move"]


@dataclasses.dataclass(frozen=True)
class Move:
    """One copy of a frame's inputs: ``"out"`` to the host or ``"in"`` back; ``ahead`` for a
    load before the backward asked for it (else a miss)."""

    direction: str
    microbatch: int
    nbytes: int
    ahead: bool = False


class _Record:
    """A frame's inputs while they are away: the flattened inputs with each tensor replaced
    by its host copy, and each tensor's device and ``requires_grad``."""

    def __init__(self, offloader: Offloader, microbatch: int, frame_inputs: Any):
        self.offloader = offloader
        self.microbatch = microbatch
        leaves, self.spec = tree.flatten(frame_inputs)
        self.places = [
            (t.device, t.requires_grad) if isinstance(t, torch.Tensor) else None for t in leaves
        ]
        self.nbytes = sum(
            t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
        )
        self.leaves = [offloader._to_host(t) if isinstance(t, torch.Tensor) else t for t in leaves]
        self.event = None
        if offloader.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(offloader.stream)
        self.loading: tuple[Any, Any] | None = None  # (device inputs, event) once a load began

    def load(self, frame) -> None:
        """Called by the frame when its recompute needs the inputs (a miss unless loaded)."""
        self.offloader._load_now(frame, self)


class Offloader:
    """This rank's offloaded frames, per microbatch, in forward order."""

    def __init__(self, horizon: int):
        self.horizon = horizon
        self.frames: dict[int, list[weakref.ref]] = {}  # microbatch -> frames not yet offloaded
        self.away: dict[int, list[weakref.ref]] = {}  # microbatch -> frames on the host
        self.moves: list[Move] = []
        self.lock = threading.Lock()
        self.stream = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.stream = torch.cuda.Stream()

    def new_step(self) -> None:
        """Forgets the frames of the last step (a forward without backward leaves some);
        ``moves`` keeps counting."""
        with self.lock:
            self.frames.clear()
            self.away.clear()

    # ---- forward --------------------------------------------------------------------------

    def add(self, frame) -> None:
        """A checkpointed call of the running microbatch finished its forward."""
        from smp.state import get_state

        mb = get_state().microbatch
        mb = 0 if mb is None else mb
        with self.lock:
            self.frames.setdefault(mb, []).append(weakref.ref(frame))

    def forward_done(self, microbatch: int) -> None:
        """Sends the microbatch's frames on this rank to the host."""
        with self.lock:
            frames = self.frames.pop(microbatch, [])
        for ref in frames:
            frame = ref()
            if frame is None or frame.recomputed or frame.inputs is None:
                continue
            frame.check_versions()
            record = _Record(self, microbatch, frame.inputs)
            frame.inputs = None  # the device tensors go (once the copy is done, on CUDA)
            frame.offloaded = record
            self.moves.append(Move("out", microbatch, record.nbytes))
            with self.lock:
                self.away.setdefault(microbatch, []).append(ref)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda" or self.stream is None:
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.stream)
        return host

    # ---- backward -------------------------------------------------------------------------

    def _load_now(self, frame, record: _Record) -> None:
        """A recompute needs ``frame``: its inputs come back now if no prefetch has them, and
        the rest of its microbatch and the next ``horizon`` microbatches start coming back."""
        if record.loading is None:
            self._start_load(record, ahead=False)
        self._finish_load(frame, record)
        self._prefetch_from(record.microbatch)

    def _prefetch_from(self, microbatch: int) -> None:
        with self.lock:
            later = sorted(mb for mb in self.away if mb >= microbatch)[: self.horizon + 1]
            batches = [(mb, self.away.pop(mb)) for mb in later]
        for _, refs in batches:
            for ref in reversed(refs):  # backward order within a microbatch
                frame = ref()
                record = None if frame is None else frame.offloaded
                if record is not None and record.loading is None:
                    self._start_load(record, ahead=True)

    def _start_load(self, record: _Record, ahead: bool) -> None:
        def back(leaf: Any, place: Any) -> Any:
            if place is None:
                return leaf
            device, requires_grad = place
            if self.stream is None or device.type != "cuda":
                out = leaf.clone() if device.type == "cpu" else leaf.to(device)
            else:
                out = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
                out.copy_(leaf, non_blocking=True)
            return out.requires_grad_(requires_grad)

        event = None
        if self.stream is None:
            leaves = [back(v, p) for v, p in zip(record.leaves, record.places)]
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(record.event)
                leaves = [back(v, p) for v, p in zip(record.leaves, record.places)]
                event = torch.cuda.Event()
                event.record(self.stream)
        record.loading = (tree.unflatten(leaves, record.spec), event)
        self.moves.append(Move("in", record.microbatch, record.nbytes, ahead))

    def _finish_load(self, frame, record: _Record) -> None:
        inputs, event = record.loading
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            for t in tree.tensors(inputs):
                t.record_stream(torch.cuda.current_stream())
        frame.inputs = inputs
        frame.offloaded = None
        frame.versions = [t._version for t in tree.tensors(inputs)]

    def summary(self) -> dict[str, int]:
        """What moved: frames and bytes each way, and the loads that came ahead of need."""
        out = [m for m in self.moves if m.direction == "out"]
        back = [m for m in self.moves if m.direction == "in"]
        return {
            "offloaded": len(out),
            "offloaded_bytes": sum(m.nbytes for m in out),
            "loaded": len(back),
            "loaded_bytes": sum(m.nbytes for m in back),
            "loaded_ahead": sum(m.ahead for m in back),
        }


def current() -> Offloader:
    """This rank's offloader (made at the first use after ``smp.init``)."""
    from smp.state import get_state

    state = get_state()
    offloader = getattr(state, "offloader", None)
    if offloader is None:
        offloader = state.offloader = Offloader(state.config.activation_loading_horizon)
    return offloader


def forward_done(microbatch: int | None) -> None:
    """The hook of the runtimes: this rank's forward of ``microbatch`` is done."""
    from smp.state import get_state, is_initialized

    if is_initialized() and get_state().config.offload_activations:
        current().forward_done(0 if microbatch is None else microbatch)
