"""``@smp.step``: run a train or evaluation step once per microbatch; ``StepOutput`` (api.md §5).

The decorated function receives one microbatch of every tensor argument, calls the model and
(for training) ``model.backward(loss)``. After the last microbatch every rank agrees on how the
step went before any gradient is communicated: a failure on one rank is raised on every rank, and
ranks that disagree on whether this was a training step fail instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.batchnorm import _NormBase

from smp import _C
from smp.comm import collective
from smp.core import tree
from smp.core.errors import StepFailedError
from smp.core.rng import random_streams, set_random_streams
from smp.memory import offload
from smp.pipeline.runtime import CallStructureChanged
from smp.state import State, get_state

__all__ = ["step", "StepOutput", "StepFailedError", "microbatch"]

logger = logging.getLogger("smp")


class StepOutput:
    """One value per microbatch of something the step function returned.

    Attributes:
        outputs: the per-microbatch values, in microbatch order.
    """

    def __init__(self, outputs: list[Any]):
        self.outputs = outputs

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self):
        return iter(self.outputs)

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]

    def __repr__(self) -> str:
        return f"StepOutput({self.outputs!r})"

    def _tensors(self) -> list[torch.Tensor]:
        return [o if isinstance(o, torch.Tensor) else torch.as_tensor(o) for o in self.outputs]

    def reduce_mean(self) -> torch.Tensor:
        """Mean over microbatches (elementwise for non-scalar outputs)."""
        return torch.stack(self._tensors()).mean(dim=0)

    def reduce_sum(self) -> torch.Tensor:
        """Sum over microbatches (elementwise for non-scalar outputs)."""
        return torch.stack(self._tensors()).sum(dim=0)

    def concat(self) -> torch.Tensor:
        """The microbatch outputs concatenated along dim 0 (e.g. per-sample predictions)."""
        return torch.cat(self._tensors(), dim=0)

    def stack(self) -> torch.Tensor:
        """The microbatch outputs stacked along a new dim 0."""
        return torch.stack(self._tensors())


def microbatch() -> int | None:
    """Index of the microbatch the running step function is processing; None outside a step."""
    return get_state().microbatch


def num_microbatches() -> int:
    """The number of microbatches each step splits its batch into (the ``microbatches`` key)."""
    return get_state().config.microbatches


# ---- splitting inputs into microbatches --------------------------------------------------------


def _slices_itself(value: Any) -> bool:
    return hasattr(value, "smp_slice") and callable(value.smp_slice)


def _split(value: Any, path: str, axis: int, num_mb: int) -> list[Any] | None:
    """Splits ``value`` into ``num_mb`` pieces, or returns None if it is passed whole.

    Every tensor in it (found by smp.core.tree: containers, named tuples, mappings of any type,
    Hugging Face outputs) is split along ``axis``; an object with ``smp_slice(num_mb, mb, axis)``
    slices itself; 0-d tensors and anything else go whole to every microbatch.
    """
    leaves, spec = tree.flatten(value, is_leaf=_slices_itself)
    parts: list[list[Any] | None] = []
    for i, leaf in enumerate(leaves):
        if _slices_itself(leaf):
            parts.append([leaf.smp_slice(num_mb, mb, axis) for mb in range(num_mb)])
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            parts.append(_split_tensor(leaf, lambda i=i: _leaf_path(value, path, i), axis, num_mb))
        else:
            parts.append(None)
    if all(p is None for p in parts):
        return None
    return [
        tree.unflatten([v if p is None else p[mb] for v, p in zip(leaves, parts)], spec)
        for mb in range(num_mb)
    ]


def _leaf_path(value: Any, path: str, index: int) -> str:
    return path + tree.leaf_paths(value, is_leaf=_slices_itself)[index]


def _split_tensor(
    value: torch.Tensor, path: Callable[[], str], axis: int, num_mb: int
) -> list[torch.Tensor]:
    if not -value.dim() <= axis < value.dim():
        raise ValueError(
            f"smp.step: cannot split argument {path()} of shape {tuple(value.shape)} along "
            f"axis {axis}; set input_split_axes for it or list it in non_split_inputs"
        )
    length = value.shape[axis]
    if length % num_mb != 0:
        raise ValueError(
            f"smp.step: argument {path()} has size {length} along axis {axis}, which is not "
            f"divisible by microbatches={num_mb}; use a batch size that is a multiple of "
            f'{num_mb}, change "microbatches", or list the argument in non_split_inputs'
        )
    chunk = length // num_mb
    return [value.narrow(axis, mb * chunk, chunk) for mb in range(num_mb)]


def _check_names(what: str, names: Iterable[str], signature: inspect.Signature, fn_name: str):
    params = signature.parameters
    has_var = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    for name in names:
        if name not in params and not has_var:
            raise ValueError(
                f"smp.step: {what} names {name!r}, but {fn_name}() has no such argument; "
                f"its arguments are {list(params)}"
            )


# ---- the decorator -----------------------------------------------------------------------------


@dataclasses.dataclass
class _MicrobatchError:
    rank: int
    microbatch: int | None
    summary: str
    formatted: str
    rerun: bool = False  # a call's output structure changed (asynchronous calls): may run again
    origin: str = "user"  # where it came from (_origin): "user" is a cause, the rest echoes


_MAX_RUNS = 4  # a step runs at most this often (design.md §4.3: each rerun makes a call wait)


# Note [Rewind without walking the model]
# A pipelined step snapshots the model's buffers and parameter versions before it runs
# (_Rewind). Walking named_modules() and named_parameters() for that cost 0.2-0.5 ms per step.
# The list of (module, buffer name) and (name, parameter) pairs changes only when a module,
# buffer or parameter is registered, which torch's global registration hooks report: the
# lists are kept per model and built again after any registration anywhere in the process.
# A buffer replaced under an existing name (``module.buf = t``, which runs no hook) is still
# seen: each snapshot reads ``module._buffers[name]`` afresh.
_registrations = 0  # registrations of modules, buffers and parameters so far (any module)


def _registered(*_args) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (count, bufs, params)


def _walk(module: torch.nn.Module) -> tuple[list[tuple], list[tuple]]:
    """(module, buffer name, qualified name, is a norm) for every buffer slot of ``module``'s
    tree, and (name, parameter) for its parameters; rebuilt only after a registration."""
    cached = _walks.get(module)
    if cached is not None and cached[0] == _registrations:
        return cached[1], cached[2]
    count = _registrations
    buffers = [
        (sub, name, f"{path}.{name}" if path else name, isinstance(sub, _NormBase))
        for path, sub in module.named_modules()
        for name in sub._buffers
    ]
    params = list(module.named_parameters())
    _walks[module] = (count, buffers, params)
    return buffers, params


class _Rewind:
    """What a pipelined step may change besides gradients, taken before it runs, so that a step
    that failed only because a call's output structure changed (asynchronous calls, design.md
    §4.3) can run again exactly: the random generators (torch's CPU and CUDA ones, smp's TP
    ones), and the buffers. Buffers are compared by identity and version; those that earlier
    steps changed in place, and the running statistics of batch and instance norms (their
    kernels update them without bumping the version), are copied; the rest (masks, tables) only
    checked. Parameters are only checked."""

    def __init__(self, state: State, models: list):
        self.models = models
        self.streams = random_streams()
        # (model, owning module, name, qualified name, tensor, version, copy or None)
        self.buffers: list[tuple] = []
        self.params: list[tuple[str, torch.Tensor, int]] = []
        for model in models:  # Note [Rewind without walking the model]
            buffers, params = _walk(model.module)
            for module, name, qualified, norm in buffers:
                buf = module._buffers.get(name)
                if buf is None:
                    continue
                save = norm or qualified in model._changing_buffers
                saved = buf.clone() if save else None
                self.buffers.append((model, module, name, qualified, buf, buf._version, saved))
            self.params += [(n, q, q._version) for n, q in params]

    def _changed(self, entry: tuple) -> bool:
        _, module, name, _, buf, version, _ = entry
        return module._buffers.get(name) is not buf or buf._version != version

    def note_changes(self) -> None:
        """Remembers the buffers this run changed: the next steps save them."""
        for entry in self.buffers:
            if self._changed(entry):
                entry[0]._changing_buffers.add(entry[3])

    def blocker(self) -> str | None:
        """Why the state before the step cannot be restored, or None."""
        for model in self.models:
            if model._window_position != 0:  # this step's gradients were added to earlier ones
                return (
                    "the step's gradients were added to those of earlier steps (a window of "
                    f"backward_passes_per_step={model.backward_passes_per_step})"
                )
        for name, param, version in self.params:
            if param._version != version:
                return f"parameter '{name}' was changed in place during the step"
        for entry in self.buffers:
            if self._changed(entry) and entry[6] is None:
                return (
                    f"buffer '{entry[3]}' changed during the step for the first time, so it "
                    "had not been saved before it"
                )
        return None

    def restore(self) -> None:
        set_random_streams(self.streams)
        for _, module, name, _, buf, _, saved in self.buffers:
            if saved is not None:  # always: a norm's statistics change without a version bump
                with torch.no_grad():
                    buf.copy_(saved)
            module._buffers[name] = buf


class _StepFunction:
    def __init__(
        self,
        func: Callable,
        non_split_inputs: Iterable[str] | None,
        input_split_axes: Mapping[str, int] | None,
        detach_outputs: bool,
    ):
        self.func = func
        self.signature = inspect.signature(func)
        self.non_split_inputs = frozenset(non_split_inputs or ())
        self.input_split_axes = dict(input_split_axes or {})
        self.detach_outputs = detach_outputs
        name = getattr(func, "__qualname__", repr(func))
        _check_names("non_split_inputs", self.non_split_inputs, self.signature, name)
        _check_names("input_split_axes", self.input_split_axes, self.signature, name)
        for key, axis in self.input_split_axes.items():
            if not isinstance(axis, int) or isinstance(axis, bool):
                raise ValueError(
                    f"smp.step: input_split_axes[{key!r}] must be an int dim, got {axis!r}"
                )
        functools.update_wrapper(self, func)

    def _split_arguments(self, args, kwargs, num_mb: int) -> list[tuple[tuple, dict]]:
        bound = self.signature.bind(*args, **kwargs)
        per_name: dict[str, list[Any] | None] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if name in self.non_split_inputs or _is_model(value):
                per_name[name] = None
            elif kind is inspect.Parameter.VAR_KEYWORD:
                per_name[name] = _split(
                    value, f"'**{name}'", self.input_split_axes.get(name, 0), num_mb
                )
            else:
                axis = self.input_split_axes.get(name, 0)
                per_name[name] = _split(value, f"'{name}'", axis, num_mb)
        calls = []
        for mb in range(num_mb):
            arguments = {
                name: value if per_name[name] is None else per_name[name][mb]
                for name, value in bound.arguments.items()
            }
            call = inspect.BoundArguments(self.signature, arguments)
            calls.append((call.args, call.kwargs))
        return calls

    def _run_microbatch(self, state: State, mb: int, args: tuple, kwargs: dict) -> Any:
        state.in_step, state.microbatch = True, mb
        try:
            return self.func(*args, **kwargs)
        finally:
            state.in_step, state.microbatch = False, None

    def __call__(self, *args, **kwargs):
        state = get_state()
        if state.in_step:
            raise RuntimeError("smp.step functions cannot be nested: one step runs at a time")
        if state.config.offload_activations:
            offload.current().new_step()
        num_mb = state.config.microbatches
        if state.device.type != "cpu":  # the step's tensors go where the (first) stage computes
            args, kwargs = tree.map_tensors(lambda t: t.to(state.device), (args, kwargs))
        calls = self._split_arguments(args, kwargs, num_mb)  # bad input fails before any work
        models = [a for a in (*args, *kwargs.values()) if _is_model(a)]
        models = list({id(m): m for m in models}.values())

        joining = [m for m in models if m._join is not None]
        active = _join_round(state, joining, True) if joining else None
        for model in models:
            if not model.partitioned:
                first = calls[0]
                device = model.tracing_device()
                if device != state.device:  # trace_device="cpu" on a GPU rank
                    first = tree.map_tensors(lambda t, d=device: t.to(d), first)
                with _precision(state):  # tracing runs the forward as the steps will
                    model._partition(lambda a=first: self._run_microbatch(state, 0, *a))
        runtimes = [m._runtime for m in models if m._runtime is not None]
        if len(runtimes) > 1:
            raise NotImplementedError("smp.step: one pipelined DistributedModel per step function")

        for attempt in range(_MAX_RUNS):
            for model in models:
                model._begin_step()
            rewind = _Rewind(state, models) if runtimes else None
            results, error, original = self._attempt(state, models, runtimes, calls)
            if rewind is not None:
                rewind.note_changes()
            backward_counts = [m._step_backward_count for m in models]
            try:
                again = _agree_on_outcome(
                    state, error, original, backward_counts, models, rewind, attempt, active
                )
            except BaseException:
                for model in models:
                    model._abort_step()  # gradients as they were before the step
                if runtimes:  # the step failed on some rank: every rank moves to a fresh tag
                    runtimes[0].fresh_transports()
                raise
            if not again:
                break
            runtimes[0].fresh_transports()  # a rerun follows a failed attempt
            for model in models:
                model._abort_step()
            rewind.restore()
            runtimes[0].reruns += 1
        for model in models:
            model._finish_step()
        if runtimes:
            results = _from_pipeline_leader(state, results, self.detach_outputs)
        return _to_step_output(results, self.detach_outputs)

    def _attempt(self, state: State, models: list, runtimes: list, calls: list) -> tuple:
        """Runs the step function once per microbatch: (results, error, original exception)."""
        results: list[Any] = []
        error: _MicrobatchError | None = None
        original: BaseException | None = None
        state.in_step, state.step_models = True, models
        try:
            with _precision(state):  # pipeline workers and served calls inherit it (§4.7)
                if runtimes:
                    results, backward_calls = runtimes[0].run_step(
                        self.func, calls, self.detach_outputs
                    )
                    for model in models:
                        model._step_backward_count = backward_calls
                else:
                    for mb, (mb_args, mb_kwargs) in enumerate(calls):
                        state.microbatch = mb
                        results.append(self.func(*mb_args, **mb_kwargs))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below, then re-raised
            original = exc
            error = _MicrobatchError(
                state.rank,
                state.microbatch,
                f"{type(exc).__name__}: {exc}",
                "".join(traceback.format_exception(exc)),
                rerun=isinstance(exc, CallStructureChanged),
                origin=_origin(exc),
            )
        finally:
            state.in_step, state.step_models = False, []
            state.microbatch = None
        return results, error, original


def step(
    func: Callable | None = None,
    *,
    non_split_inputs: Iterable[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
):
    """Decorates a step function that smp runs once per microbatch.

    Usable bare (``@smp.step``) or with options (``@smp.step(non_split_inputs=["mask"])``).

    Args:
        func: the step function; it takes the model and the batch and returns tensors.
        non_split_inputs: argument names passed whole to every microbatch.
        input_split_axes: {argument name: dim} for arguments split along a dim other than 0.
        detach_outputs: detach returned tensors from the graph (default True).

    Returns:
        A callable that takes the whole batch and returns a ``StepOutput`` for every tensor the
        function returns (the same nesting: a tuple of tensors gives a tuple of StepOutputs).

    Raises:
        ValueError: a split argument whose size is not divisible by ``microbatches`` (names the
            argument, its size and the count), or options naming arguments the function lacks.
        StepFailedError: the step failed on another rank (this rank re-raises its own error).
    """

    def wrap(f: Callable) -> _StepFunction:
        return _StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)

    return wrap if func is None else wrap(func)


def _origin(exc: BaseException) -> str:
    """Where a step's failure came from, by the type of the error or of an error it was raised
    from (``raise ... from``), never by its text: "stage" (another pipeline stage or TP rank
    failed and said so), "transport" (a pipeline message could not be sent or did not come),
    "collective" (a collective smp issued failed: smp/pytorch/collective.h, smp.comm.collective)
    or "user" (anything else: the model's or the step function's own code). Only "user" errors
    are causes; the others echo a failure elsewhere."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, _C.RemoteStageError):
            return "stage"
        if isinstance(error, _C.TransportError):
            return "transport"
        if isinstance(error, (_C.CollectiveError, dist.DistError)):
            return "collective"
        error = error.__cause__
    return "user"


def _agree_on_outcome(
    state: State,
    error: _MicrobatchError | None,
    original: BaseException | None,
    backward_counts: list[int],
    models: list,
    rewind: _Rewind | None = None,
    attempt: int = 0,
    active: list[int] | None = None,
    shadow: bool = False,
) -> bool:
    """One small collective over the world: did every rank succeed, with the same backward calls,
    and which parameters got gradients anywhere. A rank's failure is raised on every rank, unless
    every cause was a call whose output structure changed and every rank can restore what the
    step changed: then True, the step runs again (the same answer on every rank).

    Under ``DistributedModel.join()``, ``active`` flags the ranks that ran the step (the others
    shadow it, ``shadow`` here): only theirs must agree on the backward calls, and each model
    learns the agreed count (``_agreed_backward_count``)."""
    world = state.groups["outcome"]
    grad_flags = [flag for m in models for flag in m._grad_presence()]
    # Per model: buckets its overlapped reduction issued, and whether one is stale (reduction.py).
    reduction_flags = [flag for m in models for flag in m._reduction_flags()]
    header = [1 if error else 0, len(backward_counts), *backward_counts, *reduction_flags]
    local = torch.tensor(header + grad_flags, dtype=torch.int64)
    if state.backend == "nccl":
        local = local.to(state.device)
    gathered = [torch.empty_like(local) for _ in range(state.world_size)]
    dist.all_gather(gathered, local, group=world)
    table = torch.stack(gathered).cpu()
    # Known on every rank before any failure is raised: a failed step's ranks still complete the
    # bucket sequence a peer began (DistributedModel._abort_step).
    flags_at = 2 + len(backward_counts)
    anywhere = table[:, flags_at : flags_at + len(reduction_flags)].amax(dim=0).tolist()
    for i, model in enumerate(models):
        model._set_reduction_flags(anywhere[2 * i] > 0, anywhere[2 * i + 1] > 0)

    failed_ranks = [r for r in range(state.world_size) if table[r, 0] != 0]
    if failed_ranks:
        blocker = None if shadow else "the step is not pipelined"
        blocker = blocker if rewind is None else rewind.blocker()
        gathered: list[Any] = [None] * state.world_size
        dist.all_gather_object(gathered, (error, blocker), group=world)
        errors = [e for e, _ in gathered]
        # The cause, not its echoes: ranks that only saw a peer fail (a collective timed out or
        # lost its peer) are named after a rank whose own code failed.
        causes = [r for r in failed_ranks if errors[r].origin == "user"]
        first = errors[(causes or failed_ranks)[0]]
        where = f"rank {first.rank}" + (
            f", microbatch {first.microbatch}" if first.microbatch is not None else ""
        )
        if causes and all(errors[r].rerun for r in causes):
            blockers = [f"rank {r}: {b}" for r, (_, b) in enumerate(gathered) if b is not None]
            if attempt + 1 >= _MAX_RUNS:
                blockers.append(f"the step has run {_MAX_RUNS} times")
            if not blockers:
                if state.rank in causes:
                    logger.warning("%s; smp runs the step again", error.summary)
                return True
            if state.rank in causes:
                raise CallStructureChanged(
                    f"{original} The step failed and could not run again ({blockers[0]}); "
                    "the gradients are as they were before it."
                ) from original
        if original is not None and (not causes or state.rank in causes):
            raise original
        here = f"; on this rank: {error.summary}" if error is not None else ""
        raise StepFailedError(
            f"smp.step failed on {where} (failed ranks: {failed_ranks}): {first.summary}{here}\n"
            f"--- traceback on rank {first.rank} ---\n{first.formatted}"
        )

    counts = table[:, 2 : 2 + len(backward_counts)]
    if active is not None:
        counts = counts[[r for r in range(state.world_size) if active[r]]]
    if len(backward_counts) and len(counts) and not bool((counts == counts[0]).all()):
        raise RuntimeError(
            "smp.step: ranks disagree on model.backward calls in this step (per rank: "
            f"{counts.tolist()}); every rank must run the same step function on its batch"
        )
    offset = flags_at + len(reduction_flags)
    # A parameter is reduced over the ranks holding its stage: the union is over the dp group.
    any_grad = table[state.group_ranks["dp"], offset:].amax(dim=0).tolist()
    start = 0
    for i, model in enumerate(models):
        n = model._num_grad_params()
        model._set_grad_union(any_grad[start : start + n])
        model._agreed_backward_count = int(counts[0, i]) if len(counts) else 0
        start += n
    return False


def _precision(state: State):
    """The step's mixed precision: with ``bf16`` (``fp16``) the step function runs under
    ``torch.autocast`` to bfloat16 (float16) on this rank's device; the parameters (the fp32
    master weights), their gradients and the gradient reduction stay in float32 (design.md
    §8)."""
    if state.config.bf16 or state.config.fp16:
        dtype = torch.bfloat16 if state.config.bf16 else torch.float16
        return torch.autocast(device_type=state.device.type, dtype=dtype)
    return contextlib.nullcontext()


def _join_round(state: State, models: list, is_active: bool) -> list[int]:
    """Under ``DistributedModel.join()``: which ranks run this step (1) and which shadow it (0),
    told to every rank by one all-gather. Every rank of a model replica (an mp group) must say
    the same, or every rank raises. Records the flags as the last active ones if any is."""
    mp_id = min(state.group_ranks["mp"])
    local = torch.tensor([1 if is_active else 0, mp_id], dtype=torch.int64)
    if state.backend == "nccl":
        local = local.to(state.device)
    gathered = [torch.empty_like(local) for _ in range(state.world_size)]
    with collective("the join round of DistributedModel.join()"):
        dist.all_gather(gathered, local, group=state.groups["outcome"])
    table = torch.stack(gathered).cpu()
    active, owner = table[:, 0].tolist(), table[:, 1].tolist()
    split = sorted({m for m in owner if len({a for a, o in zip(active, owner) if o == m}) > 1})
    if split:
        members = [r for r, o in enumerate(owner) if o == split[0]]
        raise RuntimeError(
            "DistributedModel.join(): the ranks of one model replica ran out of inputs at "
            f"different steps (ranks {members}, still running: "
            f"{[r for r in members if active[r]]}); every pipeline stage and tensor-parallel "
            "rank of a replica must run the same number of steps"
        )
    if any(active):
        for model in models:
            model._join.last_active = active
    return active


def shadow_steps(model) -> None:
    """The rest of ``DistributedModel.join()`` on a replica whose inputs ended: each step the
    others still run is shadowed (its collectives with zero gradients) until none runs."""
    state = get_state()
    while True:
        active = _join_round(state, [model], False)
        if not any(active):
            return
        for attempt in range(_MAX_RUNS):
            model._begin_step()
            try:
                again = _agree_on_outcome(
                    state, None, None, [0], [model], None, attempt, active, shadow=True
                )
            except BaseException:
                model._abort_step()
                raise
            if not again:
                break
            model._abort_step()
        model._step_backward_count = model._agreed_backward_count
        model._finish_step()


def _is_model(value: Any) -> bool:
    """Whether ``value`` is a DistributedModel (smp.model composes this module, so the class is
    known by its marker here)."""
    return getattr(type(value), "_smp_distributed_model", False)


def _from_pipeline_leader(state: State, results: list[Any], detach: bool) -> list[Any]:
    """The leader's per-microbatch results, on every rank of its pipeline group: as the
    leader's step function made them there; on the other ranks, its device tensors land on
    their own device (pickled as they are, they would land on the leader's device index)."""
    if detach:
        results = [_detached(r) for r in results]
    leader = state.axis_rank("pp") == 0
    box = [tree.map_tensors(_to_host, results) if leader else None]
    dist.broadcast_object_list(box, src=state.group_ranks["pp"][0], group=state.host_group("pp"))
    if leader:
        return results
    return tree.map_tensors(lambda t: _from_host(t, state.device), box[0])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = t.detach().cpu().requires_grad_(t.requires_grad)
    host._smp_on_device = True  # pickled with the tensor's Python state
    return host


def _from_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device) if getattr(t, "_smp_on_device", False) else t


def _detached(value: Any) -> Any:
    return tree.map_tensors(torch.Tensor.detach, value)


def _to_step_output(results: list[Any], detach: bool) -> Any:
    """Per-microbatch results [r0, r1, ...] -> the same structure with StepOutput leaves (one
    per leaf of smp.core.tree, holding that leaf of every microbatch)."""
    if not results:
        return StepOutput([])
    flat = [tree.flatten(r) for r in results]
    leaves, spec = flat[0]
    for mb, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ValueError(
                "smp.step: the step function returned results of different structures in "
                f"microbatch 0 ({spec}) and microbatch {mb} ({other}); return the same nesting "
                "from every microbatch"
            )

    def gathered(j: int) -> StepOutput:
        values = [f[0][j] for f in flat]
        if detach:
            values = [v.detach() if isinstance(v, torch.Tensor) else v for v in values]
        return StepOutput(values)

    return tree.unflatten([gathered(j) for j in range(len(leaves))], spec)
