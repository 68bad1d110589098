"""``smp.plan``: layouts ranked by predicted throughput, each with its per-rank memory ledger, and
every rejected layout with its reason (design.md §13.3).

A candidate is a layout (pp × tp × dp over the cluster's devices, with the data-parallel ranks
replicating, sharding the optimizer state, or sharding everything), a microbatch size and count
(``global_batch = dp × microbatches × microbatch size``), a pipeline schedule and whether the
repeated blocks are activation-checkpointed. For each, from one profile of the model
(smp.planner.profile, fake tensors, no memory):

1. **The partition smp will make**: the partitioner's own ``build_plan`` on the profile's traces
   (the FLOPs and bytes smp's tracer would record), so stages hold what they will hold.
2. **Memory per rank** (smp.planner.memory.Ledger): the stage's parameters times the bytes per
   parameter of the precision and sharding, its modules' saved activations scaled to the
   microbatch size times the microbatches in flight (the schedule IR's simulation; checkpointed
   blocks keep their inputs, plus one block's activations while it is recomputed), and the
   device's reserved memory. A candidate whose largest rank does not fit is rejected, naming
   the rank and by how much.
3. **Step time**: each stage's forward as the roofline of its ops on the device (FLOPs at the
   matmul efficiency of their size, bytes at the memory bandwidth, the host's overhead per op),
   the backward twice that (plus a forward per checkpointed block), crossings as pipeline sends
   over the group's link; the schedule IR simulates the pipeline with those costs per stage; the
   data-parallel reduction is added where compute does not hide it (the cluster's ``overlap``),
   and the optimizer's step as memory-bound work; the host's work the roofline does not see
   (per op, module call, microbatch, step, parameter tensor, FSDP2 unit) at the cluster's
   fitted ``HostCosts`` (smp.planner.fit).

Not planned yet (each such candidate is rejected with this reason): sharded data parallelism
under pipeline parallelism and fp16 with sharded data parallelism (smp refuses both today).
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import dataclasses
import functools
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from smp import _C
from smp.core.rng import streams_without_init
from smp.core.timeline import TimedAction, Timeline
from smp.memory.activations import set_activation_checkpointing
from smp.partitioning.plan import build_plan
from smp.planner.cluster import Cluster, get_cluster
from smp.planner.memory import Ledger, StateBytes, peak_in_flight
from smp.planner.profile import DTYPE_NAMES, ModelProfile, largest_module_list, profile_model
from smp.tp.functional import local_only
from smp.tp.lm_head import distribute_lm_head
from smp.tp.registry import distribute_marked_modules, set_tensor_parallelism

__all__ = ["Plan", "Plans", "Rejected", "plan"]

_GIB = 1024**3
_BUCKET_BYTES = 25 * 1024**2  # smp.DistributedModel's default bucket_cap_mb


@dataclasses.dataclass
class Plan:
    """A layout to run: ``config`` is the dict ``smp.init`` takes; ``checkpointing`` the module
    paths to give ``smp.set_activation_checkpointing``; ``predicted`` the step time, throughput,
    MFU, each rank's peak memory and its ledger; ``stages`` each stage's modules."""

    config: dict[str, Any]
    checkpointing: list[str]
    predicted: dict[str, Any]
    stages: list[list[str]]
    timeline: Timeline | None = dataclasses.field(default=None, repr=False)
    """The predicted pipeline, as smp.last_step_timeline() draws a real one (one rank per
    stage; ``save_chrome_trace`` writes it for Perfetto)."""
    # _price with everything but the cluster: priced_on's (not pickled; a copy has none)
    _priced: Callable[..., Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    def priced_on(self, cluster: Cluster) -> Plan | Rejected:
        """The same candidate priced on another profile of its cluster (a calibration, fitted
        host costs): a new plan, or why it does not fit there. Raises ValueError for a plan
        that was copied or unpickled (it keeps its inputs in this process only)."""
        if self._priced is None:
            raise ValueError(
                "smp: this plan has no pricing inputs (it was copied or unpickled); plan again"
            )
        return self._priced(cluster=cluster, cache={})

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_priced"] = None
        return state

    def apply(self, model: nn.Module) -> None:
        """Prepares ``model`` (not yet wrapped) as planned: marks all of it for tensor
        parallelism when the plan has ``tensor_parallel_degree > 1`` (as creating it under
        ``smp.tensor_parallelism()`` would), and checkpoints the planned blocks."""
        if self.config.get("tensor_parallel_degree", 1) > 1:
            set_tensor_parallelism(model, True)
        for path in self.checkpointing:
            set_activation_checkpointing(model.get_submodule(path))

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "checkpointing": self.checkpointing,
            "predicted": self.predicted,
        }

    def summary(self) -> str:
        p = self.predicted
        c = self.config
        layout = (
            f"pp {c['pipeline_parallel_degree']} × tp {c['tensor_parallel_degree']} × dp "
            f"{p['data_parallel_degree']}"
        )
        sharding = (
            f", sdp {c['sharded_data_parallel_degree']}"
            if c.get("sharded_data_parallel_degree", 1) > 1
            else (", ZeRO-1" if c.get("shard_optimizer_state") else "")
        )
        schedule = c.get("pipeline_schedule") or c.get("pipeline", "")
        schedule = f", {schedule}" if c["pipeline_parallel_degree"] > 1 else ""
        saving = f", checkpointing {len(self.checkpointing)} blocks" if self.checkpointing else ""
        return (
            f"{layout}{sharding}, {c['microbatches']} × {p['microbatch_size']} samples"
            f"{schedule}{saving}: "
            f"{p['step_time_s'] * 1e3:.1f} ms/step, {p['samples_per_s']:.1f} samples/s, MFU "
            f"{p['mfu']:.1%}, peak {_human(max(p['memory_bytes']))}"
        )


@dataclasses.dataclass
class Rejected:
    """A candidate layout and why it cannot run (or is not planned)."""

    config: dict[str, Any]
    reason: str


@dataclasses.dataclass
class Plans:
    """``smp.plan``'s result: ``plans`` best first, ``rejected`` with their reasons."""

    plans: list[Plan]
    rejected: list[Rejected]

    def __getitem__(self, index: int) -> Plan:
        return self.plans[index]

    def __len__(self) -> int:
        return len(self.plans)

    def __iter__(self):
        return iter(self.plans)

    def to_json(self) -> dict[str, Any]:
        """``{"plans": [...], "rejected": [...]}``, as ``python -m smp.planner --json`` writes."""
        return {
            "plans": [p.to_dict() for p in self.plans],
            "rejected": [{"config": r.config, "reason": r.reason} for r in self.rejected],
        }

    def explain(self, top: int = 3) -> str:
        """The best plans side by side: each one's layout, prediction and ledger of its fullest
        rank, with what it changes against the first."""
        if not self.plans:
            reasons = sorted({r.reason for r in self.rejected})
            return "no plan fits; reasons:\n" + "\n".join(f"  - {r}" for r in reasons[:10])
        lines = []
        best = self.plans[0].predicted["step_time_s"]
        for i, p in enumerate(self.plans[:top]):
            delta = p.predicted["step_time_s"] / best - 1
            lines.append(f"{i + 1}. {p.summary()}" + (f"  ({delta:+.1%} step time)" if i else ""))
            rank = max(
                range(len(p.predicted["memory_bytes"])), key=p.predicted["memory_bytes"].__getitem__
            )
            ledger = p.predicted["ledger"][rank]
            parts = ", ".join(
                f"{k} {_human(ledger[k])}"
                for k in ("parameters", "gradients", "optimizer", "activations", "reserved")
            )
            lines.append(f"   rank {rank}: {parts}; {ledger['in_flight']} microbatches in flight")
        lines.append(f"{len(self.rejected)} candidates rejected")
        return "\n".join(lines)


# ---- candidates ---------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_dim(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(
        "smp.plan: example_inputs hold no tensor with a batch dimension (dim 0); give the "
        "inputs of a small batch, as the model takes them"
    )


def _repeated_blocks(model: nn.Module) -> list[str]:
    """The paths of the layers of the model's largest ``nn.ModuleList`` (its transformer
    blocks): what activation checkpointing checkpoints."""
    found = largest_module_list(model)
    if found is None or len(found[1]) < 2:
        return []
    path, blocks = found
    return [f"{path}.{i}" if path else str(i) for i in range(len(blocks))]


def _layers(model: nn.Module) -> list[str]:
    """Every layer of the model's layer lists (the children of each ``nn.ModuleList`` of two or
    more: an encoder's and a decoder's blocks alike), for backward's working set."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            out.extend(f"{path}.{i}" if path else str(i) for i in range(len(module)))
    return out


def _outside(profile: ModelProfile, layers: Sequence[str]) -> dict[str, int]:
    """Each module outside every layer, with what its own code saved (the head, the loss)."""
    inside = set(layers)

    def below_a_layer(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in inside for i in range(1, len(parts) + 1))

    return {
        name: record.activation_bytes
        for name, record in profile.modules.items()
        if not below_a_layer(name)
    }


def _states(dtype: torch.dtype, optimizer_shards: int, all_shards: int) -> StateBytes:
    """Adam's bytes per parameter as smp holds them: an fp32 model 4 + 4 + 8; a 16-bit one its
    weights and gradients plus fp32 masters with their gradients and the moments (2 + 2 + 16)."""
    if dtype in (torch.bfloat16, torch.float16):
        states = StateBytes(weight=2, gradient=2, optimizer=16)
    else:
        states = StateBytes(weight=4, gradient=4, optimizer=8)
    return dataclasses.replace(
        states,
        optimizer_shards=max(optimizer_shards, all_shards),
        weight_shards=all_shards,
        gradient_shards=all_shards,
    )


_SCHEDULES = {  # the pipeline's config keys -> the schedule IR's generator that models it
    ("interleaved", None): "1f1b",  # the dynamic default: bounded by 1F1B's order (§4.5)
    ("static", "1f1b"): "1f1b",
    ("static", "zbh1"): "zbh1",
    ("static", "gpipe"): "gpipe",
}


@functools.lru_cache(maxsize=256)  # a search simulates each program under many costs
def _program(name: str, pp: int, m: int):
    S = _C.schedule
    return {"1f1b": S.one_f_one_b, "zbh1": S.zero_bubble_h1, "gpipe": S.gpipe}[name](pp, m)


# ---- the plan ---------------------------------------------------------------------------------


def plan(
    model: nn.Module,
    example_inputs: Any,
    cluster: str | Cluster | Mapping[str, Any],
    global_batch: int,
    *,
    num_devices: int | None = None,
    devices_per_node: int | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    max_plans: int = 10,
    device: str | None = None,
    run: Callable[..., Any] | None = None,
    profile: ModelProfile | None = None,
    progress: bool = False,
    sample_blocks: bool = True,
) -> Plans:
    """Plans for training ``model`` on ``cluster`` with ``global_batch`` samples per step, best
    predicted throughput first.

    Args:
        model: the model as it will train (its dtype is the plan's precision); it may be on the
            meta device. It is not changed.
        example_inputs: a small batch's inputs (a tensor, a tuple of positional arguments, or a
            dict of keyword arguments); dim 0 of its tensors is the batch. Its sequence length
            is the plan's.
        cluster: a cluster name (``"h100"``, ``"this-machine"``, ...), a profile's path or dict,
            or a :class:`~smp.planner.Cluster`.
        global_batch: samples per optimizer step, over all data-parallel ranks.
        num_devices, devices_per_node: override the cluster's.
        microbatch_sizes: candidate samples per microbatch (default: powers of two that divide
            the per-replica batch).
        max_plans: how many plans to return.
        device: whose kernels' saved tensors count, "cpu" or "cuda" (default: "cpu" for
            ``this-machine``, else "cuda").
        run: ``run(model, *args, **kwargs)`` returns the loss when the model does not compute
            it itself (its memory and work count on the stages that run it).
        profile: a profile of the model made earlier (``profile_model``) to reuse.
        progress: print a line to stderr as each profile starts and what it traced.
        sample_blocks: trace a few of the repeated blocks per profile and extend to the rest
            where their structure shows they repeat and a check trace agrees (Note [Sampled
            blocks] in smp.planner.profile); False traces every block (one fake forward of the
            whole model per TP degree: minutes for a 175B model on a CPU).

    Returns:
        :class:`Plans`: ``plans[0].config`` is the dict ``smp.init`` takes.

    Raises:
        ValueError: bad arguments (named), or a model that cannot run on fake tensors.
    """
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"smp.plan: global_batch must be an int >= 1, got {global_batch!r}")
    target = get_cluster(cluster, num_devices=num_devices, devices_per_node=devices_per_node)
    if device is None:
        device = "cpu" if target.name == "this-machine" else "cuda"
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    example_batch = _batch_dim(args, kwargs)
    began = time.perf_counter()
    degrees = _divisors(target.num_devices)

    def say(what: str) -> None:
        if progress:
            print(
                f"smp.plan: {what} ({time.perf_counter() - began:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    if profile is None:
        say(f"profiling {type(model).__name__} (1 of {len(degrees)} profiles)")
        profile = profile_model(model, args, kwargs, run=run, device=device, sample=sample_blocks)
        if profile.sampled:
            say(profile.sampled)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    blocks = _repeated_blocks(model)
    layers = _layers(model)
    flops_per_sample = sum(f for r in profile.modules.values() for f, _, _ in r.ops) / example_batch
    n = target.num_devices
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    partitions: dict[tuple[int, int], Any] = {}
    cache: dict = {}  # what candidates share: op tables' seconds, stages' modules (_seconds)
    for index, tp in enumerate(degrees):
        if tp == 1:
            layout = (model, profile)
        else:
            say(f"profiling one rank of tensor parallelism at {tp} ({index + 1} of {len(degrees)})")
            layout = _tensor_parallel(model, tp, args, kwargs, run, device, sample_blocks)
            if not isinstance(layout, str) and layout[1].sampled:
                say(layout[1].sampled)
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            base = {
                "pipeline_parallel_degree": pp,
                "tensor_parallel_degree": tp,
                "ddp": True,
            }
            if dtype is torch.bfloat16:
                base["bf16"] = True
            elif dtype is torch.float16:
                base["fp16"] = True
            if tp > 1:
                base["prescaled_batch"] = True  # the TP group shares its batch (Megatron's way)
            if isinstance(layout, str):
                rejected.append(Rejected(base, layout))
                continue
            ranked_model, ranked = layout  # the model as one TP rank holds it, and its profile
            if global_batch % dp:
                rejected.append(
                    Rejected(base, f"global batch {global_batch} is not divisible by dp {dp}")
                )
                continue
            if (tp, pp) not in partitions:
                try:
                    partitions[tp, pp] = build_plan(ranked_model, pp, ranked.traces, 0.2)
                except ValueError as exc:
                    partitions[tp, pp] = exc
            partition = partitions[tp, pp]
            if isinstance(partition, Exception):
                rejected.append(Rejected(base, f"cannot partition into {pp} stages: {partition}"))
                continue
            stage_totals = _stage_facts(ranked, partition, blocks, layers, pp)
            per_replica = global_batch // dp
            sizes = microbatch_sizes or [s for s in _divisors(per_replica) if s & (s - 1) == 0]
            for mbs in sizes:
                if per_replica % mbs:
                    continue
                m = per_replica // mbs
                for sharding in ("none", "optimizer", "all"):
                    if dp == 1 and sharding != "none":
                        continue
                    config = dict(base, microbatches=m)
                    if sharding == "optimizer":
                        config["shard_optimizer_state"] = True
                    elif sharding == "all":
                        config["sharded_data_parallel_degree"] = dp
                        if pp > 1:
                            rejected.append(
                                Rejected(
                                    config,
                                    "sharded data parallelism under pipeline parallelism is "
                                    "not built yet",
                                )
                            )
                            continue
                        if dtype is torch.float16:
                            rejected.append(
                                Rejected(
                                    config, "fp16 with sharded data parallelism is not built yet"
                                )
                            )
                            continue
                    schedules = list(_SCHEDULES) if pp > 1 else [("interleaved", None)]
                    for pipeline, schedule in schedules:
                        cfg = dict(config, pipeline=pipeline)
                        if schedule:
                            cfg["pipeline_schedule"] = schedule
                        for checkpointed in (False, True) if blocks else (False,):
                            got = _price(
                                ranked, target, partition, stage_totals, cfg, dtype,
                                mbs / example_batch, mbs, m, dp, pp,
                                _SCHEDULES[(pipeline, schedule)],
                                blocks, checkpointed, global_batch, flops_per_sample, cache,
                            )  # fmt: skip
                            if isinstance(got, Rejected):
                                rejected.append(got)
                            else:
                                plans.append(got)
    plans.sort(key=lambda p: p.predicted["step_time_s"])
    say(f"{len(plans)} plans fit, {len(rejected)} layouts rejected")
    return Plans(plans[:max_plans], rejected)


class _StandIn:
    """What smp's TP conversion and its primitives under ``local_only`` read of a TP group:
    its size, this rank (0) and that it carries host tensors."""

    _device_types = (torch.device("cpu"),)

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _tensor_parallel(
    model, tp: int, args, kwargs, run, device, sample: bool = False
) -> tuple[Any, Any] | str:
    """The model as rank 0 of a TP group of ``tp`` holds it (whole-model marking, as
    ``smp.tensor_parallelism()``: smp's own conversion, on a copy), and its profile run as
    that rank runs it (``local_only``: primitives keep their shapes and report their bytes);
    or why there is none."""
    copy = copy_module.deepcopy(model)
    set_tensor_parallelism(copy, True)
    group = _StandIn(tp)
    try:
        # A meta model's distributed modules are made on the meta device too: their weights
        # are loaded from its (meta) ones, which have no data to copy to another device.
        on_meta = any(p.is_meta for p in model.parameters())
        with (
            warnings.catch_warnings(),
            torch.device("meta") if on_meta else contextlib.nullcontext(),
        ):
            warnings.simplefilter("ignore")  # modules kept whole show in the rank's parameters
            heads, _ = distribute_lm_head(copy, group)
            copy, paths = distribute_marked_modules(copy, group)
        if not heads and not paths:
            return (
                f"no module of {type(model).__name__} is split by smp's tensor parallelism at {tp}"
            )
        with local_only(group), streams_without_init():
            return copy, profile_model(copy, args, kwargs, run=run, device=device, sample=sample)
    except Exception as exc:  # noqa: BLE001 - this degree is not planned; the others are
        return (
            f"tensor parallelism at {tp} could not be profiled: smp's conversion or the "
            f"converted model's fake forward failed ({type(exc).__name__}: {exc})"
        )


# The collectives a TP primitive issues forward and backward (smp.tp.functional).
_FORWARD = {"reduce_from_region": "all_reduce", "gather_from_region": "all_gather",
            "reduce_scatter": "reduce_scatter", "all_gather": "all_gather"}  # fmt: skip
_BACKWARD = {"copy_to_region": "all_reduce", "scatter_to_region": "all_gather",
             "reduce_scatter": "all_gather", "all_gather": "reduce_scatter"}  # fmt: skip


def _tp_seconds(cluster, collectives: Counter, tp: int, scale: float, table, cache) -> float:
    """The TP collectives' time (``collectives``: (primitive, bytes) with their counts) in the
    direction ``table`` maps (_FORWARD or _BACKWARD), cached as :func:`_seconds`."""
    key = (id(collectives), scale, id(table))
    if key not in cache:
        cost = {
            "all_reduce": cluster.all_reduce_time,
            "all_gather": cluster.all_gather_time,
            "reduce_scatter": cluster.reduce_scatter_time,
        }
        seconds = sum(
            count * cost[table[name]](nbytes * scale, tp, 1)
            for (name, nbytes), count in collectives.items()
            if name in table
        )
        cache[key] = (collectives, seconds)
    return cache[key][1]


def _stage_modules(partition, pp: int, cache: dict) -> list[list[str]]:
    """Each stage's modules, as ``PartitionPlan.stage_modules`` names them (once per partition,
    for the plans that fit)."""
    key = ("stages", id(partition))
    if key not in cache:
        cache[key] = (partition, [partition.stage_modules(st) for st in range(pp)])
    return cache[key][1]


def _stage_facts(
    profile: ModelProfile, partition, blocks: list[str], layers: list[str], pp: int
) -> list[dict]:
    """Per stage of a partition, what every candidate on it reads: ``ModelProfile.stage_totals``,
    ``message_bytes`` (``ModelProfile.message_bytes``), ``working_set`` (backward's, one
    microbatch at a time: the largest of its layers' saved activations, or of what a module
    outside the layers saved itself, such as a head's loss; the whole stage's without layers),
    and of the repeated blocks it holds,
    ``blocks`` (their paths), ``block_activation`` (the largest one's saved bytes),
    ``blocks_activation`` and ``blocks_input`` (all of theirs), ``recompute_ops`` (their ops,
    run again when checkpointed) and ``gathered`` (what FSDP2 holds whole beyond the shards,
    smp.dp.sharded: the blocks are units, the rest of the model one more, resharded after
    forward; the root unit's parameters for the whole step with their gradients before the
    reduce-scatter, two blocks' parameters, the one running and the one prefetched, with one
    block's gradients, and the flat copies of the gradients of two units' reduce-scatters in
    flight, each at most the largest unit's: measured, a GPT at one microbatch ran 3.7 % over
    without them, 1.6 % over with one)."""
    totals = profile.stage_totals(partition.assignment, pp)
    messages = profile.message_bytes(partition.assignment, pp)
    # Per stage: its largest layer's activations (None without layers), and the most a module
    # outside the layers saved itself.
    largest_layer: list[int | None] = [None] * pp
    for x in layers:
        stage = partition.assignment.get(x, 0)
        largest_layer[stage] = max(largest_layer[stage] or 0, profile.activation_bytes(x))
    largest_own = [0] * pp
    for name, nbytes in _outside(profile, layers).items():
        stage = partition.assignment.get(name, 0)
        largest_own[stage] = max(largest_own[stage], nbytes)
    for stage, facts in enumerate(totals):
        facts["message_bytes"] = messages[stage]
        layer = largest_layer[stage]
        facts["working_set"] = (
            facts["activation_bytes"] if layer is None else max(layer, largest_own[stage])
        )
        own = [b for b in blocks if partition.assignment.get(b) == stage]
        facts["blocks"] = own
        facts["block_activation"] = max((profile.activation_bytes(b) for b in own), default=0)
        facts["blocks_activation"] = profile.activation_bytes(own) if own else 0
        facts["blocks_input"] = sum(profile.traces[b].input_bytes for b in own)
        facts["recompute_ops"] = sum((profile.ops(b) for b in own), Counter())
        facts["recompute_calls"] = profile.calls(own) if own else 0
        facts["op_count"] = sum(facts["ops"].values())
        facts["recompute_op_count"] = sum(facts["recompute_ops"].values())
        block = max((profile.parameter_bytes(b) for b in own), default=0)
        on_stage = facts["parameter_bytes"]
        root = on_stage - profile.parameter_bytes(own) if own else on_stage
        facts["gathered"] = float(2 * root + 3 * block + 2 * max(root, block))
    return totals


def _seconds(device, ops: Counter, scale: float, cache: dict) -> float:
    """The device's time for ``ops`` (each distinct op with its count) at ``scale`` times the
    traced batch. A search prices the same tables at the same scales for many candidates (the
    sharding, schedule and checkpointing choices share a stage's compute): ``cache`` keeps
    them by the table's identity, with the table (so its identity is not reused)."""
    key = (id(ops), scale)
    if key not in cache:
        seconds = sum(
            count * device.op_time(flops * scale, nbytes * scale, dtype)
            for (flops, nbytes, dtype), count in ops.items()
        )
        cache[key] = (ops, seconds)
    return cache[key][1]


def _price(
    profile: ModelProfile,
    cluster: Cluster,
    partition,
    stage_totals: list[dict[str, Any]],
    config: dict[str, Any],
    dtype: torch.dtype,
    scale: float,
    mbs: int,
    m: int,
    dp: int,
    pp: int,
    schedule: str,
    blocks: list[str],
    checkpointed: bool,
    global_batch: int,
    model_flops_per_sample: float,
    cache: dict,
) -> Plan | Rejected:
    device = cluster.device
    element = torch.finfo(dtype).bits // 8
    sdp = config.get("sharded_data_parallel_degree", 1)
    states = _states(dtype, dp if config.get("shard_optimizer_state") else 1, sdp)
    if pp == 1:
        in_flight = [1]
    elif config["pipeline"] == "static":
        # The leader admits a microbatch once every earlier B of its program has finished, and
        # a stage runs whatever task is ready (design.md §4.5): a stage waiting for a
        # backward's gradient runs the next forward, so any stage may hold as many as the
        # program's fullest (measured: an HF T5's last stage under 1F1B held two at pp 2).
        in_flight = [max(peak_in_flight(schedule, pp, m))] * pp
    else:  # the dynamic policy may hold every active microbatch on any stage
        in_flight = [min(pp + 2, m)] * pp
    # Per stage: forward seconds, activation bytes per microbatch, parameters.
    forward, activations, params = [], [], []
    tp = config["tensor_parallel_degree"]
    # Per stage and microbatch, the calls between stages it takes part in.
    calls = [0.0] * pp
    for link in partition.links if pp > 1 else []:
        for stage in link.stages:
            calls[stage] += link.calls
    backward: list[float] = []
    host = cluster.host
    for stage in range(pp):
        totals = stage_totals[stage]
        comm = totals["collectives"]
        runtime = calls[stage] * cluster.call_overhead_s  # the pipeline runtime's host CPU
        compute = _seconds(device, totals["ops"], scale, cache)
        # The host's work per microbatch (Note [The host's costs] in smp.planner.fit), half of
        # the per-microbatch cost with each direction.
        ops = totals["op_count"]
        forward_host = (
            host.op_s * ops + host.module_call_s * totals["calls"] + host.microbatch_s / 2
        )
        backward_host = host.backward_op_s * ops + host.microbatch_s / 2
        forward.append(
            compute
            + _tp_seconds(cluster, comm, tp, scale, _FORWARD, cache)
            + runtime
            + forward_host
        )
        # Backward: twice the forward's compute, the TP collectives' backward, the runtime.
        backward.append(
            2 * compute
            + _tp_seconds(cluster, comm, tp, scale, _BACKWARD, cache)
            + runtime
            + backward_host
        )
        params.append(totals["parameter_bytes"] / element)
        own = totals["blocks"]
        # Backward's working set, one microbatch at a time: the gradients flowing through a
        # layer and the ones it makes are at most its saved activations again (design.md
        # §13.3). Without layers here: the stage's whole microbatch.
        block = totals["block_activation"]
        margin = totals["working_set"]
        if checkpointed and own:
            # A checkpointed block keeps its inputs; one block at a time holds its activations
            # again while it is recomputed (not per microbatch in flight).
            inputs = totals["blocks_input"]
            outside = totals["activation_bytes"] - totals["blocks_activation"]
            # While a block recomputes: its activations, the gradients flowing through it, and
            # the next block's input gradient (measured: two blocks' worth ran 2 % short).
            activations.append(((max(outside, 0) + inputs) * scale, (block + 2 * margin) * scale))
        else:
            activations.append((totals["activation_bytes"] * scale, margin * scale))
    recompute = [
        _seconds(device, totals["recompute_ops"], scale, cache)
        + host.op_s * totals["recompute_op_count"]
        + host.module_call_s * totals["recompute_calls"]
        if checkpointed
        else 0.0
        for totals in stage_totals
    ]
    gathered = [t["gathered"] if sdp > 1 else 0.0 for t in stage_totals]
    if sdp > 1 and m > 1:
        # Over the microbatches the weights stay whole and the gradients accumulate whole,
        # next to the reduce-scatter's own whole buffer at the last one.
        gathered = [
            g + params[st] * (states.weight + 2 * states.gradient) for st, g in enumerate(gathered)
        ]
    ledgers = []
    for stage in range(pp):
        kept, transient = activations[stage]
        # The pipeline's messages, for the microbatches in flight: the values that flow between
        # this stage's modules and another's and their gradients (Note [Values between
        # modules] in smp.planner.profile), on both stages until the microbatch finishes there
        # (Note [Tensors of a finished call] in smp.pipeline.runtime); FSDP2's gathered
        # parameters and unreduced gradients.
        # Twice: the receiver's leaf and the sender's own tensor, with the copy the message
        # carries, or the copy a caller keeps of an argument the owner reads when it needs it
        # (Note [Arguments fetched when read]).
        messages = 2 * stage_totals[stage]["message_bytes"] * scale if pp > 1 else 0.0
        transient += messages * in_flight[stage] + gathered[stage]
        # Weight gradients computed apart (design.md §4.4; the dynamic policy on stages after
        # the first, ZB-H1 everywhere) keep a recomputed block's activations until they run,
        # for up to min(pp, m) microbatches.
        split = schedule == "zbh1" or (config["pipeline"] != "static" and stage > 0)
        if checkpointed and pp > 1 and split:
            transient += stage_totals[stage]["blocks_activation"] * scale * min(pp, m)
        # The optimizer's step, after the activations are gone: the update's temporaries (two
        # of the largest parameter, as torch's single-tensor AdamW makes) and, under ZeRO-1,
        # the flat buffers of the owners' broadcast (smp.dp.optimizer_state: the one this rank
        # sent and the one it receives into, each at most a rank's share and the bucket).
        after = 2 * stage_totals[stage]["largest_parameter"]
        if config.get("shard_optimizer_state") and dp > 1:
            share = params[stage] * states.weight / dp + stage_totals[stage]["largest_parameter"]
            after += 2 * min(share, _BUCKET_BYTES)
        if dp > 1 and sdp == 1:  # the reduction's flat bucket of gradients, late in backward
            transient += min(params[stage] * states.gradient, _BUCKET_BYTES)
        transient = max(transient, after - kept * in_flight[stage])
        ledgers.append(
            Ledger.of(
                num_parameters=params[stage],
                activation_bytes=kept,
                in_flight=in_flight[stage],
                states=states,
                reserved=device.reserved_bytes,
                other=transient,
            )
        )
    usable = device.memory_bytes
    worst = max(range(pp), key=lambda s: ledgers[s].total)
    if ledgers[worst].total > usable:
        over = ledgers[worst].total - usable
        return Rejected(
            config,
            f"does not fit: stage {worst}'s ranks need {_human(ledgers[worst].total)}, "
            f"{_human(over)} over the device's {_human(usable)}",
        )
    # Time: the pipeline simulated with per-stage costs, then the data-parallel tail.
    if pp > 1:
        link_bytes = {}
        for link in partition.links:
            link_bytes[link.stages] = link.forward_bytes
        costs = []
        for stage in range(pp):
            crossing = link_bytes.get((stage, stage + 1), 0.0) * scale
            f = max(forward[stage], 1e-9)
            b = backward[stage] + recompute[stage]
            costs.append(
                _C.schedule.ActionCosts(
                    forward=f,
                    full_backward=max(b, 1e-9),
                    backward_input=max(b / 2, 1e-9),
                    backward_weight=max(b / 2, 1e-9),
                    latency=cluster.p2p_time(crossing),
                )
            )
        simulated = _C.schedule.simulate(_program(schedule, pp, m), costs)
        makespan = simulated.makespan
        pieces: dict[int, list[TimedAction]] = {stage: [] for stage in range(pp)}
        for rank, action, start, end in simulated.actions:
            pieces[rank].append(TimedAction(action, start, end))
    else:
        whole = backward[0] + recompute[0]
        makespan = m * (forward[0] + whole)
        pieces = {0: []}
        for mb in range(m):
            start = mb * (forward[0] + whole)
            pieces[0].append(TimedAction(f"0F{mb}", start, start + forward[0]))
            pieces[0].append(TimedAction(f"0B{mb}", start + forward[0], start + forward[0] + whole))
    grad_bytes = max(params) * states.gradient
    fsdp_host = 0.0  # FSDP2's hooks, per unit and microbatch
    if sdp > 1:
        # FSDP2 gathers each unit (the blocks, then the rest) forward and again backward, and
        # reduce-scatters its gradients, for every microbatch: a latency per unit and step.
        units = [profile.parameter_bytes(b) for b in blocks] or [sum(params) * element]
        rest = max(sum(params) * element - sum(units), 0.0)
        comm = m * sum(
            2 * cluster.all_gather_time(u / element * states.weight, sdp, pp * tp)
            + cluster.reduce_scatter_time(u / element * states.gradient, sdp, pp * tp)
            for u in [*units, rest]
            if u > 0
        )
        fsdp_host = m * host.unit_s * sum(1 for u in [*units, rest] if u > 0)
    elif config.get("shard_optimizer_state"):
        comm = cluster.reduce_scatter_time(grad_bytes, dp, pp * tp) + cluster.all_gather_time(
            max(params) * states.weight, dp, pp * tp
        )
    else:
        comm = cluster.all_reduce_time(grad_bytes, dp, pp * tp)
    exposed = (1 - cluster.overlap) * comm
    optimizer = device.memory_time(
        max(params) / states.optimizer_shards * 2 * (states.optimizer + 8)
    )
    tensors = max(totals["parameter_tensors"] for totals in stage_totals)
    optimizer += host.step_s + host.parameter_s * tensors
    step = makespan + exposed + optimizer + fsdp_host
    # Model FLOPs: the whole model's forward matmuls per sample, three times (forward and
    # backward).
    peak = device.flops_per_second(DTYPE_NAMES.get(dtype, "fp32")) * cluster.num_devices
    mfu = 3 * model_flops_per_sample * global_batch / step / peak
    # Rank r is stage (r // tp) % pp; the ranks of a stage share its ledger's dict.
    stage_ledgers = [ledger.as_dict() for ledger in ledgers]
    per_rank = [(r // tp) % pp for r in range(cluster.num_devices)]
    return Plan(
        config=config,
        checkpointing=list(blocks) if checkpointed else [],
        predicted={
            "step_time_s": step,
            "samples_per_s": global_batch / step,
            "mfu": mfu,
            "memory_bytes": [ledgers[stage].total for stage in per_rank],
            "ledger": [stage_ledgers[stage] for stage in per_rank],
            "data_parallel_degree": dp,
            "microbatch_size": mbs,
            "pipeline_seconds": makespan,
            "data_parallel_seconds": exposed,
            "optimizer_seconds": optimizer,
        },
        stages=_stage_modules(partition, pp, cache) if pp > 1 else [["<whole model>"]],
        timeline=Timeline(pieces),
        _priced=functools.partial(
            _price,
            profile,
            partition=partition,
            stage_totals=stage_totals,
            config=config,
            dtype=dtype,
            scale=scale,
            mbs=mbs,
            m=m,
            dp=dp,
            pp=pp,
            schedule=schedule,
            blocks=blocks,
            checkpointed=checkpointed,
            global_batch=global_batch,
            model_flops_per_sample=model_flops_per_sample,
        ),  # fmt: skip
    )


def _human(num_bytes: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"
