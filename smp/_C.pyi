"""Type stubs for smp._C, the C++ core and libtorch layer (csrc/python)."""

import enum

import torch
import torch.distributed

class Error(ValueError): ...

class Axis(enum.Enum):
    PP = 0
    TP = 1
    DP = 2
    RDP = 3
    MP = 4

def axis_name(axis: Axis) -> str: ...
def canonical_placement(placement_strategy: str) -> str: ...

class Coordinates:
    pp: int
    tp: int
    rdp: int
    def __init__(self, pp: int = 0, tp: int = 0, rdp: int = 0) -> None: ...

class Topology:
    def __init__(
        self,
        world_size: int,
        pipeline_parallel_degree: int,
        tensor_parallel_degree: int,
        placement_strategy: str = "cluster",
    ) -> None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def rdp_size(self) -> int: ...
    @property
    def mp_size(self) -> int: ...
    @property
    def placement(self) -> str: ...
    def size(self, axis: Axis) -> int: ...
    def coordinates(self, rank: int) -> Coordinates: ...
    def rank_of(self, coordinates: Coordinates) -> int: ...
    def group_of(self, axis: Axis, rank: int) -> list[int]: ...
    def rank_in(self, axis: Axis, rank: int) -> int: ...
    def groups(self, axis: Axis) -> list[list[int]]: ...

def allreduce_mean_(
    tensors: list[torch.Tensor],
    group: torch.distributed.ProcessGroup,
    divisor: float,
    bucket_bytes: int,
) -> int: ...

class PartitionNode:
    name: str
    parent: int
    compute: float
    param_bytes: float
    activation_bytes: float
    pin: int
    chain: bool
    def __init__(
        self,
        *,
        name: str = "",
        parent: int = -1,
        compute: float = 0.0,
        param_bytes: float = 0.0,
        activation_bytes: float = 0.0,
        pin: int = -1,
        chain: bool = False,
    ) -> None: ...

class PartitionOptions:
    num_stages: int
    memory_weight: float
    def __init__(self, *, num_stages: int = 1, memory_weight: float = 0.2) -> None: ...

class PartitionPlan:
    @property
    def stage(self) -> list[int]: ...
    @property
    def node_cost(self) -> list[float]: ...
    @property
    def stage_cost(self) -> list[float]: ...
    @property
    def stage_param_bytes(self) -> list[float]: ...
    @property
    def stage_activation_bytes(self) -> list[float]: ...
    @property
    def stage_compute(self) -> list[float]: ...
    @property
    def max_stage_cost(self) -> float: ...
    @property
    def imbalance(self) -> float: ...

def partition(nodes: list[PartitionNode], options: PartitionOptions) -> PartitionPlan: ...
def optimal_contiguous_partition(costs: list[float], num_parts: int) -> list[int]: ...
