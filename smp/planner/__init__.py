"""The planner: choosing a whole parallel layout from the model, the cluster and the batch
(design.md §13). ``cluster``: the devices, links and collectives plans are priced on;
``profile``: what a model holds and runs, traced under fake tensors; ``memory``: a rank's
ledger."""

from smp.planner.cluster import (
    BUILTIN_CLUSTERS,
    Cluster,
    Device,
    HostCosts,
    Link,
    calibrate_cluster,
    get_cluster,
)
from smp.planner.fit import fit_host_costs
from smp.planner.memory import Ledger, StateBytes, peak_in_flight
from smp.planner.plan import Plan, Plans, Rejected, plan
from smp.planner.profile import ModelProfile, ModuleProfile, profile_model

__all__ = [
    "BUILTIN_CLUSTERS",
    "Cluster",
    "Device",
    "HostCosts",
    "Ledger",
    "Link",
    "ModelProfile",
    "ModuleProfile",
    "Plan",
    "Plans",
    "Rejected",
    "StateBytes",
    "calibrate_cluster",
    "fit_host_costs",
    "get_cluster",
    "peak_in_flight",
    "plan",
    "profile_model",
]
