"""A model's gradients across smp.step: set aside, reduced over data parallelism, restored.

Per step (smp.step calls the model, the model calls its ``StepGrads``):

  1. ``begin``: gradients already present (from an earlier step the user did not zero, or
     earlier passes of a ``backward_passes_per_step`` window) are set aside, so the reduction
     below only ever touches this window's new gradients.
  2. the step function runs; ``model.backward`` accumulates into ``.grad`` per microbatch, and
     before the window's last backward ``arm_last_backward`` lets the overlapped reduction
     (:mod:`smp.dp.reduction`) issue buckets as the backward finishes them.
  3. ``smp.step`` agrees across ranks on success and on which parameters got a gradient anywhere
     (``set_union``: a parameter unused on one rank but used on another still gets the right
     mean), and on whether a bucket went out early anywhere or went stale
     (``set_reduction_flags``).
  4. ``finish``: at the end of a window the new gradients are all-reduced as a sum, then divided
     by (group size × microbatches), the mean over the global batch (:func:`group_and_divisor`),
     and the set-aside gradients are added back. Or ``abort``: a failed step's gradients are
     dropped and the set-aside ones restored.

The reduction runs overlapped with the backward by default; after the step with
``overlapping_allreduce=False`` (one ``_C.allreduce_mean_`` per group and divisor), or through
the user's communication hook (``register_comm_hook``). FSDP2 reduces sharded parameters in the
backward (:mod:`smp.dp.sharded`), here they are only divided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from smp import _C
from smp.core import tree
from smp.dp import sharded
from smp.dp.reduction import GradReduction
from smp.state import get_state

__all__ = ["StepGrads", "group_and_divisor"]

logger = logging.getLogger("smp")


def group_and_divisor(p: torch.Tensor, state) -> tuple[str, int]:
    """(group, divisor before microbatches) of the gradient reduction of parameter ``p``.

    The target is the mean over the global batch. A parameter outside any distributed module
    sees this rank's samples: summed over dp, divided by dp. A parameter of a distributed module
    whose gradient every TP rank computes from the whole region batch (``_smp_tp_reduce ==
    "rdp"``: shards, replicated tensors inside the region) is summed over rdp only; one computed
    from this rank's part of the batch ("dp") over dp. Both divide by the number of distinct
    per-rank batches: dp, or rdp with ``prescaled_batch`` (the TP ranks share one batch).
    """
    reduce = getattr(p, "_smp_tp_reduce", None)
    if reduce is None:
        return "dp", state.axis_size("dp")
    divisor = state.axis_size("rdp" if state.config.prescaled_batch else "dp")
    return reduce, divisor


class StepGrads:
    """The gradients of a model's trainable parameters across its steps.

    Args:
        model: the DistributedModel; its options (``backward_passes_per_step``,
            ``average_grads_across_microbatches``, ``overlapping_allreduce``, ``bucket_bytes``)
            are read where they are used, its pipeline runtime (``_runtime``), its
            ``local_parameters()`` and its ``_sharded_units`` too.
        params: its unique trainable parameters in a fixed order (shared parameters once): the
            order of the gradient all-reduce, identical on every rank.
    """

    def __init__(self, model, params: list[torch.nn.Parameter]):
        self.model = model
        self.params = params
        self.window_position = 0  # passes of the backward_passes_per_step window done
        self._stash: list[torch.Tensor | None] | None = None
        self._marks: list[tuple[torch.Tensor | None, int | None]] = []  # at begin
        self._union: list[int] | None = None
        # The overlapped reduction's plan, made at its first use; what the step's outcome
        # agreement said of it: a bucket issued early on some rank, a stale one.
        self.reduction: GradReduction | None = None
        self._issued_anywhere = self._stale_anywhere = False
        self.comm_hook: tuple[Any, Callable] | None = None  # (state, hook)

    # ---- the step protocol ---------------------------------------------------------------

    def _window_ends(self) -> bool:
        """Whether this step is the last pass of its ``backward_passes_per_step`` window."""
        return self.window_position == self.model.backward_passes_per_step - 1

    def begin(self) -> None:
        """Sets earlier gradients aside at a window's start; notes every gradient as it is."""
        if self.window_position == 0:
            self._stash = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
        self._marks = [(p.grad, None if p.grad is None else p.grad._version) for p in self.params]
        if self.model._runtime is not None and self._window_ends():
            reduction = self.overlapped()
            if reduction is not None:  # a stage's last backward is the whole step's (reduction.py)
                reduction.arm_counted()

    def arm_last_backward(self, tensors) -> None:
        """Before the backward of the step's last microbatch (one stage): at the window's end
        the overlapped reduction reduces buckets as this backward finishes them."""
        if self._window_ends():
            reduction = self.overlapped()
            if reduction is not None:
                reduction.arm(tree.flatten(tensors)[0])

    def changed(self) -> bool:
        """Whether a gradient was set or added to since ``begin``."""
        return any(
            p.grad is not grad or (grad is not None and grad._version != version)
            for p, (grad, version) in zip(self.params, self._marks)
        )

    def presence(self) -> list[int]:
        """1 for each parameter with a gradient on this rank, else 0."""
        return [0 if p.grad is None else 1 for p in self.params]

    def set_union(self, flags: list[int]) -> None:
        """Which parameters got a gradient on any rank of their group (``presence`` agreed)."""
        self._union = flags

    def reduction_flags(self) -> tuple[int, int]:
        """(buckets issued early, whether one is stale) for the step's outcome agreement."""
        if self.reduction is None:
            return 0, 0
        return self.reduction.issued(), int(self.reduction.stale())

    def set_reduction_flags(self, issued_anywhere: bool, stale_anywhere: bool) -> None:
        self._issued_anywhere, self._stale_anywhere = issued_anywhere, stale_anywhere

    def overlapped(self) -> GradReduction | None:
        """The reduction overlapped with the backward (smp/dp/reduction.py), made at its first use,
        or None where the gradients are reduced after the step: ``overlapping_allreduce=False``
        or a communication hook."""
        model = self.model
        overlap = model.overlapping_allreduce and get_state().config.overlapping_allreduce
        if not overlap or self.comm_hook is not None:
            return None
        if self.reduction is None:
            state = get_state()
            num_mb = state.config.microbatches if model.average_grads_across_microbatches else 1

            def key(p: torch.Tensor) -> tuple[str, float]:
                group, divisor = group_and_divisor(p, state)
                return group, float(divisor * num_mb)

            params = [p for p in self.params if not sharded.is_sharded(p)]
            if model._runtime is not None:  # a stage reduces its own parameters over its dp group
                local = {id(p) for p in model.local_parameters()}
                params = [p for p in params if id(p) in local]
            self.reduction = GradReduction(params, key, state.groups, model.bucket_bytes)
        return self.reduction

    def abort(self) -> None:
        """Drops the gradients of a failed step (or an evaluation step) and restores those from
        before it. Inside a ``backward_passes_per_step`` window a failed step's gradients were
        added to the window's earlier ones and cannot be told apart: the whole window is
        dropped (gradients as before the window, with a warning) rather than kept partly."""
        if self.window_position > 0 and self.changed():
            logger.warning(
                "smp: a step failed at pass %d of a backward_passes_per_step=%d window; the "
                "window's gradients were dropped and the next step starts a new window",
                self.window_position + 1,
                self.model.backward_passes_per_step,
            )
            self.window_position = 0
        if self.reduction is not None:  # peers that issued buckets get theirs matched
            issued_anywhere, self._issued_anywhere = self._issued_anywhere, False
            self.reduction.abort(issued_anywhere)
        if self.window_position == 0 and self._stash is not None:
            for p, old in zip(self.params, self._stash):
                p.grad = old
            self._stash = None

    def finish(self) -> None:
        """The end of a step that ran a backward: at the end of a window, the reduction, and
        the set-aside gradients added back."""
        self.window_position += 1
        if self.window_position < self.model.backward_passes_per_step:
            return
        self.window_position = 0

        state = get_state()
        bucket_bytes = self.model.bucket_bytes
        num_mb = state.config.microbatches if self.model.average_grads_across_microbatches else 1
        union = self._union or self.presence()
        # (group, divisor) -> gradients; see group_and_divisor for the rule.
        batches: dict[tuple[str, int], list[torch.Tensor]] = {}
        done_by_fsdp: list[torch.Tensor] = []
        overlapped = self.overlapped()
        for p, used in zip(self.params, union):
            if sharded.is_sharded(p):  # FSDP2 reduced it in the backward
                done_by_fsdp.append(p)
                continue
            if not used or overlapped is not None:
                continue
            if p.grad is None:  # used on another rank only: contributes zeros here
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not p.grad.is_contiguous():  # e.g. the gradient of a transposed parameter
                p.grad = p.grad.contiguous()
            batches.setdefault(group_and_divisor(p, state), []).append(p.grad)
        if done_by_fsdp:
            sharded.finish_grads(
                done_by_fsdp, lambda p: group_and_divisor(p, state), num_mb, bucket_bytes
            )
        if overlapped is not None:
            stale, self._stale_anywhere, self._issued_anywhere = self._stale_anywhere, False, False
            if stale:
                logger.warning(
                    "smp: a gradient changed after its bucket's all-reduce had started (a second "
                    "backward in the last microbatch, .grad edited in the step function, or on a "
                    "pipeline stage more accumulations than the last window's); the gradients "
                    "were reduced again after the step"
                )
            overlapped.finish({id(p): bool(u) for p, u in zip(self.params, union)}, stale)
        elif self.comm_hook is not None:
            self._reduce_with_hook([g for grads in batches.values() for g in grads])
        else:
            for (group, divisor), grads in batches.items():
                _C.allreduce_mean_(
                    grads, state.groups[group], float(divisor * num_mb), bucket_bytes
                )

        for p, old in zip(self.params, self._stash or []):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        self._stash = None

    # ---- a communication hook ------------------------------------------------------------

    def set_comm_hook(self, state: Any, hook: Callable) -> None:
        """``model.register_comm_hook(state, hook)``, checked."""
        if not callable(hook):
            raise ValueError(f"register_comm_hook: the hook must be callable, got {hook!r}")
        if get_state().axis_size("tp") > 1:
            raise NotImplementedError(
                "register_comm_hook is not available with tensor_parallel_degree > 1: a "
                "tensor-parallel model reduces its gradients over two groups (dp and rdp)"
            )
        if self.model._sharded_units:
            raise NotImplementedError(
                "register_comm_hook is not available with sharded_data_parallel_degree > 1: "
                "FSDP2 reduce-scatters the gradients during the backward"
            )
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook: a hook is registered already (one per model)")
        self.comm_hook = (state, hook)

    def _reduce_with_hook(self, grads: list[torch.Tensor]) -> None:
        """The user's communication hook over buckets of ``grads`` (in order, ``bucket_bytes``
        each at most, one dtype per bucket); each result is copied back into the gradients."""
        state, hook = self.comm_hook
        bucket_bytes = self.model.bucket_bytes
        params = {id(p.grad): p for p in self.params if p.grad is not None}
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != g.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        for index, members in enumerate(buckets):
            bucket = _GradBucket(index, index == len(buckets) - 1, members, params)
            result = hook(state, bucket)
            if not isinstance(result, torch._C.Future):  # torch.futures.Future and .then()s
                raise TypeError(
                    "register_comm_hook: the hook must return a torch.futures.Future of the "
                    f"reduced buffer, got {type(result).__name__}"
                )
            reduced = result.wait()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            if reduced.numel() != bucket.buffer().numel():
                raise ValueError(
                    f"register_comm_hook: the hook returned {reduced.numel()} values for a "
                    f"bucket of {bucket.buffer().numel()}"
                )
            offset = 0
            with torch.no_grad():
                for g in members:
                    g.copy_(reduced.view(-1)[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()


class _GradBucket:
    """The bucket a communication hook gets: DDP's ``GradBucket`` methods over a flat copy of
    some gradients."""

    def __init__(self, index: int, last: bool, grads: list[torch.Tensor], params: dict):
        self._index, self._last = index, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._params = [params[id(g)] for g in grads]
        self._shapes = [g.shape for g in grads]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        sizes = [s.numel() for s in self._shapes]
        return [t.view(s) for t, s in zip(self._buffer.split(sizes), self._shapes)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)
