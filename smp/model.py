"""``smp.DistributedModel``: wraps any nn.Module for smp (api.md §3).

This version runs pipeline_parallel_degree = tensor_parallel_degree = 1: every rank holds the whole
model and smp adds microbatching and data parallelism. Gradient bookkeeping per step:

  1. ``_begin_step``: gradients already present (from an earlier step the user did not zero, or
     earlier passes of a ``backward_passes_per_step`` window) are set aside, so the reduction
     below only ever touches this window's new gradients.
  2. the step function runs; ``model.backward`` accumulates into ``.grad`` per microbatch.
  3. ``smp.step`` agrees across ranks on success and on which parameters got a gradient anywhere
     (a parameter unused on one rank but used on another still gets the right mean).
  4. ``_finish_step``: at the end of a window the new gradients are all-reduced over dp as a sum,
     then divided by (dp size × microbatches) — the mean over the global batch — and the set-aside
     gradients are added back.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import hashlib
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp import _C
from smp.checkpoints.keys import PARTIAL_KEY
from smp.core import tree
from smp.core.errors import StepFailedError
from smp.dp import sharded
from smp.dp.reduction import GradReduction
from smp.memory import delayed, offload
from smp.state import get_state
from smp.step import shadow_steps

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
        # each rank gives values to those it owns once the partition is known (design.md §7d).
        # Giving delayed parameters their values frees and allocates whole weights in turn.
        self._delayed = delayed.has_delayed(module)
        with delayed.returning_memory(self._delayed):
            self._delayed_pool: dict = {}  # storages tracing freed, reused by _materialize_owned
            delayed.placeholders(module)
            self.distributed_modules = _Paths()  # paths replaced by tensor-parallel versions
            if cfg.tensor_parallel_degree > 1:
                from smp.tp.lm_head import distribute_lm_head
                from smp.tp.registry import distribute_marked_modules

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
            from smp.tp.registry import alias_layer_lists

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

            # Unique trainable parameters in a fixed order (shared parameters once): the order of
            # the gradient all-reduce, identical on every rank.
            self._grad_params = [p for p in _unique_parameters(self.module) if p.requires_grad]
            self._stash: list[torch.Tensor | None] | None = None
            self._grad_marks: list[tuple[torch.Tensor | None, int | None]] = []  # at _begin_step
            self._window_position = 0
            # Buffers (qualified names) that a step has changed in place: saved before each step so
            # that a step can run again (smp.step, design.md §4c).
            self._changing_buffers: set[str] = set()
            self._step_backward_count = 0
            self._grad_union: list[int] | None = None
            # The overlapped reduction's plan (smp/dp/reduction.py), made at its first use; what the
            # step's outcome agreement said of it: a bucket issued early on some rank, a stale one.
            self._reduction: GradReduction | None = None
            self._issued_anywhere = self._stale_anywhere = False
            self._step_count = 0
            self._join: _Join | None = None  # inside `with model.join():`
            self._comm_hook: tuple[Any, Callable] | None = None  # (state, hook)
            self._deferred_load: tuple | None = None  # a partial state dict given before partition

            self._after_partition: list[Callable[[], None]] = []  # e.g. a checkpoint to load

            # One stage: everything is already where it runs. With pp > 1 the first smp.step traces
            # the model and partitions it (see _partition).
            self.partitioned = cfg.pipeline_parallel_degree == 1
            # Sharded data parallelism: FSDP2 over the sharding mesh, once every replica holds the
            # same values (design.md §7e). Its parameters are new objects: the list is rebuilt.
            self._sharded_units: list[nn.Module] = []
            # Sharded, delayed parameters get their values one block at a time, each block
            # sharded before the next one's are made: no rank holds more than one block whole.
            per_block = self._delayed and sharded.enabled()  # (sharding implies one stage)
            if self.partitioned and not per_block:
                self._materialize_owned()
            _check_replicas_match(self.module)
            if not pipelined:  # pipelined: after the partition, on the device (_place_owned)
                self._broadcast_model(lambda group: 0)  # per block: buffers (params empty yet)
            if sharded.enabled():
                self._grad_params = []  # the unsharded parameters go as each block is sharded
                self._replayed_crc, self._unsharded = 0, []
                self._sharded_units = sharded.shard_module(
                    self.module, self._materialize_block if per_block else None
                )
                self._grad_params = [p for p in _unique_parameters(self.module) if p.requires_grad]
                if per_block:
                    self._unsharded = []
                    self._delayed_pool.clear()
                    self._check_replayed_agree()
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
            last = state.microbatch == state.config.microbatches - 1
            if last and self._window_position == self.backward_passes_per_step - 1:
                reduction = self._overlapped_reduction()
                if reduction is not None:  # buckets are reduced as this backward finishes them
                    reduction.arm(tree.flatten(tensors)[0])
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
        return {**self._local_state(*args, **kwargs), PARTIAL_KEY: True}

    def _local_state(self, *args, **kwargs) -> dict[str, Any]:
        full = self.module.state_dict(*args, **kwargs)
        return {k: v for k, v in full.items() if self._owns(k)}

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """The full model's state dict with the original keys and shapes.

        With pipeline parallelism this is a collective over the pipeline group: every rank must
        call it; each stage contributes its part.
        """
        if self._runtime is None:
            local = self.module.state_dict(*args, **kwargs)
            if self._sharded_units:  # whole tensors, in key order on every rank
                local = type(local)((k, sharded.full(v)) for k, v in local.items())
            return self._unshard_tp(local)
        state = get_state()
        local = self._unshard_tp(self._local_state())  # full shapes, this stage's keys
        local = {k: v.detach().cpu() for k, v in local.items()}
        parts: list[Any] = [None] * state.axis_size("pp")
        dist.all_gather_object(parts, local, group=state.groups["pp"])
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        order = list(self.module.state_dict().keys())
        return {k: merged[k] for k in order if k in merged}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full state dict (original keys); each rank takes the part it holds. A partial
        one (from ``local_state_dict()``, marked ``_smp_is_partial``) is this rank's own part:
        it loads on the layout that saved it; before the first step partitions the model it is
        kept and loaded right after the partition (as in v1)."""
        if state_dict.get(PARTIAL_KEY, False):
            if not self.partitioned:  # v1: it loads once this rank knows its part
                self._deferred_load = (state_dict, strict, assign)
                return None
            return self._load_partial(state_dict, strict, assign)
        state_dict = {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
        if self._runtime is None:
            mine = self._shard_tp(state_dict)
            if self._sharded_units:  # this rank's chunk of each sharded parameter
                current = self.module.state_dict()
                mine = {
                    k: sharded.like(v, current[k]) if k in current else v for k, v in mine.items()
                }
            result = self.module.load_state_dict(mine, strict=strict, assign=assign)
            self._refresh_masters()
            return result
        mine = self._shard_tp({k: v for k, v in state_dict.items() if self._owns(k)})
        expected = set(self._local_state())
        if strict:
            missing = sorted(expected - set(mine))
            unknown = sorted(k for k in state_dict if k not in self.module.state_dict())
            if missing or unknown:
                raise ValueError(
                    f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unknown[:5]}"
                )
        result = self.module.load_state_dict(mine, strict=False, assign=assign)
        self._refresh_masters()
        return result

    def _refresh_masters(self, except_for: frozenset[int] | set[int] = frozenset()) -> None:
        """Float32 master weights follow a state loaded into this model's low-precision
        parameters (an optimizer's ``load_state_dict`` afterwards brings its own back), except
        those of the parameters (ids) in ``except_for``."""
        mine = {id(p) for p in self.module.parameters()} - except_for
        for optimizer in get_state().optimizers:
            optimizer._refresh_masters(mine)

    def _load_partial(self, state_dict, strict: bool, assign: bool):
        mine = {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
        local = self._local_state()
        missing = sorted(set(local) - set(mine))
        unexpected = sorted(set(mine) - set(local))
        wrong = [
            f"{k} {tuple(v.shape)} (this rank holds {tuple(local[k].shape)})"
            for k, v in mine.items()
            if k in local and isinstance(v, torch.Tensor) and v.shape != local[k].shape
        ]
        if wrong or (strict and (missing or unexpected)):
            raise ValueError(
                "load_state_dict: a partial state dict (_smp_is_partial) loads on the rank and "
                "layout that saved it; this one does not match this rank: "
                f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, other shapes "
                f"{wrong[:5]}. Save state_dict() (full) to load on another layout."
            )
        result = self.module.load_state_dict(mine, strict=False, assign=assign)
        self._refresh_masters()
        return result

    def cpu(self) -> DistributedModel:
        """Gathers the parameters and buffers of every pipeline stage onto this rank and moves
        the model to the CPU (SMP v1). A collective over the pipeline group: every rank calls
        it. Tensor-parallel shards stay shards (the distributed modules compute on them);
        ``state_dict()`` gives them whole."""
        if self._runtime is not None:
            # A pipeline group's ranks share a TP rank: each stage's tensors (its shards as
            # they are, non-persistent buffers included) are what this rank needs.
            tensors = dict((*self.module.named_parameters(), *self.module.named_buffers()))
            own = {n: t.detach().cpu() for n, t in tensors.items() if self._owns(n)}
            state = get_state()
            parts: list[Any] = [None] * state.axis_size("pp")
            dist.all_gather_object(parts, own, group=state.groups["pp"])
            with torch.no_grad():
                for part in parts:
                    for name, value in part.items():
                        if not self._owns(name):
                            tensors[name].data = value.to(tensors[name].dtype)
        return super().cpu()

    def _split_params(self) -> dict[str, torch.Tensor]:
        # Every name of a shared (tied) parameter: the state dict has a key for each.
        named = self.module.named_parameters(remove_duplicate=False)
        return {n: p for n, p in named if _is_shard(p)}

    def _unshard_tp(self, local: dict[str, Any]) -> dict[str, Any]:
        """Full shapes for the TP shards of a state dict (a collective over the TP group)."""
        split = self._split_params()
        if not split:
            return local
        from smp.core.shards import gather_shards

        group = get_state().groups["tp"]
        out = dict(local)
        for key in local:
            param = split.get(key)
            if param is not None:
                out[key] = gather_shards(local[key], *param._smp_tp_split, group)
        return out

    def _shard_tp(self, full: dict[str, Any]) -> dict[str, Any]:
        """This rank's shards of the TP-split entries of a full state dict."""
        split = self._split_params()
        if not split:
            return full
        from smp.core.shards import shard_state

        state = get_state()
        n, r = state.axis_size("tp"), state.axis_rank("tp")
        for key, value in full.items():
            param = split.get(key)
            if param is None:
                continue
            dim = param._smp_tp_split[0]
            if value.dim() <= dim or value.size(dim) != param.size(dim) * n:
                raise ValueError(
                    f"load_state_dict: {key} has shape {tuple(value.shape)}; expected the full "
                    f"shape, {param.size(dim) * n} along dim {dim} (this rank holds "
                    f"{tuple(param.shape)} of it, tensor_parallel_degree {n})"
                )
        return shard_state(full, split, n, r)

    @property
    def partition_plan(self):
        """The :class:`smp.PartitionPlan` this model runs with (one stage while pp = 1)."""
        if not self.partitioned:
            raise RuntimeError(
                "the model is partitioned at the first smp.step call; partition_plan and "
                "partition_report() are available after it (smp.plan_partition previews the plan)"
            )
        if self._partition_plan is None:
            from smp.partition.partitioner import build_plan

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
        return _is_shard(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is split over the tensor-parallel group (each rank a shard)."""
        return _is_shard(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient comes from the tensor-parallel group's whole batch (the
        "scaled batch"): it is reduced over the reduced-data-parallel group (SMP v1)."""
        return _reduction(param, get_state())[0] == "rdp"

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` belongs to a module that computes on the scaled batch (SMP v1)."""
        return getattr(buf, "_smp_tp_reduce", None) == "rdp"

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters whose gradients are reduced over the
        data-parallel group (SMP v1)."""
        state = get_state()
        return ((n, p) for n, p in self.named_parameters() if _reduction(p, state)[0] == "dp")

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters whose gradients are reduced over the
        reduced-data-parallel group (SMP v1)."""
        state = get_state()
        return ((n, p) for n, p in self.named_parameters() if _reduction(p, state)[0] == "rdp")

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
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
        if self._join is not None:
            raise RuntimeError("DistributedModel.join() cannot be nested")
        state = get_state()
        if state.config.shard_optimizer_state and state.axis_size("rdp") > 1:
            raise NotImplementedError(
                "DistributedModel.join() does not work with shard_optimizer_state yet: a "
                "replica whose inputs ended would not take part in the optimizer steps of the "
                "parameters it owns; give every replica the same number of steps instead"
            )
        if self._sharded_units:
            raise NotImplementedError(
                "DistributedModel.join() does not work with sharded_data_parallel_degree > 1 "
                "yet: a replica whose inputs ended would not take part in the gathers and "
                "reductions of its sharding group; give every replica the same number of steps"
            )
        self._join = _Join()
        finished = False
        try:
            yield
            finished = True
        finally:
            try:
                if finished:
                    shadow_steps(self)
                    self._sync_after_join()
            finally:
                self._join = None

    def _sync_after_join(self) -> None:
        """Parameters and buffers from the lowest rank of this rank's groups that was active in
        the last step any replica ran."""
        last = self._join.last_active
        if last is None:
            return
        members = get_state().group_ranks

        def root(group: str) -> int | None:
            return next((i for i, r in enumerate(members[group]) if last[r]), None)

        self._broadcast_model(root)

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
        if not builtins.callable(callable):
            raise ValueError(f"register_comm_hook: the hook must be callable, got {callable!r}")
        if get_state().axis_size("tp") > 1:
            raise NotImplementedError(
                "register_comm_hook is not available with tensor_parallel_degree > 1: a "
                "tensor-parallel model reduces its gradients over two groups (dp and rdp)"
            )
        if self._sharded_units:
            raise NotImplementedError(
                "register_comm_hook is not available with sharded_data_parallel_degree > 1: "
                "FSDP2 reduce-scatters the gradients during the backward"
            )
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook: a hook is registered already (one per model)")
        self._comm_hook = (state, callable)

    # ---- step protocol (called by smp.step) ---------------------------------------------------

    def _partition(self, run_first_microbatch: Callable[[], Any]) -> None:
        """Traces the model on microbatch 0 (rank 0), partitions it, and gives every rank the plan.

        ``run_first_microbatch`` runs the step function on microbatch 0; tracing stops it right
        after the model's forward. Any failure is raised on every rank.
        """
        from smp.partition.partitioner import build_plan, trace_modules

        state = get_state()
        cfg = state.config
        payload: list[Any] = [None]
        if state.rank == 0:
            try:
                traces = None
                if not cfg.skip_tracing:
                    self.module.to(self.tracing_device())  # "gpu": the model must fit one
                    from smp.tp.functional import local_only

                    # Rank 0 runs the model alone: distributed modules must not communicate.
                    # Delayed parameters hold values only while their module runs.
                    with local_only(), self._delayed_tracing():
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
        from smp.pipeline.runtime import PipelineRuntime

        self._runtime = PipelineRuntime(state, self.module, value.assignment, value.module_costs())
        self._release_remote_tensors()
        self._place_owned(state.device)
        if self._delayed:  # this stage's parameters get their values, equal over dp
            with delayed.returning_memory():
                self._materialize_owned()
            self._broadcast_model(lambda group: None if self._replicas_agree(group) else 0)
        else:  # every replica of this stage starts equal (from dp rank 0)
            self._broadcast_model(lambda group: 0)
        self._refresh_masters()  # optimizers made before the partition: the values, the device
        self._apply_deferred_load(state)
        pending, self._after_partition = self._after_partition, []
        for action in pending:  # collectives: every rank runs the same list
            action()
        if state.rank == 0:
            logger.info("%s", value.report())
        for hook in list(self._post_partition_hooks.values()):
            hook(self, None)

    def _apply_deferred_load(self, state) -> None:
        """Loads a partial state dict given before the partition; every rank learns whether
        every rank could (one small all-gather), so a mismatch fails everywhere at once."""
        deferred, self._deferred_load = self._deferred_load, None
        failure: BaseException | None = None
        if deferred is not None:
            try:
                self._load_partial(*deferred)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                failure = exc
        outcomes: list[Any] = [None] * state.world_size
        dist.all_gather_object(
            outcomes, None if failure is None else str(failure), group=state.groups["world"]
        )
        if failure is not None:
            raise failure
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed:
            rank, message = failed[0]
            raise StepFailedError(
                f"smp: loading the partial state dict given before the partition failed on rank "
                f"{rank}: {message}"
            )

    def _release_remote_tensors(self) -> None:
        """Frees the storage of parameters and buffers owned by other stages: each rank keeps
        only its modules' tensors (``state_dict()`` gathers them from their owners)."""
        with torch.no_grad():
            for name, tensor in (*self.module.named_parameters(), *self.module.named_buffers()):
                if not self._owns(name):
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        for optimizer in get_state().optimizers:  # float32 master weights of released ones
            optimizer._release_masters()

    def tracing_device(self) -> torch.device:
        """Where rank 0 traces the model (pp > 1): this rank's device with ``trace_device=
        "gpu"`` (v1's meaning: the whole model must fit one GPU), else the CPU."""
        return get_state().device if self.trace_device == "gpu" else torch.device("cpu")

    def _place_owned(self, device: torch.device) -> None:
        """Moves the parameters and buffers this rank owns (and their gradients) to ``device``,
        keeping each tensor object (optimizers hold them); the others are released already."""
        place_owned(self.module, self._owns, lambda t: t.to(device))

    def _delayed_tracing(self):
        if not self._delayed:
            return contextlib.nullcontext()
        return delayed.materialized_while_called(self.module, self._delayed_pool)

    def _materialize_owned(self) -> None:
        """Gives this rank's delayed parameters the values eager construction would have given
        them, one at a time (design.md §7d)."""
        if not self._delayed:
            return
        seen: set[int] = set()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in seen or not delayed.waiting(p) or not self._owns(name):
                continue
            seen.add(id(p))
            delayed.materialize(p, self._delayed_pool)
        self._delayed_pool.clear()
        for optimizer in get_state().optimizers:  # float32 masters made from placeholders
            optimizer._refresh_masters(seen)

    def _materialize_block(self, block: nn.Module) -> None:
        """Gives ``block``'s delayed parameters their values (those not sharded yet), adding
        them to this rank's CRC-32C of replayed values. The whole values of the block sharded
        before it (each rank keeps its chunks) are replayed into again."""
        delayed.recycle(self._unsharded, self._delayed_pool)
        self._unsharded = []
        for p in block.parameters():
            if delayed.waiting(p):
                delayed.materialize(p, self._delayed_pool)
                self._replayed_crc = _crc32c(p, self._replayed_crc)
                self._unsharded.append(p.detach())

    def _check_replayed_agree(self) -> None:
        """Fails on every rank if the replayed parameters differ between the ranks that shard
        them (each keeps its chunk of its own replay, so they must have replayed alike)."""
        state = get_state()
        crcs = _gathered(self._replayed_crc, "rdp")
        if len(set(crcs)) > 1:
            raise ValueError(
                "smp.DistributedModel: with delayed_parameter_initialization and "
                "sharded_data_parallel_degree > 1 every rank must build the model from the same "
                "seed (each rank keeps its chunk of its own replay, nothing is broadcast); the "
                f"replayed values differ between ranks {state.group_ranks['rdp']} (CRC-32C "
                f"{crcs}): call torch.manual_seed(same value) on every rank before building it"
            )

    def _replicas_agree(self, group: str) -> bool:
        """Whether every rank of ``group`` ("dp": parameters, "rdp": TP shards) holds the same
        values (one CRC-32C of this rank's, all-gathered): replayed delayed parameters agree
        when every rank seeded alike, and then need no broadcast (whose buckets cost memory
        right when the stage's parameters have just been allocated)."""
        state = get_state()
        if state.axis_size(group) == 1:
            return True
        crc = 0
        for p in _unique_parameters(self.module):
            if p.numel() > 0 and _is_shard(p) == (group == "rdp"):
                crc = _crc32c(p, crc)
        return len(set(_gathered(crc, group))) == 1

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
            self._broadcast_from_dp_rank0(list(self.module.buffers()))
        if self._window_position == 0:
            self._stash = [p.grad for p in self._grad_params]
            for p in self._grad_params:
                p.grad = None
        self._grad_marks = [
            (p.grad, None if p.grad is None else p.grad._version) for p in self._grad_params
        ]
        self._step_backward_count = 0
        if self._runtime is not None and self._window_position == self.backward_passes_per_step - 1:
            reduction = self._overlapped_reduction()
            if reduction is not None:  # a stage's last backward is the whole step's (reduction.py)
                reduction.arm_counted()

    def _grads_changed(self) -> bool:
        """Whether a gradient was set or added to since ``_begin_step``."""
        return any(
            p.grad is not grad or (grad is not None and grad._version != version)
            for p, (grad, version) in zip(self._grad_params, self._grad_marks)
        )

    def _num_grad_params(self) -> int:
        return len(self._grad_params)

    def _grad_presence(self) -> list[int]:
        return [0 if p.grad is None else 1 for p in self._grad_params]

    def _set_grad_union(self, flags: list[int]) -> None:
        self._grad_union = flags

    def _reduction_flags(self) -> tuple[int, int]:
        """(buckets issued early, whether one is stale) for the step's outcome agreement."""
        if self._reduction is None:
            return 0, 0
        return self._reduction.issued(), int(self._reduction.stale())

    def _set_reduction_flags(self, issued_anywhere: bool, stale_anywhere: bool) -> None:
        self._issued_anywhere, self._stale_anywhere = issued_anywhere, stale_anywhere

    def _overlapped_reduction(self) -> GradReduction | None:
        """The reduction overlapped with the backward (smp/dp/reduction.py), made at its first use,
        or None where the gradients are reduced after the step: ``overlapping_allreduce=False``
        or a communication hook."""
        overlap = self.overlapping_allreduce and get_state().config.overlapping_allreduce
        if not overlap or self._comm_hook is not None:
            return None
        if self._reduction is None:
            state = get_state()
            num_mb = state.config.microbatches if self.average_grads_across_microbatches else 1

            def key(p: torch.Tensor) -> tuple[str, float]:
                group, divisor = _reduction(p, state)
                return group, float(divisor * num_mb)

            params = [p for p in self._grad_params if not sharded.is_sharded(p)]
            if self._runtime is not None:  # a stage reduces its own parameters over its dp group
                local = {id(p) for p in self.local_parameters()}
                params = [p for p in params if id(p) in local]
            self._reduction = GradReduction(params, key, state.groups, self.bucket_bytes)
        return self._reduction

    def _abort_step(self) -> None:
        """Drops the gradients of a failed step (or an evaluation step) and restores those from
        before it. Inside a ``backward_passes_per_step`` window a failed step's gradients were
        added to the window's earlier ones and cannot be told apart: the whole window is
        dropped (gradients as before the window, with a warning) rather than kept partly."""
        if self._window_position > 0 and self._grads_changed():
            logger.warning(
                "smp: a step failed at pass %d of a backward_passes_per_step=%d window; the "
                "window's gradients were dropped and the next step starts a new window",
                self._window_position + 1,
                self.backward_passes_per_step,
            )
            self._window_position = 0
        if self._reduction is not None:  # peers that issued buckets get theirs matched
            issued_anywhere, self._issued_anywhere = self._issued_anywhere, False
            self._reduction.abort(issued_anywhere)
        if self._window_position == 0 and self._stash is not None:
            for p, old in zip(self._grad_params, self._stash):
                p.grad = old
            self._stash = None
        self._step_backward_count = 0

    def _finish_step(self) -> None:
        state = get_state()
        if self._step_backward_count == 0:  # evaluation step: nothing to reduce
            self._abort_step()
            return
        self._step_count += 1
        self._window_position += 1
        if self._window_position < self.backward_passes_per_step:
            return
        self._window_position = 0

        num_mb = state.config.microbatches if self.average_grads_across_microbatches else 1
        union = self._grad_union or self._grad_presence()
        # (group, divisor) -> gradients; see _reduction for the rule.
        batches: dict[tuple[str, int], list[torch.Tensor]] = {}
        done_by_fsdp: list[torch.Tensor] = []
        overlapped = self._overlapped_reduction()
        for p, used in zip(self._grad_params, union):
            if sharded.is_sharded(p):  # FSDP2 reduced it in the backward
                done_by_fsdp.append(p)
                continue
            if not used or overlapped is not None:
                continue
            if p.grad is None:  # used on another rank only: contributes zeros here
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not p.grad.is_contiguous():  # e.g. the gradient of a transposed parameter
                p.grad = p.grad.contiguous()
            batches.setdefault(_reduction(p, state), []).append(p.grad)
        if done_by_fsdp:
            sharded.finish_grads(
                done_by_fsdp, lambda p: _reduction(p, state), num_mb, self.bucket_bytes
            )
        if overlapped is not None:
            stale, self._stale_anywhere, self._issued_anywhere = self._stale_anywhere, False, False
            if stale:
                logger.warning(
                    "smp: a gradient changed after its bucket's all-reduce had started (a second "
                    "backward in the last microbatch, .grad edited in the step function, or on a "
                    "pipeline stage more accumulations than the last window's); the gradients "
                    "were reduced again after the step"
                )
            overlapped.finish({id(p): bool(u) for p, u in zip(self._grad_params, union)}, stale)
        elif self._comm_hook is not None:
            self._reduce_with_hook([g for grads in batches.values() for g in grads])
        else:
            for (group, divisor), grads in batches.items():
                _C.allreduce_mean_(
                    grads, state.groups[group], float(divisor * num_mb), self.bucket_bytes
                )

        for p, old in zip(self._grad_params, self._stash or []):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        self._stash = None

    def _reduce_with_hook(self, grads: list[torch.Tensor]) -> None:
        """The user's communication hook over buckets of ``grads`` (in order, ``bucket_bytes``
        each at most, one dtype per bucket); each result is copied back into the gradients."""
        state, hook = self._comm_hook
        params = {id(p.grad): p for p in self._grad_params if p.grad is not None}
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or size + nbytes > self.bucket_bytes or buckets[-1][0].dtype != g.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        for index, members in enumerate(buckets):
            bucket = _GradBucket(index, index == len(buckets) - 1, members, params)
            result = hook(state, bucket)
            if not isinstance(result, torch._C.Future):  # torch.futures.Future and .then()s
                raise TypeError(
                    "register_comm_hook: the hook must return a torch.futures.Future of the "
                    f"reduced buffer, got {type(result).__name__}"
                )
            reduced = result.wait()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            if reduced.numel() != bucket.buffer().numel():
                raise ValueError(
                    f"register_comm_hook: the hook returned {reduced.numel()} values for a "
                    f"bucket of {bucket.buffer().numel()}"
                )
            offset = 0
            with torch.no_grad():
                for g in members:
                    g.copy_(reduced.view(-1)[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    # ---- helpers ------------------------------------------------------------------------------

    def _broadcast_model(self, root: Callable[[str], int | None]) -> None:
        """Parameters and buffers from one replica to the others: TP shards differ across the
        TP group, so each is broadcast over its rdp group; everything else (replicated
        parameters included) is the same on every rank of the dp group. ``root(group)`` is the
        index in the group to broadcast from (None: nothing). Tensors another stage holds
        (released, empty) are left out."""
        params = _unique_parameters(self.module)
        for group, tensors in (
            ("dp", [p for p in params if not _is_shard(p)] + list(self.module.buffers())),
            ("rdp", [p for p in params if _is_shard(p)]),
        ):
            index = root(group)
            if index is not None:
                self._broadcast([t for t in tensors if t.numel() > 0], group, index)

    def _broadcast_from_dp_rank0(self, tensors: list[torch.Tensor]) -> None:
        self._broadcast(tensors, "dp")

    def _broadcast(self, tensors: list[torch.Tensor], group: str, root: int = 0) -> None:
        """Broadcasts ``tensors`` from rank ``root`` (an index in the group) of this rank's group
        ``group``."""
        state = get_state()
        if state.axis_size(group) == 1 or not tensors:
            return
        with torch.no_grad():
            # The root is a rank of the group, as in c10d's BroadcastOptions.
            dist._broadcast_coalesced(state.groups[group], tensors, self.bucket_bytes, root)


def place_owned(
    module: nn.Module, owns: Callable[[str], bool], move: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replaces the values of the parameters and buffers of ``module`` whose names ``owns``
    accepts by ``move(value)`` in place (``.data``: the tensor objects stay), gradients with
    them; shared tensors once, under their first name."""
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if not owns(name):
                continue
            tensor.data = move(tensor.data)
            if tensor.grad is not None:
                tensor.grad = move(tensor.grad)


def _scaled(tensors, scale: float):
    if isinstance(tensors, torch.Tensor):
        return tensors * scale
    return type(tensors)(t * scale for t in tensors)


def _crc32c(t: torch.Tensor, crc: int) -> int:
    """``crc`` extended by the bytes of ``t``'s values."""
    data = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return _C.crc32c(memoryview(data), crc)


def _gathered(value: Any, group: str) -> list[Any]:
    """``value`` of every rank of this rank's group ``group``, in group order."""
    state = get_state()
    values: list[Any] = [None] * state.axis_size(group)
    dist.all_gather_object(values, value, group=state.groups[group])
    return values


def _is_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` is this rank's shard of a tensor split over the TP group."""
    return getattr(p, "_smp_tp_split", None) is not None


def _reduction(p: torch.Tensor, state) -> tuple[str, int]:
    """(group, divisor before microbatches) of the gradient reduction of parameter ``p``.

    The target is the mean over the global batch. A parameter outside any distributed module
    sees this rank's samples: summed over dp, divided by dp. A parameter of a distributed module
    whose gradient every TP rank computes from the whole region batch (``_smp_tp_reduce ==
    "rdp"``: shards, replicated tensors inside the region) is summed over rdp only; one computed
    from this rank's part of the batch ("dp") over dp. Both divide by the number of distinct
    per-rank batches: dp, or rdp with ``prescaled_batch`` (the TP ranks share one batch).
    """
    reduce = getattr(p, "_smp_tp_reduce", None)
    if reduce is None:
        return "dp", state.axis_size("dp")
    divisor = state.axis_size("rdp" if state.config.prescaled_batch else "dp")
    return reduce, divisor


class _GradBucket:
    """The bucket a communication hook gets: DDP's ``GradBucket`` methods over a flat copy of
    some gradients."""

    def __init__(self, index: int, last: bool, grads: list[torch.Tensor], params: dict):
        self._index, self._last = index, last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._params = [params[id(g)] for g in grads]
        self._shapes = [g.shape for g in grads]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        sizes = [s.numel() for s in self._shapes]
        return [t.view(s) for t, s in zip(self._buffer.split(sizes), self._shapes)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)


class _Join:
    """The state of ``DistributedModel.join()`` on this rank."""

    def __init__(self):
        self.last_active: list[int] | None = None  # per world rank, in the last step any ran


class _TraceComplete(BaseException):  # not Exception: user code must not swallow it
    """Raised from forward while tracing, to stop the step function after the model's forward."""


def _unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters in registration order, each once even if shared (tied weights)."""
    return list(module.parameters())


def _check_replicas_match(module: nn.Module) -> None:
    """Fails on every rank if dp replicas differ in parameter/buffer names, shapes or dtypes."""
    state = get_state()
    if state.axis_size("dp") == 1:
        return
    layout = [
        (name, tuple(t.shape), str(t.dtype))
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    if len(set(_gathered(digest, "dp"))) == 1:
        return
    layouts = _gathered(layout, "dp")
    ranks = state.group_ranks["dp"]
    base = layouts[0]
    for other_rank, other in zip(ranks[1:], layouts[1:]):
        if other != base:
            diff = next(
                ((a, b) for a, b in zip(base, other) if a != b),
                (f"{len(base)} tensors", f"{len(other)} tensors"),
            )
            raise ValueError(
                "smp.DistributedModel: the model differs between data-parallel replicas: rank "
                f"{ranks[0]} has {diff[0]} where rank {other_rank} has {diff[1]}; build the same "
                "model on every rank"
            )


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
