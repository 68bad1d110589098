"""The data-parallel gradient reduction, overlapped with the backward (design.md §2).

A ``GradReduction`` holds one fixed plan for a model: its trainable parameters in reverse
registration order (roughly the order the backward finishes them), packed into buckets per
reduction group, divisor, dtype and device. The first bucket of each kind is small (DDP's 1 MiB)
so that it fills early; the others hold up to ``bucket_cap_mb``. The plan is a function of the
model alone, so every rank of a group issues the same collectives in the same order, however its
backward went.

During the last backward of a ``backward_passes_per_step`` window (``arm``), a hook after each
parameter's gradient accumulation marks it final; a bucket whose parameters are all final, and
whose group's earlier buckets are issued, is flattened and its all-reduce started at once
(``_C.PendingAllreduces``), while the backward goes on. At the end of the step (``finish``) the
rest are issued (zeros stand in for a parameter with no gradient on this rank), all are waited,
and each gradient gets its mean. What a rank learns only at the end is agreed by smp.step's
outcome all-gather first: which parameters got a gradient anywhere (``used``), whether any rank
issued a bucket early (``issued_anywhere``: then a failed step's ranks still complete the
sequence before dropping it) and whether a gradient changed after its bucket was issued
(``stale``: a second backward in the last microbatch, or the step function editing ``.grad``;
then every rank reduces again from the final gradients).

A pipelined stage (``arm_counted``) has no single last backward: the last microbatch's backward
comes to it in pieces (one per module call, a tied weight's at both ends), and deferred weight
halves of earlier microbatches may run after it. There a parameter is final once it has had as
many accumulations in the step as it had in the last window (``segments.accumulate`` runs the
hooks as autograd's accumulator does). The counts are learned: the first window only counts and
issues every bucket at the end; a structure that changes is caught as a stale bucket (more
accumulations than expected) or merely issued late (fewer), never reduced wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from smp import _C

__all__ = ["GradReduction", "FIRST_BUCKET_BYTES"]

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket: small, so that its reduction starts early


class _Bucket:
    __slots__ = ("params", "group", "divisor", "ready", "issued", "marks")

    def __init__(self, group: str, divisor: float):
        self.params: list[torch.nn.Parameter] = []
        self.group, self.divisor = group, divisor
        self.ready: set[int] = set()  # ids of the parameters final in this backward
        self.issued = False
        self.marks: list[tuple[torch.Tensor, int]] = []  # the gradients issued, their versions

    @property
    def complete(self) -> bool:
        """Every parameter's gradient is final in this backward."""
        return len(self.ready) == len(self.params)


class GradReduction:
    """The fixed bucket plan of ``params`` and the reduction of one step at a time.

    Args:
        params: the parameters to reduce, in the model's fixed order (the same on every rank
            of their groups); parameters without elements are left out.
        key: parameter -> (group name, divisor): the group its gradient is summed over and
            what the sum is divided by.
        groups: group name -> process group.
        bucket_bytes: the largest bucket after the first of each kind.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        key: Callable[[torch.Tensor], tuple[str, float]],
        groups: dict[str, dist.ProcessGroup],
        bucket_bytes: int,
    ):
        self.local: list[tuple[torch.nn.Parameter, float]] = []  # groups of one: only divided
        self.buckets: list[_Bucket] = []
        self._where: dict[int, _Bucket] = {}
        self._order: dict[str, list[_Bucket]] = {}  # issue order per group
        self._next: dict[str, int] = {}
        self._pending: dict[str, _C.PendingAllreduces] = {}
        self.armed = False
        self._stale = False
        # Pipelined stages (arm_counted): accumulations per parameter id this window, and how
        # many made each final in the last finished window (None: no such window yet).
        self._counting = False
        self._counts: dict[int, int] = {}
        self._expected: dict[int, int] | None = None
        self.issued_early = 0  # buckets the last finished window issued during its backward
        self._absent: set[int] = set()  # ids of the parameters without a gradient last window
        # kind -> [open bucket, its bytes, buckets of this kind so far]
        open_buckets: dict[tuple, list] = {}
        for p in reversed(params):
            if p.numel() == 0:
                continue
            group, divisor = key(p)
            if dist.get_world_size(groups[group]) == 1:
                self.local.append((p, divisor))
                continue
            kind = (group, divisor, p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            current = open_buckets.get(kind)
            if current is not None:
                limit = min(bucket_bytes, FIRST_BUCKET_BYTES) if current[2] == 1 else bucket_bytes
            if current is None or current[1] + nbytes > limit:
                bucket = _Bucket(group, divisor)
                self.buckets.append(bucket)
                self._order.setdefault(group, []).append(bucket)
                if group not in self._pending:
                    self._pending[group] = _C.PendingAllreduces(groups[group])
                current = open_buckets[kind] = [bucket, 0, 1 if current is None else current[2] + 1]
            current[0].params.append(p)
            current[1] += nbytes
            self._where[id(p)] = current[0]
        for bucket in self.buckets:  # (for the model's life: inert while not armed)
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._accumulated)
        self._next = dict.fromkeys(self._order, 0)

    # ---- the step ------------------------------------------------------------------------------

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        """The coming backward (of ``roots``) is the last of the window: issue buckets as they
        become final. Parameters that got no gradient here in the last window and that this
        backward cannot reach (its autograd graph is walked only then) are final already: they
        do not hold their buckets back. Should one get a gradient after all (another backward
        follows), its bucket is stale and the window is reduced again at the end."""
        self.armed = bool(self.buckets)
        if not self.armed or not self._absent:
            return
        idle = self._absent - _reachable(roots)
        for bucket in self.buckets:
            bucket.ready.update(id(p) for p in bucket.params if id(p) in idle)
        for group in self._order:
            self._issue_ready(group)

    def arm_counted(self) -> None:
        """The coming step is the last of the window on a pipelined stage: every accumulation
        of it counts, in whatever order the stage's tasks run. A parameter is final when its
        count reaches the last finished window's; one that had none there is final from the
        start (its bucket goes out with the first issue after it). Without a finished window
        nothing is final before the end: this window only learns the counts."""
        self.armed = bool(self.buckets)
        self._counting = self.armed
        self._counts = {}
        if not self.armed or self._expected is None:
            return
        for bucket in self.buckets:
            bucket.ready.update(id(p) for p in bucket.params if not self._expected.get(id(p)))

    def issued(self) -> int:
        """How many buckets this step has issued so far."""
        return sum(b.issued for b in self.buckets)

    def stale(self) -> bool:
        """Whether a gradient changed after its bucket was issued (the issued copy is old)."""
        return self._stale or any(
            p.grad is not grad or grad._version != version
            for b in self.buckets
            if b.issued
            for p, (grad, version) in zip(b.params, b.marks)
        )

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._where[id(p)]
        final = True  # one accumulation per backward (arm), or the learned count (arm_counted)
        if self._counting:  # every accumulation counts, those after the issue too
            count = self._counts[id(p)] = self._counts.get(id(p), 0) + 1
            final = self._expected is not None and count == self._expected.get(id(p))
        if bucket.issued:  # accumulated into again: the copy being reduced is old
            self._stale = True
            return
        if not final:
            return
        bucket.ready.add(id(p))
        if bucket.complete:
            self._issue_ready(bucket.group)

    def _issue_ready(self, group: str) -> None:
        order = self._order[group]
        while self._next[group] < len(order) and order[self._next[group]].complete:
            self._issue(order[self._next[group]])

    def _issue(self, bucket: _Bucket) -> None:
        grads = [
            torch.zeros_like(p, memory_format=torch.contiguous_format) if p.grad is None else p.grad
            for p in bucket.params
        ]
        bucket.marks = [(g, g._version) for g in grads]
        self._pending[bucket.group].issue(grads, bucket.divisor)
        bucket.issued = True
        self._next[bucket.group] += 1

    def _issue_rest(self) -> None:
        for group, order in self._order.items():
            while self._next[group] < len(order):
                self._issue(order[self._next[group]])

    def finish(self, used: dict[int, bool], stale: bool) -> None:
        """Ends the window's reduction: issues the buckets not issued yet, waits for all, and
        gives every parameter ``used`` anywhere (by id) its sum over its group divided by its
        divisor. ``stale`` (agreed) reduces again from the final gradients."""
        self.issued_early = self.issued()
        self._absent = {id(p) for b in self.buckets for p in b.params if p.grad is None}
        if self._counts:  # what the next window expects (a failed or shadow one teaches nothing)
            self._expected = dict(self._counts)
        try:
            if stale:  # complete the sequence the peers expect, drop it, start over
                self._issue_rest()
                self._drain()
            self._issue_rest()
            results = {group: pending.wait() for group, pending in self._pending.items()}
        finally:
            self._drain()
        with torch.no_grad():
            for group, order in self._order.items():
                for bucket, buffer in zip(order, results[group]):
                    chunks = buffer.split([p.numel() for p in bucket.params])
                    for p, chunk in zip(bucket.params, chunks):
                        if not used.get(id(p), False):
                            continue
                        if p.grad is None:
                            p.grad = chunk.view(p.shape)
                        else:
                            p.grad.copy_(chunk.view(p.grad.shape))
            for p, divisor in self.local:
                if used.get(id(p), False):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    else:
                        p.grad.div_(divisor)

    def abort(self, issued_anywhere: bool) -> None:
        """Drops this window's reduction (a failed step). If any rank issued a bucket, this one
        completes its sequence first so that no peer waits for a collective never issued."""
        try:
            if issued_anywhere or self.issued():
                self._issue_rest()
        finally:
            self._drain()

    def _drain(self) -> None:
        for pending in self._pending.values():
            pending.drain()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.issued, bucket.marks = False, []
        self._next = dict.fromkeys(self._order, 0)
        self.armed = self._stale = self._counting = False
        self._counts = {}


def _reachable(roots: Sequence[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors whose gradients a backward of ``roots`` accumulates."""
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set = set()
    leaves: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None:
            leaves.add(id(leaf))
        stack.extend(child for child, _ in node.next_functions)
    return leaves
