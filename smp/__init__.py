"""smp: model parallelism for any PyTorch model.

    import smp
    smp.init({"microbatches": 4})
    model = smp.DistributedModel(MyModel())
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(model(x), y)
        model.backward(loss)
        return loss

See docs/ and api.md for the whole API.
"""

from smp import amp, comm, kernels, nn, optimizers
from smp.checkpoints.files import load, save
from smp.checkpoints.training import CheckpointError, resume_from_checkpoint, save_checkpoint
from smp.comm import *  # noqa: F403 - rank helpers, groups and object collectives
from smp.config import Config
from smp.core.messages import WriteBackError
from smp.core.timeline import Timeline, last_step_timeline
from smp.core.tracing import is_tracing
from smp.memory.activations import checkpoint, checkpoint_sequential, set_activation_checkpointing
from smp.memory.delayed import delay_param_initialization
from smp.model import DistributedModel
from smp.optimizer import DistributedOptimizer, MasterGradientsChangedError
from smp.partitioning.plan import PartitionPlan, plan_partition
from smp.partitioning.trace import partition, set_partition
from smp.planner.cluster import calibrate_cluster
from smp.planner.plan import plan
from smp.state import init, is_initialized, shutdown
from smp.step import StepFailedError, StepOutput, microbatch, num_microbatches, step
from smp.tp.region import DivergentArgumentsError
from smp.tp.registry import (
    model_creation,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_plan,
    tp_register_with_module,
)

__version__ = "0.1.0"


__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "Config",
    "DistributedModel",
    "DistributedOptimizer",
    "step",
    "partition",
    "set_partition",
    "plan_partition",
    "PartitionPlan",
    "StepOutput",
    "StepFailedError",
    "DivergentArgumentsError",
    "WriteBackError",
    "MasterGradientsChangedError",
    "microbatch",
    "num_microbatches",
    "last_step_timeline",
    "Timeline",
    "tensor_parallelism",
    "set_tensor_parallelism",
    "model_creation",
    "tp_register",
    "tp_register_with_module",
    "tp_register_plan",
    "nn",
    "kernels",
    "amp",
    "optimizers",
    "is_tracing",
    "delay_param_initialization",
    "save",
    "CheckpointError",
    "load",
    "save_checkpoint",
    "resume_from_checkpoint",
    "set_activation_checkpointing",
    "checkpoint",
    "checkpoint_sequential",
    "calibrate_cluster",
    "plan",
    *comm.__all__,
]

# SMP v1's `patches.checkpoint` path to the functions above (imports them, so it comes last).
from smp import patches  # noqa: E402, F401
