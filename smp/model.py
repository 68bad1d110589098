"""``smp.DistributedModel``: wraps any nn.Module for smp (api.md §3).

The class composes the concerns, each of which lives in its own package and works on the model
it is given:

- tensor parallelism (:mod:`smp.tp`): the marked modules become distributed ones at wrap time;
- the partition (:mod:`smp.partitioning`): with pp > 1 the first ``smp.step`` traces the model
  and partitions it; ``placement`` keeps each rank's own tensors on its device;
- delayed initialisation (:mod:`smp.memory.materialize`): parameters get their values once a
  rank knows which it holds;
- data parallelism (:mod:`smp.dp`): replicas start and stay equal (``replicas``), a step's
  gradients are set aside, reduced and restored (``grads``), ``join()`` (``join``), sharding
  (``sharded``);
- state dicts (:mod:`smp.checkpoints.state_dicts`).

``smp.step`` drives a step through the protocol methods near the end of the class
(``_begin_step``, ``_finish_step``, ``_abort_step`` and the outcome agreement's getters and
setters).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.checkpoints import state_dicts
from smp.core.errors import StepFailedError
from smp.dp import join as dp_join
from smp.dp import replicas, sharded
from smp.dp.grads import StepGrads, group_and_divisor
from smp.memory import delayed, materialize, offload
from smp.partitioning import placement
from smp.partitioning.plan import build_plan
from smp.partitioning.trace import trace_modules
from smp.pipeline.runtime import PipelineRuntime
from smp.state import get_state
from smp.step import shadow_steps
from smp.tp.functional import local_only
from smp.tp.lm_head import distribute_lm_head
from smp.tp.registry import alias_layer_lists, distribute_marked_modules

__all__ = ["DistributedModel"]

logger = logging.getLogger("smp")


class DistributedModel(nn.Module):
    """Wraps ``module`` so smp can run it across ranks.

    Parameters and buffers are broadcast from dp rank 0 at wrap time so every replica starts equal.
    Use ``model(...)`` and ``model.backward(loss)`` inside an ``@smp.step`` function.

    Args:
        module: any nn.Module; do not move it to a device yourself.
        trace_device: "gpu" (v1's default: this rank's device, the CPU where it has no GPU) or
            "cpu": where rank 0 traces the model to partition it (pp > 1).
        trace_execution_times: measure module times while tracing (pp > 1).
        trace_memory_usage: measure module memory while tracing (pp > 1).
        average_grads_across_microbatches: divide accumulated gradients by the microbatch count.
        backward_passes_per_step: steps whose gradients accumulate before one reduction.
        broadcast_buffers: broadcast buffers from dp rank 0 at the start of every step.
        find_unused_parameters: accepted for compatibility; smp always handles unused parameters.
        bucket_cap_mb: size of the gradient buckets of the data-parallel all-reduce.
        overlapping_allreduce: reduce gradient buckets during the step's last backward, as they
            become final (default, with the config key of that name); False reduces them all
            after the step.
        gradient_as_bucket_view: accepted for compatibility (DDP's option); a gradient that had
            none on this rank before the reduction is a view of its bucket afterwards.

    Raises:
        ValueError: a bad option, or replicas whose parameters differ in name, shape or dtype.
        NotImplementedError: a configuration this version cannot run yet (named in the message).
    """

    _smp_distributed_model = True  # how layers below this one (which cannot import it) know it

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        trace_memory_usage: bool = False,
        average_grads_across_microbatches: bool = True,
        backward_passes_per_step: int = 1,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float = 25,
        overlapping_allreduce: bool = True,
        gradient_as_bucket_view: bool = False,
    ):
        super().__init__()
        state = get_state()
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"smp.DistributedModel wraps an nn.Module, got {type(module).__name__}"
            )
        if isinstance(module, DistributedModel):
            raise ValueError("smp.DistributedModel: the module is already wrapped")
        if trace_device not in ("cpu", "gpu"):
            raise ValueError(f'trace_device must be "cpu" or "gpu", got {trace_device!r}')
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
        cfg = state.config
        # Delayed parameter initialisation: meta parameters become size-0 placeholders now;
        # each rank gives values to those it owns once the partition is known (design.md §7.4).
        # Giving delayed parameters their values frees and allocates whole weights in turn.
        self._delayed = delayed.has_delayed(module)
        with delayed.returning_memory(self._delayed):
            self._delayed_pool: dict = {}  # storages tracing freed, reused by materialize.owned
            delayed.placeholders(module)
            self.distributed_modules = _Paths()  # paths replaced by tensor-parallel versions
            if cfg.tensor_parallel_degree > 1:
                # A causal LM's head (and its tied input embedding) first: the two are split
                # together, along the vocabulary, which the module-by-module walk cannot do.
                heads, why_not = distribute_lm_head(module, state.groups["tp"])
                if why_not is not None:
                    warnings.warn(
                        f"smp: the output head of {type(module).__name__} is marked for tensor "
                        f"parallelism but is not split along the vocabulary: {why_not}",
                        stacklevel=2,
                    )
                module, self.distributed_modules = distribute_marked_modules(
                    module, state.groups["tp"]
                )
                self.distributed_modules = _Paths(heads + self.distributed_modules, module)
                if state.rank == 0 and self.distributed_modules:
                    logger.info(
                        "smp: %d module(s) split over tensor_parallel_degree %d: %s",
                        len(self.distributed_modules),
                        cfg.tensor_parallel_degree,
                        ", ".join(self.distributed_modules[:8])
                        + (" ..." if len(self.distributed_modules) > 8 else ""),
                    )
            alias_layer_lists(module)  # v1's `seq_layers` name for a marked model's layer list
            # A pipelined model stays where it was built until the partition; then each rank
            # moves only what it owns to its device (never the whole model to one GPU).
            pipelined = cfg.pipeline_parallel_degree > 1
            self.module = module if pipelined else module.to(state.device)
            self.trace_device = trace_device
            self.trace_execution_times = trace_execution_times
            self.trace_memory_usage = trace_memory_usage
            self.average_grads_across_microbatches = average_grads_across_microbatches
            self.backward_passes_per_step = backward_passes_per_step
            self.broadcast_buffers = broadcast_buffers
            self.find_unused_parameters = find_unused_parameters
            self.bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
            self.overlapping_allreduce = overlapping_allreduce
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self._partition_plan = None
            self._runtime = None  # the pipeline runtime, once partitioned with pp > 1
            # An OrderedDict: torch's RemovableHandle holds it weakly (a plain dict cannot be).
            self._post_partition_hooks: collections.OrderedDict[int, Callable] = (
                collections.OrderedDict()
            )

            # Buffers (qualified names) that a step has changed in place: saved before each step so
            # that a step can run again (smp.step, design.md §4.3).
            self._changing_buffers: set[str] = set()
            self._step_backward_count = 0
            self._step_count = 0
            self._join: dp_join.Join | None = None  # inside `with model.join():`
            self._deferred_load: tuple | None = None  # a partial state dict given before partition

            self._after_partition: list[Callable[[], None]] = []  # e.g. a checkpoint to load

            # One stage: everything is already where it runs. With pp > 1 the first smp.step traces
            # the model and partitions it (see _partition).
            self.partitioned = cfg.pipeline_parallel_degree == 1
            # Sharded data parallelism: FSDP2 over the sharding mesh, once every replica holds the
            # same values (design.md §7.5). Its parameters are new objects: the gradients' list
            # below is made after it.
            self._sharded_units: list[nn.Module] = []
            # Sharded, delayed parameters get their values one block at a time, each block
            # sharded before the next one's are made: no rank holds more than one block whole.
            per_block = self._delayed and sharded.enabled()  # (sharding implies one stage)
            if self.partitioned and not per_block:
                self._materialize_owned()
            replicas.check_replicas_match(self.module)
            if not pipelined:  # pipelined: after the partition, on the device (_place_owned)
                self._broadcast_model(lambda group: 0)  # per block: buffers (params empty yet)
            if sharded.enabled():
                replay = materialize.BlockReplay(self._delayed_pool) if per_block else None
                self._sharded_units = sharded.shard_module(self.module, replay)
                if replay is not None:
                    replay.finish()
            # The unique trainable parameters (shared ones once; sharded ones as FSDP2 made
            # them), in a fixed order: that of the gradient all-reduce, the same on every rank.
            self._grads = StepGrads(self, [p for p in self.module.parameters() if p.requires_grad])
            state.models.append(self)
            self._tracing = False

    # ---- use inside a step -------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if self._tracing:
            raise _TraceComplete()  # tracing stops after the model's forward
        return output

    def backward(self, tensors, grad_tensors=None) -> None:
        """Backward of ``tensors`` (the loss) for the current microbatch; use instead of
        ``loss.backward()`` inside an ``@smp.step`` function."""
        state = get_state()
        if not state.in_step:
            raise RuntimeError(
                "model.backward(loss) must be called inside a function decorated with @smp.step"
            )
        if not any(m is self for m in state.step_models):
            # Its gradients would be neither reduced over data parallelism nor averaged.
            raise RuntimeError(
                "model.backward: this DistributedModel is not an argument of the @smp.step "
                "function; pass it in (e.g. `def train_step(model, x, y)` called as "
                "`train_step(model, x, y)`) so that smp reduces its gradients after the step"
            )
        held = getattr(self, "_smp_held_optimizer_state", None)
        if held is not None:  # a training step whose optimizer would start without its state
            raise held.untaken()
        scale = getattr(state, "loss_scale", 1.0) if state.config.fp16 else 1.0
        if scale != 1.0:  # fp16: the loss scale (smp.DistributedOptimizer unscales)
            if grad_tensors is None:
                tensors = _scaled(tensors, scale)
            else:
                grad_tensors = _scaled(grad_tensors, scale)
        if self._runtime is not None:
            self._runtime.backward(tensors, grad_tensors)
        else:
            offload.forward_done(state.microbatch)  # offload_activations: this forward is over
            if state.microbatch == state.config.microbatches - 1:  # the step's last backward
                self._grads.arm_last_backward(tensors)
            torch.autograd.backward(tensors, grad_tensors)
        self._step_backward_count += 1

    # ---- what this rank holds ---------------------------------------------------------------

    def _owns(self, name: str) -> bool:
        """Whether the parameter/buffer/module at ``name`` (original keys) lives on this rank."""
        if self._runtime is None:
            return True
        module_path = name if name in self._runtime.modules else name.rpartition(".")[0]
        return self._runtime.assignment[module_path] == self._runtime.stage

    def local_parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The parameters this rank holds (its pipeline stage's)."""
        return (p for _, p in self.local_named_parameters(recurse=recurse))

    def local_named_parameters(self, prefix: str = "", recurse: bool = True):
        for name, p in self.module.named_parameters(recurse=recurse):
            if self._owns(name):
                yield (f"{prefix}.{name}" if prefix else name), p

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return (b for _, b in self.local_named_buffers(recurse=recurse))

    def local_named_buffers(self, prefix: str = "", recurse: bool = True):
        for name, b in self.module.named_buffers(recurse=recurse):
            if self._owns(name):
                yield (f"{prefix}.{name}" if prefix else name), b

    def local_modules(self) -> Iterator[nn.Module]:
        return (m for name, m in self.module.named_modules() if self._owns(name))

    def local_state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """This rank's part of the state dict: the original keys of its stage, its TP shards as
        they are, and v1's marker ``"_smp_is_partial": True`` (``load_state_dict`` takes it back
        on the same layout)."""
        return state_dicts.local(self, *args, **kwargs)

    def _local_state(self, *args, **kwargs) -> dict[str, Any]:
        return state_dicts.local_state(self, *args, **kwargs)

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """The full model's state dict with the original keys and shapes.

        With pipeline parallelism this is a collective over the pipeline group: every rank must
        call it; each stage contributes its part.
        """
        return state_dicts.full(self, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full state dict (original keys); each rank takes the part it holds. A partial
        one (from ``local_state_dict()``, marked ``_smp_is_partial``) is this rank's own part:
        it loads on the layout that saved it; before the first step partitions the model it is
        kept and loaded right after the partition (as in v1)."""
        return state_dicts.load(self, state_dict, strict, assign)

    def _refresh_masters(self, except_for: frozenset[int] | set[int] = frozenset()) -> None:
        """Float32 master weights follow a state loaded into this model's low-precision
        parameters (an optimizer's ``load_state_dict`` afterwards brings its own back), except
        those of the parameters (ids) in ``except_for``."""
        state_dicts.refresh_masters({id(p) for p in self.module.parameters()} - except_for)

    def _split_params(self) -> dict[str, torch.Tensor]:
        return state_dicts.split_params(self.module)

    def cpu(self) -> DistributedModel:
        """Gathers the parameters and buffers of every pipeline stage onto this rank and moves
        the model to the CPU (SMP v1). A collective over the pipeline group: every rank calls
        it. Tensor-parallel shards stay shards (the distributed modules compute on them);
        ``state_dict()`` gives them whole."""
        if self._runtime is not None:
            placement.gather_stages(self.module, self._owns)
        return super().cpu()

    @property
    def partition_plan(self):
        """The :class:`smp.PartitionPlan` this model runs with (one stage while pp = 1)."""
        if not self.partitioned:
            raise RuntimeError(
                "the model is partitioned at the first smp.step call; partition_plan and "
                "partition_report() are available after it (smp.plan_partition previews the plan)"
            )
        if self._partition_plan is None:
            self._partition_plan = build_plan(
                self.module, 1, None, get_state().config.memory_weight
            )
        return self._partition_plan

    def partition_report(self) -> str:
        """The placement table: modules, parameter and activation bytes, compute per stage."""
        return self.partition_plan.report()

    def register_post_partition_hook(
        self, hook: Callable[[DistributedModel, Any], None]
    ) -> torch.utils.hooks.RemovableHandle:
        """Calls ``hook(model, optimizer=None)`` once the model is partitioned (now, if it is).
        Returns a handle whose ``remove()`` unregisters it (SMP v1)."""
        handle = torch.utils.hooks.RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        if self.partitioned:
            hook(self, None)
        return handle

    # ---- SMP v1's model surface ------------------------------------------------------------------

    def get_module(self) -> nn.Module:
        """The wrapped module (SMP v1): the user's model, its distributed modules in place."""
        return self.module

    def local_named_modules(self, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
        """(path, module) for the modules this rank's pipeline stage runs."""
        for name, m in self.module.named_modules():
            if self._owns(name):
                yield (f"{prefix}.{name}" if prefix and name else prefix or name), m

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is split over the tensor-parallel group (each rank a shard)."""
        return replicas.is_tp_shard(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is split over the tensor-parallel group (each rank a shard)."""
        return replicas.is_tp_shard(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient comes from the tensor-parallel group's whole batch (the
        "scaled batch"): it is reduced over the reduced-data-parallel group (SMP v1)."""
        return group_and_divisor(param, get_state())[0] == "rdp"

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` belongs to a module that computes on the scaled batch (SMP v1)."""
        return getattr(buf, "_smp_tp_reduce", None) == "rdp"

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters whose gradients are reduced over the
        data-parallel group (SMP v1)."""
        state = get_state()
        return (
            (n, p) for n, p in self.named_parameters() if group_and_divisor(p, state)[0] == "dp"
        )

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters whose gradients are reduced over the
        reduced-data-parallel group (SMP v1)."""
        state = get_state()
        return (
            (n, p) for n, p in self.named_parameters() if group_and_divisor(p, state)[0] == "rdp"
        )

    def join(self) -> contextlib.AbstractContextManager[None]:
        """Training with uneven inputs across data-parallel replicas (SMP v1's, after DDP's).

        Inside the block every step first tells every rank which replicas still have data (one
        small all-gather). A replica whose loop ends leaves the block and then shadows the steps
        the others still run: it takes part in their collectives with zero gradients, so the
        gradients are the sum over the replicas that had data divided by the data-parallel
        degree, as DDP's join divides by the initial world size. When every replica is done,
        the parameters and buffers are broadcast from a replica that ran the most steps, so
        every replica leaves with the same model (optimizer states are not synchronised).

        Every rank of one replica (its pipeline stages and tensor-parallel ranks) must run the
        same number of steps: a replica whose ranks disagree is an error on every rank.

        Raises:
            NotImplementedError: with ``shard_optimizer_state`` over more than one replica (a
                replica whose inputs ended would not run the optimizer steps of the parameters
                it owns, nor their broadcasts).
        """
        return dp_join.joined(self, lambda: shadow_steps(self))

    def register_comm_hook(self, state: Any, callable: Callable) -> None:  # noqa: A002 - v1's name
        """Reduces the gradients with ``callable(state, bucket)`` instead of smp's all-reduce
        (SMP v1's, after DDP's: torch's ``ddp_comm_hooks`` work as they are).

        ``bucket`` has DDP's ``GradBucket`` methods (``buffer()``, ``gradients()``,
        ``parameters()``, ``index()``, ``is_last()``, ``set_buffer()``); its buffer holds this
        rank's gradients summed over the step's microbatches, and the hook returns a
        ``torch.futures.Future`` of the reduced buffer. As in v1, the hook averages: over the
        data-parallel replicas (``state`` is usually ``smp.get_dp_process_group()``) and over
        the microbatches, unless the loss is a sum. Called once per bucket (``bucket_cap_mb``)
        at the end of each ``backward_passes_per_step`` window, on every rank, in the same
        order. Not available with tensor parallelism, whose parameters reduce over two groups.
        """
        self._grads.set_comm_hook(state, callable)

    # ---- step protocol (called by smp.step) ---------------------------------------------------

    def _partition(self, run_first_microbatch: Callable[[], Any]) -> None:
        """Traces the model on microbatch 0 (rank 0), partitions it, and gives every rank the plan.

        ``run_first_microbatch`` runs the step function on microbatch 0; tracing stops it right
        after the model's forward. Any failure is raised on every rank.
        """
        state = get_state()
        cfg = state.config
        payload: list[Any] = [None]
        if state.rank == 0:
            try:
                traces = None
                if not cfg.skip_tracing:
                    self.module.to(self.tracing_device())  # "gpu": the model must fit one
                    # Rank 0 runs the model alone: distributed modules must not communicate.
                    # Delayed parameters hold values only while their module runs.
                    with (
                        local_only(),
                        materialize.while_tracing(self.module, self._delayed_pool, self._delayed),
                    ):
                        traces = trace_modules(
                            self.module,
                            lambda: self._run_traced(run_first_microbatch),
                            self.trace_execution_times,
                        )
                plan = build_plan(
                    self.module,
                    cfg.pipeline_parallel_degree,
                    traces,
                    cfg.memory_weight,
                    cfg.auto_partition,
                    cfg.default_partition,
                    use_time=self.trace_execution_times,
                )
                payload = [("ok", plan)]
            except Exception as exc:  # noqa: BLE001 - reported to every rank, raised there
                error = exc
                payload = [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(payload, src=0, group=state.groups["world"])
        status, value = payload[0]
        if status == "error":
            if state.rank == 0:
                raise error
            raise StepFailedError(f"smp: partitioning the model failed on rank 0: {value}")
        self._partition_plan = value
        self.partitioned = True
        self._runtime = PipelineRuntime(state, self.module, value.assignment, value.module_costs())
        placement.release_remote(self.module, self._owns)
        self._place_owned(state.device)
        if self._delayed:  # this stage's parameters get their values, equal over dp
            with delayed.returning_memory():
                self._materialize_owned()
            self._broadcast_model(
                lambda group: None if materialize.replicas_agree(self.module, group) else 0
            )
        else:  # every replica of this stage starts equal (from dp rank 0)
            self._broadcast_model(lambda group: 0)
        self._refresh_masters()  # optimizers made before the partition: the values, the device
        state_dicts.load_deferred(self)
        pending, self._after_partition = self._after_partition, []
        for action in pending:  # collectives: every rank runs the same list
            action()
        if state.rank == 0:
            logger.info("%s", value.report())
        for hook in list(self._post_partition_hooks.values()):
            hook(self, None)

    def tracing_device(self) -> torch.device:
        """Where rank 0 traces the model (pp > 1): this rank's device with ``trace_device=
        "gpu"`` (v1's meaning: the whole model must fit one GPU), else the CPU."""
        return placement.tracing_device(self.trace_device)

    def _place_owned(self, device: torch.device) -> None:
        """Moves the parameters and buffers this rank owns (and their gradients) to ``device``,
        keeping each tensor object (optimizers hold them); the others are released already."""
        placement.place_owned(self.module, self._owns, lambda t: t.to(device))

    def _materialize_owned(self) -> None:
        """Gives this rank's delayed parameters the values eager construction would have given
        them, one at a time (design.md §7.4); their float32 masters, made from placeholders,
        follow."""
        if self._delayed:
            state_dicts.refresh_masters(
                materialize.owned(self.module, self._owns, self._delayed_pool)
            )

    def _run_traced(self, run_first_microbatch: Callable[[], Any]) -> None:
        self._tracing = True
        try:
            run_first_microbatch()
        except _TraceComplete:
            return
        finally:
            self._tracing = False
        raise RuntimeError(
            "smp: the step function returned without calling the model, so it cannot be traced; "
            "call model(...) in the @smp.step function"
        )

    def _begin_step(self) -> None:
        if self.broadcast_buffers:
            replicas.broadcast(list(self.module.buffers()), "dp", 0, self.bucket_bytes)
        self._grads.begin()
        self._step_backward_count = 0

    @property
    def _window_position(self) -> int:
        """Passes of the current ``backward_passes_per_step`` window done."""
        return self._grads.window_position

    def _num_grad_params(self) -> int:
        return len(self._grads.params)

    def _grad_presence(self) -> list[int]:
        return self._grads.presence()

    def _set_grad_union(self, flags: list[int]) -> None:
        self._grads.set_union(flags)

    def _reduction_flags(self) -> tuple[int, int]:
        """(buckets issued early, whether one is stale) for the step's outcome agreement."""
        return self._grads.reduction_flags()

    def _set_reduction_flags(self, issued_anywhere: bool, stale_anywhere: bool) -> None:
        self._grads.set_reduction_flags(issued_anywhere, stale_anywhere)

    def _abort_step(self) -> None:
        """Drops the gradients of a failed step (or an evaluation step) and restores those from
        before it (:meth:`smp.dp.grads.StepGrads.abort`)."""
        self._grads.abort()
        self._step_backward_count = 0

    def _finish_step(self) -> None:
        if self._step_backward_count == 0:  # evaluation step: nothing to reduce
            self._abort_step()
            return
        self._step_count += 1
        self._grads.finish()

    def _broadcast_model(self, root: Callable[[str], int | None]) -> None:
        """Parameters and buffers from the replica ``root(group)`` to the others
        (:func:`smp.dp.replicas.broadcast_model`)."""
        replicas.broadcast_model(self.module, root, self.bucket_bytes)


def _scaled(tensors, scale: float):
    if isinstance(tensors, torch.Tensor):
        return tensors * scale
    return type(tensors)(t * scale for t in tensors)


class _TraceComplete(BaseException):  # not Exception: user code must not swallow it
    """Raised from forward while tracing, to stop the step function after the model's forward."""


class _Paths(list):
    """The paths of the modules smp made distributed. Also callable, as SMP v1's
    ``model.distributed_modules()``: the modules themselves, in the same order."""

    def __init__(self, paths: list[str] = (), root: nn.Module | None = None):
        super().__init__(paths)
        self._root = root

    def __call__(self) -> Iterator[nn.Module]:
        return (self._root.get_submodule(path) for path in self) if self._root else iter(())

    def __reduce__(self):
        return (list, (list(self),))  # pickled as the paths alone
