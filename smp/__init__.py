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

from smp.comm import (
    DP_GROUP,
    DP_RANK,
    MP_GROUP,
    MP_RANK,
    PP_GROUP,
    PP_RANK,
    RDP_GROUP,
    RDP_RANK,
    TP_GROUP,
    TP_RANK,
    WORLD,
    WORLD_RANK,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_rank,
    dp_size,
    get_dp_process_group,
    get_mp_process_group,
    get_pp_process_group,
    get_rdp_process_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_rank,
    tp_size,
)
from smp.config import Config
from smp.model import DistributedModel
from smp.optimizer import DistributedOptimizer
from smp.partition import PartitionPlan, partition, plan_partition, set_partition
from smp.state import init, is_initialized, shutdown
from smp.step import StepFailedError, StepOutput, microbatch, step

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
    "microbatch",
    "CommGroup",
    "RankType",
    "WORLD",
    "PP_GROUP",
    "TP_GROUP",
    "DP_GROUP",
    "RDP_GROUP",
    "MP_GROUP",
    "WORLD_RANK",
    "PP_RANK",
    "TP_RANK",
    "DP_RANK",
    "RDP_RANK",
    "MP_RANK",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "pp_rank",
    "pp_size",
    "tp_rank",
    "tp_size",
    "dp_rank",
    "dp_size",
    "rdp_rank",
    "rdp_size",
    "mp_rank",
    "mp_size",
    "get_world_process_group",
    "get_pp_process_group",
    "get_tp_process_group",
    "get_dp_process_group",
    "get_rdp_process_group",
    "get_mp_process_group",
    "broadcast",
    "send",
    "recv_from",
    "allgather",
    "barrier",
]
