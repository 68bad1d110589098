"""``DistributedModel.join()``: training with uneven inputs across data-parallel replicas.

Inside the block smp.step runs one join round per step (which replicas still have data) and
records in the model's ``Join`` which ranks were active in the last step any replica ran. A
replica whose loop ends leaves the block and shadows the steps the others still run (smp.step
does that: this layer is below it, so the caller passes the shadowing in); when every replica is
done, the model is broadcast from a replica that ran the most steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from smp.dp import replicas
from smp.state import get_state

__all__ = ["Join", "joined"]


class Join:
    """The state of ``DistributedModel.join()`` on this rank."""

    def __init__(self):
        self.last_active: list[int] | None = None  # per world rank, in the last step any ran


@contextlib.contextmanager
def joined(model, shadow_steps: Callable[[], None]) -> Iterator[None]:
    """The block of ``model.join()``: ``model._join`` holds a ``Join`` inside it; on a normal
    exit ``shadow_steps()`` runs until no replica has data, then the model is synchronised.
    ``model`` is a DistributedModel (its ``_join``, ``_sharded_units``, ``module`` and
    ``bucket_bytes``)."""
    if model._join is not None:
        raise RuntimeError("DistributedModel.join() cannot be nested")
    state = get_state()
    if state.config.shard_optimizer_state and state.axis_size("rdp") > 1:
        raise NotImplementedError(
            "DistributedModel.join() does not work with shard_optimizer_state yet: a "
            "replica whose inputs ended would not take part in the optimizer steps of the "
            "parameters it owns; give every replica the same number of steps instead"
        )
    if model._sharded_units:
        raise NotImplementedError(
            "DistributedModel.join() does not work with sharded_data_parallel_degree > 1 "
            "yet: a replica whose inputs ended would not take part in the gathers and "
            "reductions of its sharding group; give every replica the same number of steps"
        )
    model._join = Join()
    finished = False
    try:
        yield
        finished = True
    finally:
        try:
            if finished:
                shadow_steps()
                _sync_after_join(model)
        finally:
            model._join = None


def _sync_after_join(model) -> None:
    """Parameters and buffers from the lowest rank of this rank's groups that was active in
    the last step any replica ran."""
    last = model._join.last_active
    if last is None:
        return
    members = get_state().group_ranks

    def root(group: str) -> int | None:
        return next((i for i, r in enumerate(members[group]) if last[r]), None)

    replicas.broadcast_model(model.module, root, model.bucket_bytes)
