"""The planner: choosing a whole parallel layout from the model, the cluster and the batch
(design.md §13). ``cluster``: the devices, links and collectives plans are priced on;
``memory``: what a model holds, traced under fake tensors, and a rank's ledger."""

from smp.planner.cluster import (
    BUILTIN_CLUSTERS,
    Cluster,
    Device,
    Link,
    calibrate_cluster,
    get_cluster,
)
from smp.planner.memory import (
    Ledger,
    MemoryTrace,
    ModuleMemory,
    StateBytes,
    peak_in_flight,
    trace_memory,
)

__all__ = [
    "BUILTIN_CLUSTERS",
    "Cluster",
    "Device",
    "Ledger",
    "Link",
    "MemoryTrace",
    "ModuleMemory",
    "StateBytes",
    "calibrate_cluster",
    "get_cluster",
    "peak_in_flight",
    "trace_memory",
]
