"""The one object that owns smp's process-wide state: config, topology and process groups.

There are no module-level process-group globals: :func:`init` builds a :class:`State` and every
other part of smp reaches it through :func:`get_state`, which fails with a clear message when
``smp.init`` has not been called.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from smp import _C
from smp.config import Config, build_config, config_source, v1_notes

__all__ = ["State", "init", "shutdown", "is_initialized", "get_state"]

logger = logging.getLogger("smp")

_OUTCOME_MARGIN = datetime.timedelta(seconds=30)
_generation = 0  # smp.init calls in this process: names each shutdown's meeting in the store

# Group names in creation order; the topology's axes plus the whole world.
_AXES = {
    "pp": _C.Axis.PP,
    "tp": _C.Axis.TP,
    "dp": _C.Axis.DP,
    "rdp": _C.Axis.RDP,
    "mp": _C.Axis.MP,
}


class _WeakList:
    """Objects in the order they were added, held weakly: iterating or indexing sees the ones
    still alive."""

    def __init__(self):
        self._refs: list[weakref.ref] = []

    def append(self, obj: Any) -> None:
        self._refs = [r for r in self._refs if r() is not None] + [weakref.ref(obj)]

    def _alive(self) -> list:
        return [obj for r in self._refs if (obj := r()) is not None]

    def __iter__(self):
        return iter(self._alive())

    def __getitem__(self, index: int) -> Any:
        return self._alive()[index]

    def __len__(self) -> int:
        return len(self._alive())


class State:
    """Everything smp knows about this process after ``smp.init``.

    Attributes:
        config: the validated :class:`smp.config.Config`.
        topology: the ``smp._C.Topology`` of the job.
        rank, world_size, local_rank, local_size: this process in the job.
        backend: "gloo" or "nccl".
        device: where this rank computes (config "device": ``cuda:<local_rank>`` with NCCL,
            else the CPU, unless set).
        groups: {"world", "pp", "tp", "dp", "rdp", "mp"} -> this rank's torch process group
            (plus "tp_order" with pp > 1 and tp > 1: see PipelineRuntime; "sdp" and
            "sdp_replicate" with sharded_data_parallel_degree > 1; with pp > 1 under NCCL,
            "pp_host", the pipeline group's gloo twin, and "pp_up" / "pp_down", its payload
            groups: see ``host_group`` and ``pipeline_payload_groups``; with tp > 1 under NCCL,
            "tp_host", the TP group's gloo twin for the agreement on regions' arguments).
        group_ranks: the same keys -> the world ranks of that group, ascending.
        owns_default_group: True when smp created the default process group (and so destroys it).
    """

    def __init__(
        self,
        config: Config,
        topology: Any,
        rank: int,
        local_rank: int,
        local_size: int,
        backend: str,
        device: torch.device,
        owns_default_group: bool,
    ):
        self.config = config
        self.loss_scale = 1.0  # fp16: the scale model.backward applies (smp.DistributedOptimizer)
        self.topology = topology
        self.rank = rank
        self.world_size = topology.world_size
        self.local_rank = local_rank
        self.local_size = local_size
        self.backend = backend
        self.owns_default_group = owns_default_group
        self.device = device
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.retired_groups: list[dist.ProcessGroup] = []  # replaced, destroyed at shutdown
        self.group_ranks: dict[str, list[int]] = {}
        # The pipeline runtimes of this job's models, held weakly (a model owns its runtime and
        # releases it with itself); shutdown() closes those alive before the groups go.
        self.runtimes = _WeakList()
        # The DistributedModels and DistributedOptimizers of this job, held weakly, newest last:
        # what smp.save_checkpoint / resume_from_checkpoint use when not given them.
        self.models = _WeakList()
        self.optimizers = _WeakList()
        # Step bookkeeping, set by smp.step while a step function runs.
        self.in_step = False
        self.step_models: list = []  # the DistributedModels given to the running step
        self.microbatch: int | None = None

    def host_group(self, name: str) -> dist.ProcessGroup:
        """The group ``name`` for host-side traffic: its gloo twin where one exists (under
        NCCL: the pipeline's headers, design.md §4.8; the TP agreement), else the group itself."""
        return self.groups.get(f"{name}_host", self.groups[name])

    def pipeline_payload_groups(self) -> list[dist.ProcessGroup]:
        """The pipeline's payload groups (ascending, descending direction), or [] where
        device tensors travel with the headers (gloo)."""
        if "pp_up" not in self.groups:
            return []
        return [self.groups["pp_up"], self.groups["pp_down"]]

    def renew_pipeline_payload_groups(self) -> None:
        """New payload groups after a failed step (every rank calls it, in the same order): a
        payload the failed step left unmatched must not meet the next step's receive. The old
        groups are aborted where torch can (NCCL)."""
        if "pp_up" not in self.groups:
            return
        old = [self.groups.pop("pp_up"), self.groups.pop("pp_down")]
        _build_payload_groups(self, datetime.timedelta(seconds=self.config.timeout_s))
        # NCCL: abort the old communicators (a payload may still be posted on them). gloo
        # (tests): the old groups stay until shutdown; destroying a gloo group a peer may still
        # be connected to can abort the process.
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        for group in old:
            if self.backend != "nccl":
                self.retired_groups.append(group)  # shutdown destroys them
                continue
            with contextlib.suppress(Exception):
                if abort is not None:
                    abort(group)
                else:
                    dist.destroy_process_group(group)

    def axis_rank(self, name: str) -> int:
        """This rank's index in its group ``name`` ("world", "pp", "tp", "dp", "rdp", "mp")."""
        return self.group_ranks[name].index(self.rank)

    def axis_size(self, name: str) -> int:
        return len(self.group_ranks[name])

    def world_rank_of(self, name: str, index: int) -> int:
        """World rank of member ``index`` of this rank's group ``name`` (ValueError if none)."""
        members = self.group_ranks[name]
        if not 0 <= index < len(members):
            raise ValueError(
                f"smp: {name} rank {index} does not exist; this rank's {name} group has "
                f"{len(members)} member(s) (world ranks {members})"
            )
        return members[index]


_state: State | None = None
_atexit_registered = False


def is_initialized() -> bool:
    """True between ``smp.init`` and ``smp.shutdown``."""
    return _state is not None


def get_state() -> State:
    """The state built by ``smp.init``; RuntimeError with the fix if it was not called."""
    if _state is None:
        raise RuntimeError(
            "smp is not initialized: call smp.init(config) first (under torchrun, or in a "
            "single process for debugging)"
        )
    return _state


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"smp.init: environment variable {name}={value!r} is not an integer"
        ) from None


def _resolve_backend(requested: str, device: str = "auto", existing: str | None = None) -> str:
    """The backend for config "backend" and "device"; ``existing``: the backend of a default
    group already initialised, which "auto" follows."""
    if requested == "auto":
        if existing is not None:
            return "nccl" if "nccl" in existing and device != "cpu" else "gloo"
        return "nccl" if torch.cuda.is_available() and device != "cpu" else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            'smp config: "backend" is "nccl" but CUDA is not available here; use "gloo" or "auto"'
        )
    return requested


def _resolve_device(requested: str, backend: str, local_rank: int) -> torch.device:
    """This rank's device (config "device"): NCCL needs one GPU per rank, gloo may share."""
    if requested == "cpu" or (requested == "auto" and backend != "nccl"):
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


# Tests only: payload groups on gloo too, so that the split of headers and payloads runs on
# CPU-only machines (with NCCL they always exist for pp > 1).
_GLOO_PAYLOAD_GROUPS = False
# Tests only: a separate gloo twin of the TP group ("tp_host") when the TP group is gloo itself,
# so that the TP agreement's exchange leaves the TP group on CPU-only machines as it does under
# NCCL (there the twin always exists for tp > 1).
_GLOO_TP_HOST_TWIN = False


def _build_payload_groups(state: State, timeout: datetime.timedelta) -> None:
    """Two groups per pipeline group, one per direction (design.md §4.8): c10d's NCCL
    point-to-point runs one communicator per pair of ranks in a group, so each ordered pair of
    stages gets its own and a send never queues behind a receive on one NCCL stream."""
    for ranks in state.topology.groups(_C.Axis.PP):
        for name in ("pp_up", "pp_down"):
            group = dist.new_group(ranks, timeout=timeout, backend=state.backend)
            if state.rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = list(ranks)


def init(config: dict[str, Any] | None = None) -> None:
    """Initialise smp: validate ``config``, join (or create) the job and build every process group.

    Under torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) this
    joins the job through ``env://``. Without those variables it runs as a single process (world
    size 1), which is handy for debugging. If torch.distributed is already initialised, its default
    group is used as it is. Calling ``init`` again replaces the previous smp state.

    Args:
        config: the keys of api.md §1. None reads them from the environment variable
            ``SMP_CONFIG`` (a JSON object or the path of a JSON file) or, if that is not set,
            ``SM_HP_MP_PARAMETERS`` (the JSON object SageMaker sets for SMP v1 scripts);
            without either every key takes its default. A dict (even {}) wins over both.
            Rank 0 logs where the configuration came from.

    Raises:
        ValueError: a bad key, value or degree — raised before any process group is created.
        RuntimeError: the launcher's environment is incomplete.
    """
    global _state, _atexit_registered, _generation
    config, source, unused = config_source(config)
    build_config(config)  # types and ranges first: nothing below runs on a bad config

    if dist.is_initialized():
        world_size = dist.get_world_size()
        rank = dist.get_rank()
    else:
        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0 if world_size == 1 else None)
    local_size = _env_int("LOCAL_WORLD_SIZE", 1 if world_size == 1 else None)
    if local_rank is None or local_size is None:
        # Launched by something that sets RANK/WORLD_SIZE but not the local variables.
        local_size = local_size or world_size
        local_rank = rank % local_size if local_rank is None else local_rank

    cfg = build_config(config, world_size=world_size)
    existing = str(dist.get_backend()) if dist.is_initialized() else None
    backend = _resolve_backend(cfg.backend, cfg.device, existing)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError('smp config: "device" is "cuda" but CUDA is not available here')
    topology = _C.Topology(
        world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_strategy
    )

    if _state is not None:
        shutdown()

    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    device = _resolve_device(cfg.device, backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_default_group = False
    if not dist.is_initialized():
        if world_size > 1 and "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                f"smp.init: WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with "
                "torchrun (e.g. torchrun --nproc_per_node 2 train.py)"
            )
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        owns_default_group = True
    elif cfg.backend != "auto" and dist.get_backend() != backend:
        raise ValueError(
            f'smp config: "backend" is {cfg.backend!r} but torch.distributed is already '
            f"initialised with {dist.get_backend()!r}; drop the key or initialise with {backend!r}"
        )

    state = State(cfg, topology, rank, local_rank, local_size, backend, device, owns_default_group)
    _generation += 1
    state.generation = _generation
    _build_groups(state, timeout)
    _state = state
    if not _atexit_registered:
        atexit.register(shutdown)  # orderly teardown if the script does not call it
        _atexit_registered = True
    if rank == 0:
        logger.info(
            "smp initialised: world %d = pp %d x tp %d x rdp %d (%s), backend %s; "
            "configuration from %s",
            world_size,
            topology.pp_size,
            topology.tp_size,
            topology.rdp_size,
            topology.placement,
            backend,
            source,
        )
        for note in v1_notes(config):
            logger.warning("%s", note)
        if unused:
            logger.warning(
                "smp: configuration from %s; %s also set and not used", source, ", ".join(unused)
            )


def _build_groups(state: State, timeout: datetime.timedelta) -> None:
    """Creates one torch process group per group of every axis, plus smp's own world group.

    Every rank calls ``new_group`` for every group in the same order (torch requires it), and keeps
    the one it belongs to. smp never hands out the default group itself, so ``timeout_s`` applies to
    every collective smp issues, whoever created the default group.
    """
    world = list(range(state.world_size))
    state.groups["world"] = dist.new_group(world, timeout=timeout)
    state.group_ranks["world"] = world
    # The step's outcome agreement waits longer than any collective inside the step: a rank that
    # failed early must still be there when a peer, stuck in a tensor-parallel collective with
    # it, times out and arrives to learn why.
    state.groups["outcome"] = dist.new_group(world, timeout=2 * timeout + _OUTCOME_MARGIN)
    state.group_ranks["outcome"] = world
    for name, axis in _AXES.items():
        for ranks in state.topology.groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if state.rank in ranks:
                state.groups[name] = group
                state.group_ranks[name] = list(ranks)
    sdp = state.config.sharded_data_parallel_degree
    if sdp > 1:
        # Sharded data parallelism: each rdp group splits into sharding groups of ``sdp``
        # consecutive members ("sdp"), which replicate one another ("sdp_replicate": the members
        # at the same index of every sharding group). design.md §7.5.
        for ranks in state.topology.groups(_C.Axis.RDP):
            ranks = sorted(ranks)
            shards = [ranks[i : i + sdp] for i in range(0, len(ranks), sdp)]
            for name, members in [("sdp", s) for s in shards] + [
                ("sdp_replicate", list(column)) for column in zip(*shards)
            ]:
                group = dist.new_group(members, timeout=timeout)
                if state.rank in members:
                    state.groups[name] = group
                    state.group_ranks[name] = members
    if state.topology.pp_size > 1 and (state.backend == "nccl" or _GLOO_PAYLOAD_GROUPS):
        # The pipeline's headers need a host-side group under NCCL; its device tensors go on
        # payload groups (design.md §4.8).
        if state.backend == "nccl":
            for ranks in state.topology.groups(_C.Axis.PP):
                group = dist.new_group(ranks, timeout=timeout, backend="gloo")
                if state.rank in ranks:
                    state.groups["pp_host"] = group
                    state.group_ranks["pp_host"] = list(ranks)
        _build_payload_groups(state, timeout)
    if state.topology.tp_size > 1 and (state.backend != "gloo" or _GLOO_TP_HOST_TWIN):
        # The TP ranks' agreement on a region's arguments exchanges host-side metadata (digests
        # of the calls' descriptions): on a gloo twin of the TP group, so that a region call
        # reads no device tensor on the host (Note [Agreement on the host], smp/tp/agreement.py).
        for ranks in state.topology.groups(_C.Axis.TP):
            group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if state.rank in ranks:
                state.groups["tp_host"] = group
                state.group_ranks["tp_host"] = list(ranks)
    if state.topology.pp_size > 1 and state.topology.tp_size > 1:
        # The pipeline's TP ranks agree on the order of their tasks over a group of their own,
        # so those messages never interleave with the TP collectives of the modules. Its
        # messages are host-side (call ids): gloo, whatever the backend.
        for ranks in state.topology.groups(_C.Axis.TP):
            group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if state.rank in ranks:
                state.groups["tp_order"] = group
                state.group_ranks["tp_order"] = list(ranks)


def _meet_in_store(state: State, timeout_s: float) -> None:
    """Waits, at most ``timeout_s``, until every rank has reached this point (best effort)."""
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        key = f"smp/shutdown/{state.generation}"
        if store.add(key, 1) == state.world_size:
            store.set(f"{key}/all", "1")
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    """Destroys smp's process groups (and the default group if smp created it). Idempotent."""
    global _state
    state, _state = _state, None
    if state is None:
        return
    # Pipeline transports first: their receiver threads use the groups destroyed below.
    for runtime in state.runtimes:
        runtime.close()
    if not dist.is_initialized():
        return
    # Destroy together: a rank tearing its gloo groups down while a peer is still inside a
    # collective on them (or still connected) aborted the process at exit ("terminate called
    # without an active exception"). The meeting goes through the rendezvous store, not a
    # collective: a collective that timed out (a peer died) stays queued on the group's worker
    # thread, and destroying the group then joins that thread forever.
    if state.world_size > 1:
        _meet_in_store(state, min(30.0, state.config.timeout_s))
    if state.owns_default_group:
        dist.destroy_process_group()
    else:
        groups = list({id(g): g for g in [*state.groups.values(), *state.retired_groups]}.values())
        while groups:  # in creation order, holding no reference afterwards
            dist.destroy_process_group(groups.pop(0))
    # A destroyed gloo group keeps its connections and threads until its last reference goes,
    # and a failed step's exception often keeps the model, and through it the groups, in a
    # reference cycle (traceback -> frame -> locals). A group whose peers have freed theirs
    # then spins its event loop on the closed connections at 100 % of a core. Collect such
    # cycles now, while every rank is tearing down together.
    del state
    gc.collect()


def __getattr__(name: str) -> Any:
    """``smp.state.cfg``: the running configuration, as SMP v1 scripts read it (e.g.
    ``smp.state.cfg.fp16``)."""
    if name == "cfg":
        return get_state().config
    raise AttributeError(f"module 'smp.state' has no attribute {name!r}")
