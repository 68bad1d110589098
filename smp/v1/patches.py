"""SMP v1's ``patches.checkpoint`` module: the activation-checkpointing functions, the same
objects as ``smp.checkpoint`` and ``smp.checkpoint_sequential``."""

from smp.memory.activations import checkpoint, checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential"]
