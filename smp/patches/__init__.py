"""SMP v1's ``smdistributed.modelparallel.torch.patches`` path, kept so that v1 imports such as
``from smp.patches.checkpoint import checkpoint`` resolve."""

from smp.patches import checkpoint

__all__ = ["checkpoint"]
