"""Which stage owns each module: the user's pins and the tracing pass (trace), the plan the
C++ partitioner makes from them (plan), and where each rank's modules and tensors live
(placement)."""

from smp.partitioning.plan import CrossingCosts, PartitionPlan

__all__ = ["CrossingCosts", "PartitionPlan"]  # smp.partitioning.CrossingCosts: docs/guide.md
