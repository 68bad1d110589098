"""The planner: choosing a whole parallel layout from the model, the cluster and the batch
(design.md §13). ``cluster``: the devices, links and collectives plans are priced on."""

from smp.planner.cluster import (
    BUILTIN_CLUSTERS,
    Cluster,
    Device,
    Link,
    calibrate_cluster,
    get_cluster,
)

__all__ = ["BUILTIN_CLUSTERS", "Cluster", "Device", "Link", "calibrate_cluster", "get_cluster"]
