"""Activation checkpointing (SMP v1's API) on torch's saved-tensor hooks (design.md §7.1).

- :func:`set_activation_checkpointing` marks a module: from then on every call of it saves only
  its inputs and runs its forward again in backward. Marking replaces the module's ``forward``
  on the instance (its class, parameters and state-dict keys stay as they are) and makes it
  *atomic* for the partitioner: a checkpointed module lies whole on one pipeline stage, so its
  recompute, which runs inside its owner's backward task, never calls another stage.
- An ``nn.Sequential`` takes a strategy: ``"each"`` marks every child; ``"group_<n>"`` runs n
  consecutive children as one checkpoint and ``"contiguous"`` the consecutive children that
  live on one stage; a group is cut where a child lives on another stage (that child is then
  checkpointed alone, on its owner). ``nn.ModuleList`` takes ``"each"``: its loop is the
  parent's code.
- :func:`checkpoint` checkpoints one call. A call of a module of another stage carries the
  request in the REQUEST's call mode and the owner checkpoints it.
- Randomness: the recompute runs with the random streams of the call (torch's CPU and CUDA
  generators and smp's tensor-parallel ones, ``preserve_rng_state``), so dropout masks, TP ones
  included, are drawn again bitwise.
- A region is recomputed once per backward, however many autograd calls reach it (:class:`Frame`).
- A checkpointed module called inside another checkpointed call runs plainly: the outer
  recompute runs it again anyway, and nesting would recompute it twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from smp.core import tree
from smp.core.rng import random_streams, set_random_streams
from smp.core.tracing import is_tracing

__all__ = [
    "CheckpointOptions",
    "set_activation_checkpointing",
    "checkpoint",
    "checkpoint_sequential",
    "is_checkpointed",
]

_MARK = "_smp_checkpoint"  # CheckpointOptions of a marked module
_INNER = "_smp_checkpoint_inner"  # an instance-level forward that marking replaced, if any
_GROUP = "_smp_checkpoint_group"  # CheckpointOptions of an nn.Sequential run in groups
_CALLED = "_smp_checkpoint_call"  # called through smp.checkpoint at least once (atomic)
_STRATEGY = re.compile(r"^(each|contiguous|group_([1-9][0-9]*))$")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How a module is checkpointed. ``pack_args_as_tuple`` is SMP v1's, kept for its scripts:
    v1 checkpointed through a reentrant autograd function, which needed tuples packed; smp's
    :class:`Frame` passes any arguments as they are, so it changes nothing."""

    preserve_rng_state: bool = True
    pack_args_as_tuple: bool = False
    strategy: str = "each"


_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    _local.depth = _depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1


def requested() -> tuple[bool, bool] | None:
    """(checkpoint, preserve_rng_state) of a :func:`checkpoint` call of a module of another
    stage being sent now (read into the REQUEST's call mode), else None."""
    return getattr(_local, "request", None)


# ---- the checkpointed call ---------------------------------------------------------------------


class _Stop(BaseException):
    """Ends a recompute once it has produced every tensor the forward saved (a BaseException:
    the module's own ``except Exception`` must not catch it)."""


class _Handle:
    """What a checkpointed forward's autograd graph keeps instead of a saved tensor: the
    frame and the tensor's position among the tensors the forward saved. When autograd frees
    it (the node ran without ``retain_graph``), the recomputed tensor goes with it."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: Frame, index: int):
        self.frame, self.index = frame, index

    def __del__(self):
        self.frame.values.pop(self.index, None)


class Frame:
    """One checkpointed call: its inputs (detached), the random streams and autocast state
    it started with, and after the recompute, the tensors the forward saved, by position.

    torch's own non-reentrant checkpoint keeps recomputed tensors per autograd call (graph
    task) and recomputes for each call that reaches the region. smp's backward reaches one
    region from several calls (a segment sliced at remote calls runs shared nodes twice with
    ``retain_graph``; the zero-bubble split runs the weight half later, design.md §4.4, §4.4),
    so smp keeps them per handle: a region is recomputed once per backward, and each
    recomputed tensor lives until the graph drops the handle that stands for it."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng: bool):
        self.fn = fn
        self.inputs = tree.map_tensors(_detached, (args, kwargs))
        self.versions = [t._version for t in tree.tensors(self.inputs)]
        self.streams = random_streams() if preserve_rng else None
        self.autocast = [
            (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST
        ]
        self.count = 0  # tensors the forward saved
        self.values: dict[int, torch.Tensor] = {}
        self.recomputed = False
        self.offloaded: Any = None  # the offloader's record while the inputs are on the host
        self.modified: tuple | None = None  # the shape of an input modified in place

    def pack(self, tensor: torch.Tensor) -> _Handle:
        self.count += 1
        return _Handle(self, self.count - 1)

    def unpack(self, handle: _Handle) -> torch.Tensor:
        if not self.recomputed:
            self.recompute()
        try:
            return self.values[handle.index]
        except KeyError:
            raise RuntimeError(
                "smp activation checkpointing: a tensor saved by the checkpointed forward was "
                "not produced again by its recompute (the forward took another path the "
                "second time); make the module's forward depend only on its inputs"
            ) from None

    def check_versions(self) -> None:
        """Notes an input modified in place since the call (raised by the recompute)."""
        if self.inputs is None or self.modified is not None:
            return
        for t, version in zip(tree.tensors(self.inputs), self.versions):
            if t._version != version:
                self.modified = tuple(t.shape)

    def recompute(self) -> None:
        if self.offloaded is not None:
            self.offloaded.load(self)  # not brought back in time: now, on this thread
        self.check_versions()
        if self.modified is not None:
            raise RuntimeError(
                "smp activation checkpointing: an input of a checkpointed module was "
                f"modified in place after the call (a tensor of shape {self.modified}); the "
                "recompute needs it as it was: clone it before modifying it"
            )
        args, kwargs = self.inputs
        produced = [0]

        def keep(tensor: torch.Tensor) -> None:
            index = produced[0]
            produced[0] += 1
            if index < self.count:
                self.values[index] = tensor.detach()
            if produced[0] >= self.count:
                raise _Stop()

        now = random_streams() if self.streams is not None else None
        with contextlib.ExitStack() as stack:
            if self.streams is not None:
                set_random_streams(self.streams)
            for device, enabled, dtype in self.autocast:
                if enabled or torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, _no_unpack))
            stack.enter_context(_inside())
            try:
                self.fn(*args, **kwargs)
            except _Stop:
                pass
            finally:
                if now is not None:
                    set_random_streams(now)
        if produced[0] < self.count:
            raise RuntimeError(
                f"smp activation checkpointing: the recompute saved {produced[0]} tensors, the "
                f"forward {self.count} (the forward took another path the second time); make "
                "the module's forward depend only on its inputs"
            )
        self.recomputed = True
        self.inputs = None  # every saved tensor is back: the inputs are not needed any more


_AUTOCAST = ("cpu", "cuda")


def _detached(t: torch.Tensor) -> torch.Tensor:
    out = t.detach()
    out.requires_grad_(t.requires_grad)
    return out


def _no_unpack(_: Any) -> torch.Tensor:
    raise RuntimeError("smp activation checkpointing: the recompute's own graph is not used")


def run(fn: Callable[..., Any], args: tuple, kwargs: dict, preserve_rng_state: bool = True) -> Any:
    """``fn(*args, **kwargs)`` checkpointed: its autograd graph keeps handles instead of the
    tensors it saves, and the first backward to need one runs ``fn`` again on the saved inputs
    with the random streams (torch's and smp's TP generators) and autocast state it had. Runs
    plainly when nothing would be saved (grad off, tracing) or inside another checkpointed
    call (the outer recompute runs it again anyway)."""
    if _depth() or not torch.is_grad_enabled() or is_tracing():
        return fn(*args, **kwargs)
    frame = Frame(fn, args, kwargs, preserve_rng_state)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), _inside():
        output = fn(*args, **kwargs)
    offload = _offloader()
    if offload is not None and frame.count:
        offload.add(frame)
    return output


def _offloader():
    """The activation offloader of this rank when ``offload_activations`` is on (activation
    offloading lives in :mod:`smp.memory.offload`)."""
    from smp.state import get_state, is_initialized

    if not is_initialized() or not get_state().config.offload_activations:
        return None
    from smp.memory import offload

    return offload.current()


def call(module: nn.Module, args: tuple, kwargs: dict, checkpointed: tuple[bool, bool]) -> Any:
    """A served call on its owner: under checkpoint when the caller asked for it."""
    if checkpointed[0]:
        return run(module, args, kwargs, checkpointed[1])
    return module(*args, **kwargs)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a marked module: its own forward, checkpointed."""
    options: CheckpointOptions = self.__dict__[_MARK]
    inner = self.__dict__.get(_INNER)
    forward = inner if inner is not None else types.MethodType(type(self).forward, self)
    return run(forward, args, kwargs, options.preserve_rng_state)


def _run_grouped(
    children: list[nn.Module],
    strategy: str,
    preserve_rng_state: bool,
    input: Any,
    alone: Callable[[nn.Module, Any], Any],
) -> Any:
    """Runs ``children`` in order on ``input``: each group of the strategy cut into the runs of
    children on this stage, a run of several as one checkpoint, a child alone through
    ``alone``."""
    for group in _groups(children, strategy):
        for piece in _local_pieces(group):
            if len(piece) == 1:
                input = alone(piece[0], input)
            else:
                input = run(_chain(piece), (input,), {}, preserve_rng_state)
    return input


def _chain(modules: list[nn.Module]) -> Callable[[Any], Any]:
    def chain(x: Any) -> Any:
        for m in modules:
            x = m(x)
        return x

    return chain


def _groups(children: list[nn.Module], strategy: str) -> list[list[nn.Module]]:
    if strategy == "contiguous":
        return [children]  # cut by stage below
    n = 1 if strategy == "each" else int(strategy.split("_")[1])
    return [children[i : i + n] for i in range(0, len(children), n)]


def _is_remote(module: nn.Module) -> bool:
    return "_smp_remote" in module.__dict__


def _local_pieces(group: list[nn.Module]) -> list[list[nn.Module]]:
    """``group`` cut into runs of children on this stage, each child of another stage alone."""
    pieces: list[list[nn.Module]] = []
    for m in group:
        if _is_remote(m) or not pieces or _is_remote(pieces[-1][-1]):
            pieces.append([m])
        else:
            pieces[-1].append(m)
    return pieces


# ---- the public functions -----------------------------------------------------------------------


def is_checkpointed(module: nn.Module) -> bool:
    """Whether the partitioner must keep ``module`` whole on one stage for checkpointing."""
    return _MARK in module.__dict__ or module.__dict__.get(_CALLED, False)


def options_of(module: nn.Module) -> CheckpointOptions | None:
    """The options ``module`` was marked with by :func:`set_activation_checkpointing`."""
    return module.__dict__.get(_MARK)


def _check_options(where: str, preserve_rng_state: Any, pack_args_as_tuple: Any) -> None:
    for name, value in (
        ("preserve_rng_state", preserve_rng_state),
        ("pack_args_as_tuple", pack_args_as_tuple),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be True or False, got {value!r}")


def _check_strategy(where: str, strategy: Any) -> None:
    if not isinstance(strategy, str) or not _STRATEGY.match(strategy):
        raise ValueError(
            f'{where}: strategy must be "each", "contiguous" or "group_<n>" with n >= 1 '
            f'(e.g. "group_2"), got {strategy!r}'
        )


def _unwrapped(module: Any, where: str) -> nn.Module:
    if getattr(type(module), "_smp_distributed_model", False):  # smp.DistributedModel itself
        raise ValueError(
            f"{where}: got the smp.DistributedModel itself; pass one of its modules (e.g. each "
            "transformer layer, reached through model.get_module())"
        )
    if not isinstance(module, nn.Module):
        raise ValueError(f"{where}: expected an nn.Module, got {type(module).__name__}")
    return module


def _mark(module: nn.Module, options: CheckpointOptions) -> None:
    _check_placement(module)
    if _MARK not in module.__dict__ and "forward" in module.__dict__:
        module.__dict__[_INNER] = module.__dict__["forward"]  # e.g. a hook library's wrapper
    module.__dict__[_MARK] = options
    module.__dict__["forward"] = types.MethodType(_checkpointed_forward, module)


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
    strategy: str = "each",
) -> None:
    """Checkpoints ``module``: its calls keep only their inputs, and their forward runs again in
    backward. Call it before or after wrapping the model, before the first step.

    Args:
        module: A module of the model (not the ``DistributedModel``). For an ``nn.Sequential``
            ``strategy`` says how its children are checkpointed; an ``nn.ModuleList`` has every
            child checkpointed (``"each"``).
        preserve_rng_state: Draw the same random numbers in the recompute (dropout), torch's
            generators and smp's tensor-parallel ones. Without it the recompute's masks differ
            from the forward's and the gradients are not those of the forward.
        pack_args_as_tuple: SMP v1's; no effect (any arguments pass as they are).
        strategy: ``"each"`` (every child alone), ``"group_<n>"`` (n consecutive children as
            one checkpoint) or ``"contiguous"`` (the consecutive children on one pipeline stage
            as one checkpoint). Only for ``nn.Sequential`` / ``nn.ModuleList``.

    Raises:
        ValueError: not a module, a bad option, a strategy for another kind of module, or (after
            the first step) a module whose parts the partition put on different stages.
    """
    where = "smp.set_activation_checkpointing"
    module = _unwrapped(module, where)
    _check_options(where, preserve_rng_state, pack_args_as_tuple)
    _check_strategy(where, strategy)
    options = CheckpointOptions(preserve_rng_state, pack_args_as_tuple, strategy)
    if isinstance(module, nn.ModuleList):
        if strategy != "each":
            raise ValueError(
                f"{where}: strategy {strategy!r} needs an nn.Sequential (smp runs its children "
                "in groups); this is an nn.ModuleList, whose loop is its parent's code: use "
                'strategy="each"'
            )
        for child in module:
            _mark(child, options)
        return
    if isinstance(module, nn.Sequential):
        for child in module:
            _mark(child, dataclasses.replace(options, strategy="each"))
        if strategy != "each":
            _mark_group(module, options)
        return
    if strategy != "each":
        raise ValueError(
            f"{where}: strategy {strategy!r} is for an nn.Sequential; "
            f'{type(module).__name__} is checkpointed whole: leave strategy at "each"'
        )
    _mark(module, options)


def _mark_group(seq: nn.Sequential, options: CheckpointOptions) -> None:
    seq.__dict__[_GROUP] = options
    seq.__dict__["forward"] = types.MethodType(_grouped_forward, seq)


def _grouped_forward(self: nn.Sequential, input: Any) -> Any:
    """An ``nn.Sequential``'s forward under ``group_<n>`` / ``contiguous``; a child alone is
    checkpointed by its own mark, wherever it lives."""
    options: CheckpointOptions = self.__dict__[_GROUP]
    return _run_grouped(
        list(self), options.strategy, options.preserve_rng_state, input, lambda m, x: m(x)
    )


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True, **kwargs: Any):
    """``module(*args, **kwargs)``, checkpointed: only the inputs are kept, and the forward
    runs again in backward. A module of another pipeline stage is checkpointed by its owner.
    The module is kept whole on one stage by the partitioner."""
    where = "smp.checkpoint"
    module = _unwrapped(module, where)
    _check_options(where, preserve_rng_state, False)
    module.__dict__[_CALLED] = True
    if _is_remote(module):
        _local.request = (torch.is_grad_enabled() and not _depth(), preserve_rng_state)
        try:
            return module(*args, **kwargs)
        finally:
            _local.request = None
    return run(module, args, kwargs, preserve_rng_state)


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """Runs ``sequential_module`` on ``input`` with its children checkpointed by ``strategy``
    (as :func:`set_activation_checkpointing` would, for this call only)."""
    where = "smp.checkpoint_sequential"
    if not isinstance(sequential_module, nn.Sequential):
        raise ValueError(
            f"{where}: expected an nn.Sequential, got {type(sequential_module).__name__}"
        )
    _check_options(where, preserve_rng_state, pack_args_as_tuple)
    _check_strategy(where, strategy)
    for child in sequential_module:
        child.__dict__[_CALLED] = True  # kept whole on one stage by the partitioner

    def alone(module: nn.Module, x: Any) -> Any:
        return checkpoint(module, x, preserve_rng_state=preserve_rng_state)

    return _run_grouped(list(sequential_module), strategy, preserve_rng_state, input, alone)


def _check_placement(module: nn.Module) -> None:
    """After the partition: ``module`` must lie whole on one stage (it cannot move now)."""
    from smp.state import get_state, is_initialized

    if not is_initialized():
        return
    for model in list(get_state().models):
        runtime = getattr(model, "_runtime", None)
        if runtime is None:
            continue
        paths = {id(m): p for p, m in model.module.named_modules()}
        if id(module) not in paths:
            continue
        path = paths[id(module)]
        prefix = f"{path}." if path else ""
        stages = {
            s
            for p, s in runtime.assignment.items()
            if p == path or p.startswith(prefix) or not path
        }
        if len(stages) > 1:
            raise ValueError(
                f"smp.set_activation_checkpointing: module '{path or '<root>'}' was partitioned "
                f"over pipeline stages {sorted(stages)} by the first step, and its recompute "
                "cannot call another stage; mark it before the first step (the partition then "
                "keeps it whole) or checkpoint its children"
            )
