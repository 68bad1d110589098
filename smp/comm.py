"""Rank helpers, process groups and object collectives (api.md §2).

Groups: pp (the other stages of my model replica), tp (the ranks sharing my distributed modules),
dp (ranks holding my stage, tp included), rdp (same stage and same TP slice), mp (pp groups of my
tp group). Object collectives move picklable Python objects, never in a hot loop.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from smp import _C
from smp.state import get_state

__all__ = [
    "CommGroup",
    "RankType",
    "WORLD",
    "PP_GROUP",
    "TP_GROUP",
    "DP_GROUP",
    "RDP_GROUP",
    "MP_GROUP",
    "WORLD_RANK",
    "PP_RANK",
    "TP_RANK",
    "DP_RANK",
    "RDP_RANK",
    "MP_RANK",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "pp_rank",
    "pp_size",
    "tp_rank",
    "tp_size",
    "dp_rank",
    "dp_size",
    "rdp_rank",
    "rdp_size",
    "mp_rank",
    "mp_size",
    "get_world_process_group",
    "get_pp_process_group",
    "get_tp_process_group",
    "get_dp_process_group",
    "get_rdp_process_group",
    "get_mp_process_group",
    "broadcast",
    "send",
    "recv_from",
    "allgather",
    "barrier",
    "get_world_group",
    "get_pp_group",
    "get_tp_group",
    "get_dp_group",
    "get_rdp_group",
    "get_mp_group",
    "pp_barrier",
    "tp_barrier",
    "dp_barrier",
    "rdp_barrier",
    "mp_barrier",
]


class CommGroup(enum.Enum):
    """A group for object collectives."""

    WORLD = "world"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    DP_GROUP = "dp"
    RDP_GROUP = "rdp"
    MP_GROUP = "mp"


class RankType(enum.Enum):
    """How a peer's rank is counted: its index in the named group of the caller."""

    WORLD_RANK = "world"
    PP_RANK = "pp"
    TP_RANK = "tp"
    DP_RANK = "dp"
    RDP_RANK = "rdp"
    MP_RANK = "mp"


WORLD, PP_GROUP, TP_GROUP, DP_GROUP, RDP_GROUP, MP_GROUP = CommGroup
WORLD_RANK, PP_RANK, TP_RANK, DP_RANK, RDP_RANK, MP_RANK = RankType


def rank() -> int:
    """This process' rank in the whole job."""
    return get_state().rank


def size() -> int:
    """Number of processes in the job."""
    return get_state().world_size


def local_rank() -> int:
    """This process' index on its machine."""
    return get_state().local_rank


def local_size() -> int:
    """Number of processes on this machine."""
    return get_state().local_size


def pp_rank() -> int:
    """The pipeline stage this rank holds."""
    return get_state().axis_rank("pp")


def pp_size() -> int:
    return get_state().axis_size("pp")


def tp_rank() -> int:
    """This rank's slice of the tensor-parallel modules."""
    return get_state().axis_rank("tp")


def tp_size() -> int:
    return get_state().axis_size("tp")


def dp_rank() -> int:
    """This rank's index among the ranks holding the same stage; use it to shard data."""
    return get_state().axis_rank("dp")


def dp_size() -> int:
    return get_state().axis_size("dp")


def rdp_rank() -> int:
    return get_state().axis_rank("rdp")


def rdp_size() -> int:
    return get_state().axis_size("rdp")


def mp_rank() -> int:
    return get_state().axis_rank("mp")


def mp_size() -> int:
    return get_state().axis_size("mp")


def get_world_process_group() -> dist.ProcessGroup:
    """smp's group over every rank (created with ``timeout_s``)."""
    return get_state().groups["world"]


def get_pp_process_group() -> dist.ProcessGroup:
    return get_state().groups["pp"]


def get_tp_process_group() -> dist.ProcessGroup:
    return get_state().groups["tp"]


def get_dp_process_group() -> dist.ProcessGroup:
    return get_state().groups["dp"]


def get_rdp_process_group() -> dist.ProcessGroup:
    return get_state().groups["rdp"]


def get_mp_process_group() -> dist.ProcessGroup:
    return get_state().groups["mp"]


def _group_name(group: CommGroup | str) -> str:
    if isinstance(group, CommGroup):
        return group.value
    if isinstance(group, str) and group in {g.value for g in CommGroup}:
        return group
    raise ValueError(
        f"smp: group must be one of smp.CommGroup ({', '.join(g.name for g in CommGroup)}), "
        f"got {group!r}"
    )


def _rank_type_name(rank_type: RankType | str) -> str:
    if isinstance(rank_type, RankType):
        return rank_type.value
    if isinstance(rank_type, str) and rank_type in {r.value for r in RankType}:
        return rank_type
    raise ValueError(
        f"smp: rank_type must be one of smp.RankType ({', '.join(r.name for r in RankType)}), "
        f"got {rank_type!r}"
    )


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Runs a collective smp issues: a failure of the backend inside becomes
    ``smp._C.CollectiveError``, the type that says "a failure elsewhere" (a peer died, the
    backend timed out), as the C++ collectives raise it (smp/pytorch/collective.h). The
    backends raise plain RuntimeErrors, which a mistake in user code raises too; smp.step tells
    the cause of a failed step from its echoes by this type (design.md §4.7)."""
    try:
        yield
    except _C.CollectiveError:
        raise
    except (RuntimeError, dist.DistError) as exc:
        raise _C.CollectiveError(f"smp: {what} failed: {exc}") from exc


def _send_object(obj: Any, world_dst: int) -> None:
    state = get_state()
    if world_dst == state.rank:
        raise ValueError(f"smp: rank {state.rank} cannot send an object to itself")
    with collective(f"send to rank {world_dst}"):
        dist.send_object_list(
            [obj], dst=world_dst, group=state.groups["world"], device=_comm_device()
        )


def _comm_device():
    state = get_state()
    return state.device if state.backend == "nccl" else None


def broadcast(obj: Any, group: CommGroup | str = CommGroup.WORLD) -> None:
    """Sends ``obj`` to every other member of this rank's ``group``.

    Only the sender calls ``broadcast``; each receiver calls ``smp.recv_from(sender, rank_type)``.

    Example:
        if smp.dp_rank() == 0:
            smp.broadcast(config, smp.DP_GROUP)
        else:
            config = smp.recv_from(0, smp.DP_RANK)
    """
    state = get_state()
    for member in state.group_ranks[_group_name(group)]:
        if member != state.rank:
            _send_object(obj, member)


def send(obj: Any, dest_rank: int, rank_type: RankType | str = RankType.WORLD_RANK) -> None:
    """Sends ``obj`` to the rank whose index in this rank's ``rank_type`` group is
    ``dest_rank`` (SMP v1's argument names).

    The receiver calls ``smp.recv_from(<my index>, rank_type)``.
    """
    state = get_state()
    _send_object(obj, state.world_rank_of(_rank_type_name(rank_type), dest_rank))


def recv_from(src_rank: int, rank_type: RankType | str = RankType.WORLD_RANK) -> Any:
    """Receives an object sent by ``smp.send`` or ``smp.broadcast`` from ``src_rank`` (a
    ``rank_type`` index in this rank's group)."""
    state = get_state()
    world_src = state.world_rank_of(_rank_type_name(rank_type), src_rank)
    if world_src == state.rank:
        raise ValueError(f"smp: rank {state.rank} cannot receive an object from itself")
    box: list[Any] = [None]
    with collective(f"receive from rank {world_src}"):
        dist.recv_object_list(
            box, src=world_src, group=state.groups["world"], device=_comm_device()
        )
    return box[0]


def allgather(obj: Any, group: CommGroup | str = CommGroup.WORLD) -> list[Any]:
    """Every member of ``group`` contributes ``obj``; returns the list ordered by group index."""
    state = get_state()
    name = _group_name(group)
    out: list[Any] = [None] * state.axis_size(name)
    with collective(f"allgather over {name}"):
        dist.all_gather_object(out, obj, group=state.groups[name])
    return out


def barrier(group: CommGroup | str = CommGroup.WORLD) -> None:
    """Blocks until every member of ``group`` has reached the barrier."""
    state = get_state()
    name = _group_name(group)
    with collective(f"barrier over {name}"):
        dist.barrier(group=state.groups[name])


# ---- SMP v1's group helpers: the ranks of this rank's groups, and their barriers ---------------


def get_world_group() -> list[int]:
    """The global ranks of every process (SMP v1: a rank list, not a process group)."""
    return list(get_state().group_ranks["world"])


def get_pp_group() -> list[int]:
    """The global ranks of this rank's pipeline group (its model replica's stages)."""
    return list(get_state().group_ranks["pp"])


def get_tp_group() -> list[int]:
    """The global ranks of this rank's tensor-parallel group."""
    return list(get_state().group_ranks["tp"])


def get_dp_group() -> list[int]:
    """The global ranks holding this rank's pipeline stage (its data-parallel group)."""
    return list(get_state().group_ranks["dp"])


def get_rdp_group() -> list[int]:
    """The global ranks holding this rank's stage and tensor-parallel slice."""
    return list(get_state().group_ranks["rdp"])


def get_mp_group() -> list[int]:
    """The global ranks of this rank's model replica (its pipeline and tensor-parallel ranks)."""
    return list(get_state().group_ranks["mp"])


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)
