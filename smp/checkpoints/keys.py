"""The keys smp writes into the state dicts of the model and the optimizer."""

from __future__ import annotations

__all__ = ["PARTIAL_KEY", "SCALER_KEY", "MASTER_KEY", "SHARD_KEY"]

PARTIAL_KEY = "_smp_is_partial"  # SMP v1's marker of a rank's partial state dict
SCALER_KEY = "smp_loss_scaler"  # the fp16 loss scale's state, in the optimizer's state dicts
MASTER_KEY = "smp_master"  # a float32 master weight, in its parameter's state-dict entry
# In a local_state_dict() under shard_optimizer_state: the parameter indices whose state it holds.
SHARD_KEY = "smp_shard_owned"
