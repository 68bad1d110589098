"""The cluster model that the planner prices plans on: devices, links, collectives (design.md
§13.1).

A :class:`Cluster` is ``num_devices`` identical devices, ``devices_per_node`` to a node, ranked
node-major (rank r on node r // devices_per_node, as torchrun numbers them). It answers what a
piece of work costs there:

- compute: :meth:`Device.matmul_time` (a matmul's FLOPs at the device's peak for the dtype, times
  an efficiency that depends on the matmul's size: small matmuls do not fill the device) and
  :meth:`Device.memory_time` (memory-bound work, at the achievable memory bandwidth);
- communication: each link class (``intra``: within a node, ``inter``: across nodes) is α–β, a
  message of B bytes taking ``alpha_s + B / bandwidth``; a collective over a group of ranks
  costs what the ring or tree algorithm over the group's slowest link costs
  (:meth:`Cluster.all_reduce_time` and the others), the cheaper where both apply, as NCCL picks;
- ``overlap``: the fraction of overlappable communication (data-parallel reductions behind the
  backward) that compute hides.

A group's ranks are ``base + i * stride`` for i < size (a TP group of consecutive ranks has
stride 1; its data-parallel group, stride tp · pp in smp's rank order). A group inside one node
uses the ``intra`` link. One that spans nodes uses ``inter``, whose bandwidth is per device (a
node's network bandwidth over its devices), times the group's ranks per node: the node's other
groups, which use the network at the same time in a data-parallel reduction, share the rest.

Built-in profiles (:data:`BUILTIN_CLUSTERS`) come from public data sheets and published
measurements, named in each profile's ``source``; ``"this-machine"`` is the profile
:func:`calibrate_cluster` measured here and saved (it calibrates on first use).

Example::

    cluster = get_cluster("h100", num_devices=64)
    cluster.all_reduce_time(2 * 1024**3, size=8, stride=8)  # 2 GiB of gradients over dp 8
    cluster.device.matmul_time(4096, 12288, 12288, dtype="bf16")
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BUILTIN_CLUSTERS",
    "Cluster",
    "Device",
    "HostCosts",
    "Link",
    "calibrate_cluster",
    "get_cluster",
]

_GIB = 1024**3
_MIB = 1024**2
THIS_MACHINE = "this-machine"
_FORMAT = 1  # the JSON profile's format version


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU core, for ``this-machine``).

    Attributes:
        name: what it is ("NVIDIA H100 SXM5 80GB").
        memory_bytes: the memory a process can allocate on it.
        peak_flops: dense FLOP/s per dtype name ("fp32", "tf32", "bf16", "fp16").
        memory_bandwidth: achievable memory bandwidth, bytes per second.
        matmul_curve: (FLOPs of one matmul, fraction of the dtype's peak it reaches) points,
            in increasing FLOPs; interpolated in log FLOPs, held flat beyond its ends.
        reserved_bytes: memory a rank cannot use for tensors (runtime context, communicator
            buffers, the allocator's floor).
        op_overhead_s: host time per ATen op on the critical path (eager dispatch on a CPU;
            0 where kernels queue asynchronously behind longer ones, as on GPUs).
    """

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    matmul_curve: tuple[tuple[float, float], ...]
    reserved_bytes: int = 0
    op_overhead_s: float = 0.0

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(
                f"smp: device {self.name!r}: memory_bytes ({self.memory_bytes}) and "
                f"memory_bandwidth ({self.memory_bandwidth}) must be positive"
            )
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(
                f"smp: device {self.name!r}: peak_flops ({dict(self.peak_flops)}) needs a "
                "positive FLOP/s for at least one dtype"
            )
        curve = tuple((float(f), float(e)) for f, e in self.matmul_curve)
        if not curve or any(not 0 < e <= 1 or f <= 0 for f, e in curve):
            raise ValueError(
                f"smp: device {self.name!r}: matmul_curve ({list(self.matmul_curve)}) needs "
                "(FLOPs > 0, efficiency in (0, 1]) points"
            )
        if any(b[0] <= a[0] for a, b in zip(curve, curve[1:])):
            raise ValueError(
                f"smp: device {self.name!r}: matmul_curve's FLOPs must increase ({list(curve)})"
            )
        object.__setattr__(self, "matmul_curve", curve)
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def matmul_efficiency(self, flops: float) -> float:
        """The fraction of peak a matmul of ``flops`` FLOPs reaches (the curve, interpolated)."""
        curve = self.matmul_curve
        if flops <= curve[0][0]:
            return curve[0][1]
        if flops >= curve[-1][0]:
            return curve[-1][1]
        x = math.log(flops)
        for (f0, e0), (f1, e1) in zip(curve, curve[1:]):
            if flops <= f1:
                t = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
                return e0 + t * (e1 - e0)
        raise AssertionError("unreachable: flops is inside the curve")

    def flops_per_second(self, dtype: str) -> float:
        """The dense peak for ``dtype`` (a name: "fp32", "tf32", "bf16", "fp16")."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"smp: device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; it has "
                f"{sorted(self.peak_flops)}"
            ) from None

    def matmul_time(self, m: int, n: int, k: int, dtype: str = "bf16", batch: int = 1) -> float:
        """Seconds for ``batch`` matmuls of (m × k) @ (k × n)."""
        flops = 2.0 * m * n * k
        rate = self.flops_per_second(dtype) * self.matmul_efficiency(flops)
        return batch * flops / rate

    def memory_time(self, num_bytes: float) -> float:
        """Seconds to read and write ``num_bytes`` bytes in all (memory-bound work)."""
        return num_bytes / self.memory_bandwidth

    def op_time(self, flops: float, num_bytes: float, dtype: str = "bf16") -> float:
        """One op, roofline: the slower of its FLOPs (at the matmul efficiency of its size) and
        its bytes, plus the host's overhead per op."""
        compute = 0.0
        if flops > 0:
            compute = flops / (self.flops_per_second(dtype) * self.matmul_efficiency(flops))
        return max(compute, self.memory_time(num_bytes)) + self.op_overhead_s


@dataclasses.dataclass(frozen=True)
class Link:
    """A link class, α–β: a message of B bytes takes ``alpha_s + B / bandwidth`` seconds.

    Attributes:
        alpha_s: latency per message, seconds.
        bandwidth: bytes per second one device moves over it (for ``inter``: a node's network
            bandwidth over its devices).
        collective_alpha_s: latency per step of a collective, where it differs from a
            message's; None: ``alpha_s``.
        collective_bandwidth: bytes per second a collective's step moves, reductions included,
            where it differs; None: ``bandwidth``. (gloo on a 2-core machine: ~0.4-0.8 ms a
            step and ~1.2 GB/s, against ~90 us and ~3 GB/s per message: its collectives
            reduce on the CPU and run an algorithm of their own.)
    """

    alpha_s: float
    bandwidth: float
    collective_alpha_s: float | None = None
    collective_bandwidth: float | None = None

    def __post_init__(self):
        if (
            self.alpha_s < 0
            or self.bandwidth <= 0
            or (self.collective_alpha_s is not None and self.collective_alpha_s < 0)
            or (self.collective_bandwidth is not None and self.collective_bandwidth <= 0)
        ):
            raise ValueError(
                "smp: a link needs alpha_s >= 0, bandwidth > 0, collective_alpha_s >= 0 and "
                f"collective_bandwidth > 0 (got {self.alpha_s}, {self.bandwidth}, "
                f"{self.collective_alpha_s}, {self.collective_bandwidth})"
            )

    @property
    def step_alpha_s(self) -> float:
        """The latency of one step of a collective."""
        return self.alpha_s if self.collective_alpha_s is None else self.collective_alpha_s

    @property
    def step_bandwidth(self) -> float:
        """The bandwidth of a collective's steps."""
        return self.bandwidth if self.collective_bandwidth is None else self.collective_bandwidth

    def time(self, num_bytes: float) -> float:
        return self.alpha_s + num_bytes / self.bandwidth


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """Host (CPU) time per unit of work that a roofline of the ops does not see: the Python of a
    module call, autograd's work per node, smp's per-microbatch and per-step machinery, the
    optimizer's loop over parameter tensors, FSDP2's hooks per unit. Fitted on runs
    (:func:`smp.planner.fit_host_costs`, Note [The host's costs] in smp.planner.fit); zero
    until fitted, which is right where kernels queue asynchronously behind longer ones (a GPU
    at scale) and too fast where the host is the critical path (a CPU rank, a small model).

    Attributes:
        op_s: per ATen op a module's forward runs, beyond ``Device.op_overhead_s`` (the Python
            of the torch call that issues it).
        backward_op_s: per forward ATen op, in the backward (autograd's node for it).
        module_call_s: per module call, forward (``nn.Module.__call__``, smp's hooks).
        microbatch_s: per microbatch and stage (forward and backward together).
        step_s: per step (smp.step's entry and exit, the gradients' bookkeeping).
        parameter_s: per parameter tensor on a rank and step (the optimizer's per-tensor loop,
            zeroing, the reduction's buckets).
        unit_s: per FSDP2 unit and microbatch (its pre- and post-forward and backward hooks).
    """

    op_s: float = 0.0
    backward_op_s: float = 0.0
    module_call_s: float = 0.0
    microbatch_s: float = 0.0
    step_s: float = 0.0
    parameter_s: float = 0.0
    unit_s: float = 0.0

    def __post_init__(self):
        negative = {k: v for k, v in dataclasses.asdict(self).items() if not v >= 0}
        if negative:
            raise ValueError(f"smp: host costs must be >= 0 seconds, got {negative}")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``num_devices`` identical devices, ``devices_per_node`` per node, and their links.

    Attributes:
        name: the profile's name.
        device: each device.
        num_devices: devices in all (a multiple of ``devices_per_node``).
        devices_per_node: devices sharing a node (and its ``intra`` link).
        intra: the link between devices of a node.
        inter: the link between nodes, per device.
        overlap: the fraction of overlappable communication (data-parallel reductions during
            the backward) that compute hides, in [0, 1].
        source: where the numbers come from.
        measured: what calibration measured (``this-machine``), for reports.
        call_overhead_s: the host CPU smp's pipeline runtime spends per call between stages,
            on each of the two stages, forward and again backward (design.md §4.8: 380-480 us
            per round trip and rank on the development machine; a GPU node's faster host is
            assumed at 300 us until measured).
        host: the host's costs per module call, op, microbatch, step, parameter tensor and
            FSDP2 unit (:class:`HostCosts`; fitted, zero until then).
    """

    name: str
    device: Device
    num_devices: int
    devices_per_node: int
    intra: Link
    inter: Link
    overlap: float = 0.8
    source: str = ""
    measured: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    call_overhead_s: float = 300e-6
    host: HostCosts = HostCosts()

    def __post_init__(self):
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"smp: cluster {self.name!r}: num_devices ({self.num_devices}) and "
                f"devices_per_node ({self.devices_per_node}) must be at least 1"
            )
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ValueError(
                f"smp: cluster {self.name!r}: {self.num_devices} devices do not fill whole nodes "
                f"of {self.devices_per_node}; give a multiple of devices_per_node (or fewer "
                "devices than one node)"
            )
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(
                f"smp: cluster {self.name!r}: overlap must be in [0, 1], got {self.overlap}"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.num_devices / self.devices_per_node))

    def with_devices(self, num_devices: int | None = None, devices_per_node: int | None = None):
        """The same profile with another device count or node size."""
        return dataclasses.replace(
            self,
            num_devices=self.num_devices if num_devices is None else num_devices,
            devices_per_node=self.devices_per_node
            if devices_per_node is None
            else devices_per_node,
        )

    # ---- groups and their links -----------------------------------------------------------------

    def group_nodes(self, size: int, stride: int = 1) -> int:
        """How many nodes the group of ranks 0, stride, ..., (size - 1) · stride spans (rank r is
        on node r // devices_per_node)."""
        _check_group(size, stride)
        if stride >= self.devices_per_node:  # every step moves to a later node
            return size
        # Steps shorter than a node skip none: every node from the first rank's to the last's.
        return (size - 1) * stride // self.devices_per_node + 1

    def group_link(self, size: int, stride: int = 1) -> Link:
        """The link a collective over that group runs at: ``intra`` inside a node; across nodes,
        ``inter``'s latency and its per-device bandwidth times the group's ranks per node (the
        node's other groups share the rest), at most ``intra``'s."""
        nodes = self.group_nodes(size, stride)
        if nodes == 1:
            return self.intra
        per_node = max(1, size // nodes)
        return Link(
            max(self.inter.alpha_s, self.intra.alpha_s),
            min(self.intra.bandwidth, self.inter.bandwidth * per_node),
            max(self.inter.step_alpha_s, self.intra.step_alpha_s),
            min(self.intra.step_bandwidth, self.inter.step_bandwidth * per_node),
        )

    # ---- collectives ----------------------------------------------------------------------------

    def p2p_time(self, num_bytes: float, across_nodes: bool = False) -> float:
        """One message between two ranks (a pipeline send)."""
        return (self.inter if across_nodes else self.intra).time(num_bytes)

    def all_reduce_time(self, num_bytes: float, size: int, stride: int = 1) -> float:
        """An all-reduce of ``num_bytes`` (each rank's whole buffer) over the group: the cheaper
        of a ring (2(n-1) steps of B/n) and a double binary tree (2⌈log2 n⌉ latencies, the
        buffer pipelined up and down)."""
        if size == 1:
            return 0.0
        link = self.group_link(size, stride)
        alpha, bandwidth = link.step_alpha_s, link.step_bandwidth
        ring = 2 * (size - 1) * (alpha + num_bytes / size / bandwidth)
        tree = 2 * math.ceil(math.log2(size)) * alpha + 2 * num_bytes / bandwidth
        return min(ring, tree)

    def all_gather_time(self, num_bytes: float, size: int, stride: int = 1) -> float:
        """An all-gather whose result is ``num_bytes`` on each rank (a ring: n-1 steps of B/n)."""
        if size == 1:
            return 0.0
        link = self.group_link(size, stride)
        return (size - 1) * (link.step_alpha_s + num_bytes / size / link.step_bandwidth)

    def reduce_scatter_time(self, num_bytes: float, size: int, stride: int = 1) -> float:
        """A reduce-scatter of ``num_bytes`` per rank (each keeps 1/n): as an all-gather."""
        return self.all_gather_time(num_bytes, size, stride)

    # ---- files ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["device"]["matmul_curve"] = [list(p) for p in self.device.matmul_curve]
        out["format"] = _FORMAT
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        data = dict(data)
        version = data.pop("format", _FORMAT)
        if version != _FORMAT:
            raise ValueError(
                f"smp: a cluster profile of format {version}; this smp reads format {_FORMAT} "
                "(calibrate again: smp.calibrate_cluster())"
            )
        try:
            device = _device_from(data.pop("device"))
            return cls(
                device=device,
                intra=Link(**data.pop("intra")),
                inter=Link(**data.pop("inter")),
                host=HostCosts(**data.pop("host", {})),
                **data,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"smp: not a cluster profile ({exc})") from None

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile as JSON (through a temporary file, so a reader never sees half)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Cluster:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"smp: cluster profile {str(path)!r} is not JSON: {exc}") from None
        return cls.from_dict(data)


def _device_from(data: Mapping[str, Any]) -> Device:
    data = dict(data)
    data["matmul_curve"] = tuple(tuple(p) for p in data["matmul_curve"])
    return Device(**data)


def _check_group(size: int, stride: int) -> None:
    if size < 1 or stride < 1:
        raise ValueError(f"smp: a group needs size >= 1 and stride >= 1 (got {size}, {stride})")


# ---- built-in profiles ---------------------------------------------------------------------------


def _saturating_curve(peak: float, best: float, half_s: float) -> tuple[tuple[float, float], ...]:
    """Efficiency points e(F) = best · F / (F + F½), F½ = the FLOPs the device does in
    ``half_s`` at peak: a matmul reaches half its best rate when its work is as long as the fixed
    cost of a kernel (launch, tail), about ``half_s``. Points at each decade of FLOPs."""
    half = peak * half_s
    return tuple((10.0**d, best * 10.0**d / (10.0**d + half)) for d in range(6, 15))


def _gpu_cluster(
    name: str,
    device: str,
    memory_mib: int,
    bf16: float,
    fp32: float,
    tf32: float,
    hbm: float,
    best: float,
    nvlink: float,
    network: float,
    network_alpha: float,
    source: str,
) -> Cluster:
    return Cluster(
        name=name,
        device=Device(
            name=device,
            memory_bytes=memory_mib * _MIB,
            peak_flops={"bf16": bf16, "fp16": bf16, "tf32": tf32, "fp32": fp32},
            memory_bandwidth=hbm,
            matmul_curve=_saturating_curve(bf16, best, 10e-6),
            reserved_bytes=_GIB,
        ),
        num_devices=8,
        devices_per_node=8,
        intra=Link(6e-6, nvlink),
        inter=Link(network_alpha, network),
        overlap=0.8,
        source=source,
    )


# Dense peaks and memory from NVIDIA's data sheets (SXM parts); memory_bytes is what the driver
# reports as total (nvidia-smi), memory bandwidth and link bandwidth the achievable fraction
# (~85 % of HBM's; NCCL's all_reduce_perf bus bandwidth on NVLink; ~90 % of the network's line
# rate per GPU). The best matmul efficiency is cuBLAS's on large bf16 GEMMs as published
# (A100 ~250-280 of 312 TFLOP/s, H100 ~650-750 of 989). Latencies are NCCL's small-message
# order of magnitude. Calibrate a real cluster to replace them.
BUILTIN_CLUSTERS: dict[str, Cluster] = {
    "a100-40gb": _gpu_cluster(
        "a100-40gb", "NVIDIA A100 SXM4 40GB", 40_960, 312e12, 19.5e12, 156e12, 1.3e12, 0.82,
        230e9, 5.6e9, 20e-6,
        "A100 data sheet; p4d.24xlarge: 8 GPUs, NVLink 600 GB/s, 400 Gbps EFA per node",
    ),
    "a100-80gb": _gpu_cluster(
        "a100-80gb", "NVIDIA A100 SXM4 80GB", 81_920, 312e12, 19.5e12, 156e12, 1.75e12, 0.82,
        230e9, 22.5e9, 12e-6,
        "A100 data sheet; DGX A100: 8 GPUs, NVLink 600 GB/s, 8 x 200 Gbps HDR InfiniBand",
    ),
    "h100": _gpu_cluster(
        "h100", "NVIDIA H100 SXM5 80GB", 81_559, 989e12, 67e12, 495e12, 2.9e12, 0.72,
        370e9, 45e9, 12e-6,
        "H100 data sheet; DGX H100: 8 GPUs, NVLink 900 GB/s, 8 x 400 Gbps NDR InfiniBand",
    ),
    "h200": _gpu_cluster(
        "h200", "NVIDIA H200 SXM 141GB", 143_771, 989e12, 67e12, 495e12, 4.1e12, 0.74,
        370e9, 45e9, 12e-6,
        "H200 data sheet; HGX H200: 8 GPUs, NVLink 900 GB/s, 8 x 400 Gbps NDR InfiniBand",
    ),
}  # fmt: skip


def _profile_dir() -> Path:
    """Where calibrated profiles are kept: $SMP_CACHE_DIR, else ~/.cache/smp."""
    base = os.environ.get("SMP_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "smp"


def _this_machine_path() -> Path:
    return _profile_dir() / "cluster-this-machine.json"


def get_cluster(
    cluster: str | os.PathLike | Mapping[str, Any] | Cluster,
    *,
    num_devices: int | None = None,
    devices_per_node: int | None = None,
) -> Cluster:
    """A cluster profile: a built-in name (:data:`BUILTIN_CLUSTERS`), ``"this-machine"`` (the
    calibrated profile, measured now if none was saved), a JSON file's path, a dict as
    :meth:`Cluster.to_dict` writes, or a :class:`Cluster`; with the device count and node size
    given here, when given.

    Raises:
        ValueError: an unknown name, a file that is not a profile, or device counts that do not
            fill whole nodes.
    """
    if isinstance(cluster, Cluster):
        found = cluster
    elif isinstance(cluster, Mapping):
        found = Cluster.from_dict(cluster)
    elif str(cluster) == THIS_MACHINE:
        path = _this_machine_path()
        found = Cluster.load(path) if path.exists() else calibrate_cluster(path)
    elif str(cluster) in BUILTIN_CLUSTERS:
        found = BUILTIN_CLUSTERS[str(cluster)]
    elif Path(cluster).suffix == ".json" or Path(cluster).exists():
        if not Path(cluster).exists():
            raise ValueError(f"smp: no cluster profile at {str(cluster)!r}")
        found = Cluster.load(cluster)
    else:
        names = ", ".join([*BUILTIN_CLUSTERS, THIS_MACHINE])
        raise ValueError(
            f"smp: unknown cluster {str(cluster)!r}: give one of {names}, or a profile's JSON path"
        )
    if num_devices is not None or devices_per_node is not None:
        found = found.with_devices(num_devices, devices_per_node)
    return found


# ---- calibration -------------------------------------------------------------------------------
#
# Note [Calibrating this machine]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# smp runs one rank per core here (gloo, one thread per process), so a device is one core:
# matmuls and the memory bandwidth are measured on one thread, a device's memory is the
# machine's over its cores (ranks share it), and its reserved memory is what a rank holds before
# any model (an interpreter with torch and a gloo group: the resident set of a fresh rank). The
# links are gloo between two local processes, fitted α–β on one-way message times (half a
# ping-pong's median) by least squares of the relative error, the only link class a single
# machine has; a two-rank all-reduce is measured beside it and its error against the ring model
# is kept in ``measured`` (the planner's collectives are those models). Each measurement is the
# median of repeats after warm-ups; the machine's speed drifts, so a profile is a snapshot
# (``measured["date"]``).

_MATMUL_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
_P2P_SIZES = (4, 4096, 65536, 1 << 20, 8 << 20)
_ALLREDUCE_SIZES = (4096, 1 << 20, 8 << 20)


def _median_time(fn, min_seconds: float, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per call, each repeat calling ``fn`` for at
    least ``min_seconds`` (after one warm-up call)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_seconds / once))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _measure_matmuls(min_seconds: float) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """(peak FLOP/s per dtype, fp32's efficiency curve) on this thread."""
    rates: dict[str, list[tuple[float, float]]] = {"fp32": [], "bf16": []}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        sizes = _MATMUL_SIZES if dtype_name == "fp32" else _MATMUL_SIZES[3::2]
        for n in sizes:
            a = torch.randn(n, n, dtype=dtype)
            b = torch.randn(n, n, dtype=dtype)
            out = torch.empty(n, n, dtype=dtype)
            seconds = _median_time(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), min_seconds)
            rates[dtype_name].append((2.0 * n**3, 2.0 * n**3 / seconds))
    peaks = {name: max(rate for _, rate in points) for name, points in rates.items()}
    curve = [(flops, min(1.0, rate / peaks["fp32"])) for flops, rate in rates["fp32"]]
    return peaks, curve


def _measure_op_overhead(min_seconds: float) -> float:
    """Seconds of one eager op on one-element tensors: the dispatch every op pays."""
    a, b = torch.ones(1), torch.ones(1)
    return _median_time(lambda: torch.add(a, b), min_seconds)


def _measure_memory_bandwidth(min_seconds: float) -> float:
    """Bytes per second of a 64 MiB copy (read and write) on this thread."""
    src = torch.ones(16 * _MIB // 4 * 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), min_seconds)
    return 2 * src.numel() * src.element_size() / seconds


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gloo_rank(rank: int, port: int, quick: bool, out) -> None:
    """One of the two calibration processes: ping-pongs and all-reduces over gloo; rank 0 puts
    the seconds it measured into ``out``."""
    import torch.distributed as dist  # noqa: PLC0415 - in the spawned process only

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        result: dict[str, Any] = {"rss_bytes": _rss_bytes(), "p2p": {}, "all_reduce": {}}
        p2p: dict[int, list[float]] = {size: [] for size in _P2P_SIZES}
        reduce: dict[int, list[float]] = {size: [] for size in _ALLREDUCE_SIZES}
        # Several passes over the sizes, so that a slow phase of the machine touches them all.
        for _ in range(1 if quick else 4):
            for size in _P2P_SIZES:
                buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
                reps = 3 if quick else (30 if size <= 65536 else 8)
                for i in range(reps + 2):
                    start = time.perf_counter()
                    if rank == 0:
                        dist.send(buf, 1)
                        dist.recv(buf, 1)
                    else:
                        dist.recv(buf, 0)
                        dist.send(buf, 0)
                    if i >= 2:
                        p2p[size].append((time.perf_counter() - start) / 2)
            for size in _ALLREDUCE_SIZES:
                # Back to back, timed as a batch: a barrier before each would time the ranks'
                # skew in leaving it (a wake-up on a busy core), not the all-reduce.
                buf = torch.zeros(size // 4, dtype=torch.float32)
                batch = 2 if quick else max(4, min(32, (1 << 23) // size))
                for i in range(3):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(batch):
                        dist.all_reduce(buf)
                    if i >= 1:
                        reduce[size].append((time.perf_counter() - start) / batch)
        result["p2p"] = {size: statistics.median(t) for size, t in p2p.items()}
        result["all_reduce"] = {size: statistics.median(t) for size, t in reduce.items()}
        dist.barrier()
        if rank == 0:
            out.put(result)
    except BaseException as exc:  # noqa: BLE001 - reported to the calibrating process
        out.put({"error": f"calibration rank {rank}: {type(exc).__name__}: {exc}"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure_gloo(quick: bool, timeout_s: float = 120.0) -> dict[str, Any]:
    """Runs :func:`_gloo_rank` in two fresh local processes; what rank 0 measured."""
    import multiprocessing  # noqa: PLC0415 - calibration only

    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, port, quick, out), daemon=True) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - queue.Empty, or a dead process's broken pipe
        result = {"error": f"no result within {timeout_s:g} s"}
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
    if "error" in result:
        raise RuntimeError(
            f"smp: calibrating gloo between two local processes failed: {result['error']}"
        )
    return result


def _fit_link(times: Mapping[int, float]) -> Link:
    """α–β by weighted least squares on one-way times t(B) = α + B/bw, minimising the relative
    error Σ ((α + βB - t) / t)²."""
    sizes = sorted(times)
    w = [1.0 / times[b] ** 2 for b in sizes]
    s_w = sum(w)
    s_b = sum(wi * b for wi, b in zip(w, sizes))
    s_bb = sum(wi * b * b for wi, b in zip(w, sizes))
    s_t = sum(wi * times[b] for wi, b in zip(w, sizes))
    s_bt = sum(wi * b * times[b] for wi, b in zip(w, sizes))
    det = s_w * s_bb - s_b * s_b
    alpha = (s_t * s_bb - s_b * s_bt) / det
    beta = (s_w * s_bt - s_b * s_t) / det
    if beta <= 0 or alpha < 0:  # noise beat the model: α from the smallest, bw from the largest
        alpha = times[sizes[0]]
        beta = max((times[sizes[-1]] - alpha) / sizes[-1], 1e-15)
    return Link(alpha, 1.0 / beta)


def _fit_collective(link: Link, times: Mapping[int, float]) -> Link:
    """``link`` with the collective step's α–β fitted to two-rank all-reduce times: a ring of two
    takes 2 steps of B/2, t(B) = 2α_c + B/bw_c, so t/2 is α–β in α_c and 2·bw_c."""
    half = _fit_link({b: t / 2 for b, t in times.items()})
    return dataclasses.replace(
        link, collective_alpha_s=half.alpha_s, collective_bandwidth=half.bandwidth / 2
    )


def calibrate_cluster(
    path: str | os.PathLike | None = None, *, quick: bool = False, verbose: bool = True
) -> Cluster:
    """Measures this machine as the cluster smp's CPU runs use (Note [Calibrating this
    machine]): one device per core, gloo links. Saves the profile as JSON (default:
    ``$SMP_CACHE_DIR/cluster-this-machine.json``, else under ``~/.cache/smp``), where
    ``get_cluster("this-machine")`` finds it. Takes under a minute (``quick``: a few seconds,
    coarser).

    Returns:
        The measured :class:`Cluster`; ``measured`` holds the raw times and the models' errors.

    Raises:
        RuntimeError: the two gloo processes could not be started or did not finish.
    """
    began = time.perf_counter()
    min_seconds = 0.002 if quick else 0.02

    def say(what: str) -> None:
        if verbose:
            print(f"smp: calibrating this machine: {what} ({time.perf_counter() - began:.1f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        say("matmuls on one core")
        peaks, curve = _measure_matmuls(min_seconds)
        say("memory bandwidth")
        bandwidth = _measure_memory_bandwidth(min_seconds)
        overhead = _measure_op_overhead(min_seconds)
    finally:
        torch.set_num_threads(threads)
    say("gloo between two processes")
    comm = _measure_gloo(quick)
    link = _fit_link(comm["p2p"])
    link = _fit_collective(link, comm["all_reduce"])
    cores = os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p2p_error = {str(b): link.time(b) / t - 1 for b, t in comm["p2p"].items()}
    device = Device(
        name=f"{platform.processor() or platform.machine()} core",
        memory_bytes=memory // cores,
        peak_flops=peaks,
        memory_bandwidth=bandwidth,
        matmul_curve=tuple(curve),
        reserved_bytes=int(comm["rss_bytes"]),
        op_overhead_s=overhead,
    )
    cluster = Cluster(
        name=THIS_MACHINE,
        device=device,
        num_devices=cores,
        devices_per_node=cores,
        intra=link,
        inter=link,
        overlap=0.0,  # gloo's reductions take a core the backward would use
        call_overhead_s=450e-6,  # benchmarks/pipeline.py's round trip, CPU per rank
        source=f"measured by smp.calibrate_cluster() on {socket.gethostname()}",
        measured={},
    )
    all_reduce_error = {
        str(b): cluster.all_reduce_time(b, 2) / t - 1 for b, t in comm["all_reduce"].items()
    }
    cluster = dataclasses.replace(
        cluster,
        measured={
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cores": cores,
            "quick": quick,
            "matmul_flops_per_s": {str(f): e * peaks["fp32"] for f, e in curve},
            "p2p_s": {str(b): t for b, t in comm["p2p"].items()},
            "p2p_model_error": p2p_error,
            "all_reduce_s": {str(b): t for b, t in comm["all_reduce"].items()},
            "all_reduce_model_error": all_reduce_error,
            "seconds": time.perf_counter() - began,
        },
    )
    target = Path(path) if path is not None else _this_machine_path()
    cluster.save(target)
    say(
        f"done: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s, gloo "
        f"{link.alpha_s * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s; saved {target}"
    )
    return cluster
