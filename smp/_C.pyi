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

class tp:
    """smp._C.tp: tensor-parallel communication as autograd pairs (smp/pytorch/tp_comm.h).

    A submodule at runtime (an attribute of smp._C, not importable as ``smp._C.tp``); stubbed as
    a class of static functions. Every function releases the GIL while it communicates.
    """

    @staticmethod
    def copy_to_region(x: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor: ...
    @staticmethod
    def reduce_from_region(
        x: torch.Tensor, group: torch.distributed.ProcessGroup
    ) -> torch.Tensor: ...
    @staticmethod
    def scatter_to_region(
        x: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup
    ) -> torch.Tensor: ...
    @staticmethod
    def gather_from_region(
        x: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup
    ) -> torch.Tensor: ...
    @staticmethod
    def reduce_scatter(
        x: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup
    ) -> torch.Tensor: ...
    @staticmethod
    def all_gather(
        x: torch.Tensor, dim: int, group: torch.distributed.ProcessGroup
    ) -> torch.Tensor: ...

class schedule:
    """smp._C.schedule: the pipeline schedule IR (smp/schedule.h).

    A submodule at runtime (an attribute of smp._C, not importable as ``smp._C.schedule``);
    stubbed as a class. A schedule is one program per rank; a program is a list of Action or None
    (an idle step). Invalid input raises ValueError.
    """

    class Action:
        """``type`` of ``stage`` for ``microbatch``; ``str()`` is torch's form, e.g. ``1F0``."""

        def __init__(self, stage: int, type: str, microbatch: int) -> None: ...
        @property
        def stage(self) -> int: ...
        @property
        def type(self) -> str: ...
        @property
        def microbatch(self) -> int: ...
        @property
        def is_compute(self) -> bool: ...
        @staticmethod
        def parse(text: str) -> schedule.Action: ...
        def __hash__(self) -> int: ...

    class ActionCosts:
        forward: float
        full_backward: float
        backward_input: float
        backward_weight: float
        send: float
        recv: float
        latency: float
        def __init__(
            self,
            *,
            forward: float = 1.0,
            full_backward: float = 2.0,
            backward_input: float = 1.0,
            backward_weight: float = 1.0,
            send: float = 0.0,
            recv: float = 0.0,
            latency: float = 0.0,
        ) -> None: ...

    class Timeline:
        @property
        def makespan(self) -> float: ...
        @property
        def bubble_fraction(self) -> float: ...
        @property
        def peak_in_flight(self) -> list[int]: ...
        @property
        def actions(self) -> list[tuple[int, str, float, float]]: ...

    @staticmethod
    def parse_action(text: str) -> schedule.Action: ...
    @staticmethod
    def round_robin_stage_to_rank(num_stages: int, num_ranks: int) -> list[int]: ...
    @staticmethod
    def gpipe(num_stages: int, num_microbatches: int) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def one_f_one_b(
        num_stages: int, num_microbatches: int
    ) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def interleaved_1f1b(
        num_ranks: int, virtual_stages_per_rank: int, num_microbatches: int
    ) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def zero_bubble_h1(
        num_stages: int, num_microbatches: int
    ) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def add_communication(
        schedule: list[list[schedule.Action | None]],
        stage_to_rank: list[int],
        costs: schedule.ActionCosts = ...,
    ) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def validate_schedule(
        schedule: list[list[schedule.Action | None]],
        num_stages: int,
        num_microbatches: int,
        stage_to_rank: list[int],
    ) -> None: ...
    @staticmethod
    def format_grid(
        schedule: list[list[schedule.Action | None]],
        marked: list[tuple[int, int]] = ...,
    ) -> str: ...
    @staticmethod
    def to_csv(schedule: list[list[schedule.Action | None]]) -> str: ...
    @staticmethod
    def from_csv(text: str) -> list[list[schedule.Action | None]]: ...
    @staticmethod
    def simulate(
        schedule: list[list[schedule.Action | None]],
        costs: schedule.ActionCosts = ...,
        rendezvous: bool = False,
    ) -> schedule.Timeline: ...

class CountingGroup:
    """Counts the ops issued through ``.group``: {op kind: (calls, input bytes)}."""

    def __init__(self, group: torch.distributed.ProcessGroup) -> None: ...
    @property
    def group(self) -> torch.distributed.ProcessGroup: ...
    def counts(self) -> dict[str, tuple[int, int]]: ...
    def reset(self) -> None: ...

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

class PipelineKind(enum.Enum):
    SIMPLE = 0
    INTERLEAVED = 1
    STATIC = 2

def parse_pipeline_kind(name: str) -> PipelineKind: ...
def pipeline_kind_name(kind: PipelineKind) -> str: ...

class TaskKind(enum.Enum):
    START_MICROBATCH = 0
    SERVE_REQUEST = 1
    RESUME = 2
    BACKWARD = 3

def task_kind_name(kind: TaskKind) -> str: ...

class Task:
    @property
    def kind(self) -> TaskKind: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def id(self) -> int: ...
    @property
    def sequence(self) -> int: ...

class ServerPolicy:
    def __init__(
        self,
        kind: str | PipelineKind,
        num_microbatches: int,
        active_microbatches: int,
        is_leader: bool,
        deferred_weight_microbatches: int = 0,
        program: list[str] = ...,
    ) -> None:
        """``program`` ("static" only, required there): this rank's actions, e.g. "1F0"."""
    def push(self, kind: TaskKind, microbatch: int, id: int) -> Task: ...
    def next(self) -> Task | None: ...
    def on_forward_done(self, microbatch: int) -> None: ...
    def on_microbatch_finished(self, microbatch: int) -> None: ...
    @property
    def kind(self) -> PipelineKind: ...
    @property
    def num_microbatches(self) -> int: ...
    @property
    def active_microbatches(self) -> int: ...
    @property
    def is_leader(self) -> bool: ...
    def num_queued(self) -> int: ...
    def num_in_flight(self) -> int: ...
    def num_started(self) -> int: ...
    def all_finished(self) -> bool: ...
    def describe(self) -> str: ...

class TransportError(RuntimeError): ...

class Transport:
    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        peers: list[int],
        timeout_s: float,
        tag: int,
    ) -> None: ...
    def start(self) -> None: ...
    def send(self, peer: int, header: list[int], tensors: list[torch.Tensor]) -> None: ...
    def recv(self, timeout_s: float) -> tuple[int, list[int], list[torch.Tensor]] | None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...
    @staticmethod
    def header_capacity(tensors: list[torch.Tensor]) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def peers(self) -> list[int]: ...
    @property
    def tag(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def started(self) -> bool: ...

class RemoteStageError(RuntimeError): ...

class ThreadState:
    """torch's thread-local state of the calling thread (at::ThreadLocalState)."""

    def __init__(self) -> None: ...

class ThreadStateGuard:
    def __init__(self, state: ThreadState) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> bool: ...

class PipelineServer:
    """The module server's loop for one step: messages in, runnable tasks out."""

    def __init__(
        self,
        transport: Transport,
        kind: str,
        num_microbatches: int,
        active_microbatches: int,
        is_leader: bool,
        deferred_weight_microbatches: int = 0,
        program: list[str] = ...,
    ) -> None: ...
    def new_id(self) -> int: ...
    def expect(self, call_id: int, kind: TaskKind, microbatch: int, worker_id: int) -> None: ...
    def next(
        self, timeout_s: float
    ) -> tuple[Task, tuple[int, list[int], list[torch.Tensor]] | None, int] | None: ...
    @property
    def policy(self) -> ServerPolicy: ...
    @property
    def announced_backward_calls(self) -> int: ...
