"""Marking modules for tensor parallelism, the registry of distributed implementations, and the
conversion ``smp.DistributedModel`` applies at wrap time (api.md §7, design.md §6).

A module is *marked* when it is created inside ``smp.tensor_parallelism()`` (or
``smp.model_creation(tensor_parallelism=True)``), or by ``smp.set_tensor_parallelism``. At wrap
time, with ``tensor_parallel_degree > 1``, every marked module whose type is registered is
replaced by its distributed version, its weights sharded in (pretrained weights survive), walking
the model from the root: a replaced module's submodules are part of it. A marked module that
cannot be distributed (sizes not divisible by the degree, parameters shared with modules outside
it) stays as it is and a warning names it.

Two kinds of registration:
  - ``tp_register`` / ``tp_register_with_module`` (users): the distributed class is built from
    the original constructor's arguments (recorded when the module is created inside
    ``smp.tensor_parallelism()``, translated by ``init_hook``), then loads the original's state
    dict, which must have the same keys (full shapes: the distributed module shards them).
    ``forward_hook`` / ``return_hook`` translate the call and the result.
  - built-in converters (torch.nn.Linear, Embedding, LayerNorm; Hugging Face GPT-2, BERT,
    RoBERTa and Llama blocks): built from the module instance. The Hugging Face blocks keep their
    own forward; their projections become column/row-parallel DistributedLinear shards (a
    "sharding plan"), so every feature of the block (rotary embeddings, grouped-query attention,
    its attention kernels) keeps working, and the state-dict keys stay the same.

One file of a little over 800 lines: the built-in converters and the sharding plans go through
the same checks, refusals and state loading as a user's registration, which are private to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from smp.core.creation import creation_hook
from smp.core.unbuilt import fail
from smp.memory import activations, delayed
from smp.tp import functional as tpf
from smp.tp.modules import (
    DistributedEmbedding,
    DistributedLayerNorm,
    DistributedLinear,
    DistributedModule,
)
from smp.tp.region import run_region
from smp.tp.subclasses import computes_linear, own_forward

__all__ = [
    "tensor_parallelism",
    "set_tensor_parallelism",
    "model_creation",
    "tp_register",
    "tp_register_with_module",
    "tp_register_plan",
    "distribute_marked_modules",
    "is_distributed_parameter",
]

logger = logging.getLogger("smp")

_MARK = "_smp_tp"  # on a module: dict of tp kwargs (marked), False (explicitly not), absent
_INIT_ARGS = "_smp_init_args"


# ---- registry -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Registration:
    dist_cls: type | None = None
    init_hook: Callable | None = None
    forward_hook: Callable | None = None
    return_hook: Callable | None = None
    # Built-ins: (module, tp_kwargs, group) -> distributed module, or raise _CannotDistribute.
    convert: Callable[[nn.Module, dict, Any], nn.Module] | None = None


_registry: dict[type, _Registration] = {}
_lazy_registry: dict[str, Callable[[nn.Module, dict, Any], nn.Module]] = {}  # "module.Class"


class _CannotDistribute(Exception):
    """The module stays as it is; the message says why (it becomes the warning)."""


def tp_register_with_module(
    module_cls: type,
    dist_module: type,
    init_hook: Callable | None = None,
    forward_hook: Callable | None = None,
    return_hook: Callable | None = None,
) -> None:
    """Registers ``dist_module`` (a :class:`smp.nn.DistributedModule`) as the distributed version
    of ``module_cls`` (SMP v1's argument names).

    Args:
        init_hook: ``(*args, **kwargs) -> (args, kwargs)``: the constructor arguments of ``cls``
            to those of ``dist_cls`` (default: the same).
        forward_hook: ``(*args, **kwargs) -> (args, kwargs)``: the forward arguments of ``cls``
            to those of ``dist_cls`` (default: the same).
        return_hook: ``output -> output``: ``dist_cls``'s output to ``cls``'s (default: same).
    """
    cls, dist_cls = module_cls, dist_module
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"tp_register: {cls!r} is not an nn.Module class")
    if not (isinstance(dist_cls, type) and issubclass(dist_cls, nn.Module)):
        raise ValueError(
            f"tp_register: the distributed module {dist_cls!r} is not an nn.Module class"
        )
    for name, hook in (
        ("init_hook", init_hook),
        ("forward_hook", forward_hook),
        ("return_hook", return_hook),
    ):
        if hook is not None and not callable(hook):
            raise ValueError(f"tp_register: {name} must be callable, got {hook!r}")
    _registry[cls] = _Registration(dist_cls, init_hook, forward_hook, return_hook)


def tp_register(
    dist_module: type,
    init_hook: Callable | None = None,
    forward_hook: Callable | None = None,
    return_hook: Callable | None = None,
) -> Callable[[type], type]:
    """Class decorator form of :func:`tp_register_with_module`::

    @smp.tp_register(MyDistributedBlock, init_hook=lambda cfg: ((), {"hidden": cfg.hidden}))
    class MyBlock(nn.Module): ...
    """

    def decorate(cls: type) -> type:
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return decorate


def _find_registration(module: nn.Module) -> _Registration | None:
    """The registration of the module's class or of the nearest registered base class, unless a
    class in between defines its own ``forward``: the distributed version would replace that
    forward (e.g. OPT's learned positions, an ``nn.Embedding`` that offsets its ids). An
    ``nn.Linear`` whose own forward computes ``nn.Linear``'s function (Falcon's
    ``FalconLinear``: ``input @ weight.T + bias``; see
    :func:`smp.tp.subclasses.computes_linear`) is an ``nn.Linear``."""
    return _lookup(module)[0]


def _lookup(module: nn.Module) -> tuple[_Registration | None, str | None]:
    """(:func:`_find_registration`'s answer, why a registered base class was refused: the class
    in between that defines its own ``forward``; None when there is no registered base)."""
    for klass in type(module).__mro__:
        registration = _registry.get(klass)
        if registration is None:
            convert = _lazy_registry.get(f"{klass.__module__}.{klass.__qualname__}")
            registration = _Registration(convert=convert) if convert is not None else None
        if registration is not None:
            own = own_forward(module, klass)
            if own is None or (klass is nn.Linear and computes_linear(module)):
                return registration, None
            return None, (
                f"its class {own.__qualname__} defines its own forward, which the distributed "
                f"{klass.__name__} would replace"
                + (" (it does not compute nn.Linear's function)" if klass is nn.Linear else "")
            )
    return None, None


# ---- marking ------------------------------------------------------------------------------------

_marking = threading.local()


def _mark(module: nn.Module) -> None:
    stack = getattr(_marking, "stack", None)
    if stack:
        object.__setattr__(module, _MARK, stack[-1])


def _recording_init(original: Callable) -> Callable:
    def init(self, *args, **kwargs):
        if getattr(_marking, "stack", None) and not hasattr(self, _INIT_ARGS):
            object.__setattr__(self, _INIT_ARGS, (args, dict(kwargs)))
        original(self, *args, **kwargs)

    init._smp_original = original  # type: ignore[attr-defined]
    return init


# SMP v1's fused-kernel and model options of tensor_parallelism / model_creation that no smp
# module takes: what smp does instead (logged once per key, on rank 0, when a script passes it).
_V1_KERNEL_OPTIONS = {
    "fused_softmax": "attention uses torch's scaled_dot_product_attention, which fuses the mask "
    "and softmax where the backend has a kernel",
    "fused_bias_gelu": "bias and GELU run as torch ops (same result, no fused kernel)",
    "fused_dropout": "dropout runs as torch ops (same result, no fused kernel)",
    "flash_attention": "torch's scaled_dot_product_attention picks flash attention on GPUs by "
    "itself",
    "attention_in_fp32": "attention computes as torch.autocast decides under bf16/fp16 (its "
    "matrix products in the low precision)",
    "query_key_layer_scaling": "the attention scores are scaled once by 1/sqrt(head size) (the "
    "same values in exact arithmetic)",
    "distribute_embedding": "embeddings of marked models are split along the vocabulary by "
    "smp's own rules",
    "zero_init": "parameters are initialised as the model's constructor does",
}
_noted: set[str] = set()


def _v1_kernel_options(tp_config: dict) -> dict:
    """``tp_config`` without SMP v1's kernel options, each noted once on rank 0; ``use_alibi``
    (a different model, not built) raises when true."""
    if tp_config.get("use_alibi"):
        fail("smp.tensor_parallelism(use_alibi=True)", "ALiBi attention biases")
    out = {}
    for key, value in tp_config.items():
        if key == "use_alibi":
            continue
        if key not in _V1_KERNEL_OPTIONS:
            out[key] = value
        elif key not in _noted:
            _noted.add(key)
            if os.environ.get("RANK", "0") == "0":
                logger.warning("smp: %s=%r: %s", key, value, _V1_KERNEL_OPTIONS[key])
    return out


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """Modules created inside are marked for tensor parallelism (``enabled=False`` unmarks, e.g.
    to keep one submodule whole inside a marked model). ``tp_config`` keyword arguments reach the
    distributed modules (e.g. ``optimize="memory"``).

    Example:
        with smp.tensor_parallelism():
            model = MyTransformer(config)
        model = smp.DistributedModel(model)
    """
    stack = getattr(_marking, "stack", None)
    if stack is None:
        stack = _marking.stack = []
    stack.append(_v1_kernel_options(tp_config) if enabled else False)
    patched: list[type] = []
    if len(stack) == 1:
        for cls in [
            c for c, r in _registry.items() if r.convert is None
        ]:  # user registrations need the constructor's arguments
            if cls.__init__ is not None and not hasattr(cls.__init__, "_smp_original"):
                cls.__init__ = _recording_init(cls.__init__)
                patched.append(cls)
    try:
        with creation_hook(_mark):
            yield
    finally:
        stack.pop()
        for cls in patched:
            cls.__init__ = cls.__init__._smp_original


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config: Any) -> None:
    """Marks (or, with ``enabled=False``, unmarks) an existing ``module`` and its submodules."""
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"smp.set_tensor_parallelism takes an nn.Module, got {type(module).__name__}"
        )
    mark = _v1_kernel_options(tp_config) if enabled else False
    for sub in module.modules():
        object.__setattr__(sub, _MARK, mark)


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tp_config: Any
) -> Iterator[None]:
    """Creates a model the way smp wants it: marked for tensor parallelism if asked, with
    ``dtype`` as the default dtype (a bfloat16 / float16 model then trains with float32 master
    weights in ``smp.DistributedOptimizer``), and with parameters left for
    ``smp.DistributedModel`` to give values on the ranks that own them when the config has
    ``delayed_parameter_initialization`` (:func:`smp.delay_param_initialization`)."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"smp.model_creation: dtype must be a torch.dtype, got {dtype!r}")
    previous = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if dtype is not None:
            torch.set_default_dtype(dtype)
            stack.callback(torch.set_default_dtype, previous)
        if tensor_parallelism:
            stack.enter_context(_tp_context(**tp_config))
        from smp.state import get_state, is_initialized

        if is_initialized() and get_state().config.delayed_parameter_initialization:
            stack.enter_context(delayed.delay_param_initialization())
        yield


_tp_context = tensor_parallelism  # model_creation's argument shadows the name


# ---- conversion ---------------------------------------------------------------------------------


def is_distributed_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to a distributed module (it carries its reduction class)."""
    return hasattr(param, "_smp_tp_reduce")


def carry_checkpointing(old: nn.Module, new: nn.Module) -> None:
    """Gives ``new`` (the distributed version of ``old``) ``old``'s activation checkpointing."""
    options = activations.options_of(old)
    if options is not None:
        activations.set_activation_checkpointing(new, **dataclasses.asdict(options))


def distribute_marked_modules(root: nn.Module, group: Any) -> tuple[nn.Module, list[str]]:
    """Replaces every marked, registered module of ``root`` by its distributed version.

    Returns (the new root — itself replaced if it was marked —, the paths replaced). Emits one
    warning per marked module that stays whole, naming it and why, and one naming every marked
    module of a registered kind whose class defines its own forward (and so stays whole), with
    the bytes each rank then holds whole.
    """
    owners = _parameter_owners(root)
    replaced: list[str] = []
    refused: list[tuple[str, nn.Module, str]] = []

    def visit(module: nn.Module, path: str) -> nn.Module:
        mark = getattr(module, _MARK, None)
        if isinstance(mark, dict) and not _is_distributed(module):
            registration, why = _lookup(module)
            if why is not None:
                refused.append((path or "<root>", module, why))
            if registration is not None:
                try:
                    _check_not_shared(module, path, owners)
                    with delayed.converting(module, group.size(), group.rank()) as out:
                        new = out["new"] = _convert(module, registration, dict(mark), group)
                except _CannotDistribute as exc:
                    warnings.warn(
                        f"smp: module {path or '<root>'} ({type(module).__name__}) is marked for "
                        f"tensor parallelism but stays whole: {exc}",
                        stacklevel=3,
                    )
                else:
                    replaced.append(path or "<root>")
                    carry_checkpointing(module, new)
                    return new
        for name, child in list(module.named_children()):
            new_child = visit(child, f"{path}.{name}" if path else name)
            if new_child is not child:
                setattr(module, name, new_child)
        return module

    root = visit(root, "")
    _name_regions(root)
    if refused:
        _warn_kept_whole(refused)
    return root, replaced


def _warn_kept_whole(refused: list[tuple[str, nn.Module, str]]) -> None:
    """One warning (on every rank, as the other conversion warnings) naming each marked module
    that stays whole because its class defines its own forward, and the bytes of parameters
    every rank then holds whole: a model made of such modules is barely split at all (Falcon's
    projections, before ``FalconLinear`` was recognised as linear, left each rank 0.976 of it)."""
    seen: set[int] = set()
    total = 0
    lines = []
    for path, module, why in refused:
        size = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                size += _parameter_bytes(p)
        total += size
        lines.append(f"{path} ({type(module).__name__}, {size} bytes): {why}")
    shown = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
    warnings.warn(
        f"smp: {len(lines)} module(s) marked for tensor parallelism stay whole, {total} bytes of "
        f"parameters held whole on every rank: {shown}. Register a distributed version "
        "(smp.tp_register) or a sharding plan of the block around them (smp.tp_register_plan) "
        "to split them",
        stacklevel=3,
    )


def _parameter_bytes(p: torch.Tensor) -> int:
    """The bytes of ``p``, or of the tensor it stands for when it is a delayed placeholder."""
    record = getattr(p, delayed._PROGRAM, None)
    if p.numel() == 0 and record is not None and hasattr(record, "shape"):
        numel = 1
        for d in record.shape:
            numel *= d
        return numel * torch.empty((), dtype=record.dtype).element_size()
    return p.numel() * p.element_size()


_LAYER_LISTS = ("h", "layers", "layer")  # GPT-2 / GPT-J / Bloom, Llama / NeoX, BERT / RoBERTa


def alias_layer_lists(root: nn.Module) -> list[str]:
    """Gives each marked transformer body's layer list SMP v1's name as well: ``seq_layers``.

    v1 replaced a marked Hugging Face transformer by its own ``DistributedTransformer``, whose
    layers v1 scripts reach as ``model.transformer.seq_layers`` (to checkpoint or place them).
    smp keeps the model's own modules and splits them in place, so ``seq_layers`` is the same
    ``nn.ModuleList`` under a second name: an attribute only, not a submodule, so parameter
    names and state-dict keys stay the model's. Returns the paths given the alias."""
    named = []
    for path, module in root.named_modules():
        taken = "seq_layers" in module.__dict__ or "seq_layers" in module._modules
        if taken or not isinstance(getattr(module, _MARK, None), dict):
            continue
        for name in _LAYER_LISTS:
            layers = module._modules.get(name)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                module.__dict__["seq_layers"] = layers
                named.append(f"{path}.{name}" if path else name)
                break
    return named


def _is_distributed(module: nn.Module) -> bool:
    return isinstance(module, (DistributedModule, _ShardedBlock))


def _name_regions(root: nn.Module) -> None:
    """Names each distributed module by its path in the model: what the TP ranks compare when
    they agree on a region's arguments, and what their errors call it (smp/tp/agreement.py)."""
    for path, module in root.named_modules():
        if _is_distributed(module):
            module._smp_region_name = path or "<root>"


def _parameter_owners(root: nn.Module) -> dict[int, set[str]]:
    owners: dict[int, set[str]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    return owners


def _check_not_shared(module: nn.Module, path: str, owners: dict[int, set[str]]) -> None:
    prefix = f"{path}." if path else ""
    for name, p in module.named_parameters():
        outside = sorted(o for o in owners.get(id(p), ()) if o != path and not o.startswith(prefix))
        if outside:
            raise _CannotDistribute(
                f"its parameter {name} is shared with {outside[0]} (tied weights), which would be "
                "split differently. smp splits a tied pair together only for a causal language "
                "model's output head and its input embedding (along the vocabulary, when the "
                "vocabulary divides by the degree); otherwise both stay whole (the same results, "
                "each rank holding the whole tensor). Untie them to split them apart"
            )


def _convert(module: nn.Module, reg: _Registration, tp_kwargs: dict, group: Any) -> nn.Module:
    if reg.convert is not None:
        new = reg.convert(module, tp_kwargs, group)
    else:
        recorded = getattr(module, _INIT_ARGS, None)
        if recorded is None:
            raise _CannotDistribute(
                f"its constructor arguments are unknown; create it inside "
                f"smp.tensor_parallelism() so they are recorded for {reg.dist_cls.__name__}"
            )
        args, kwargs = recorded
        if reg.init_hook is not None:
            args, kwargs = reg.init_hook(*args, **kwargs)
        # SMP v1's rule: a tp_config keyword that the distributed class takes overrides the
        # init hook's value; one it does not take is not passed.
        args, kwargs = _override(reg.dist_cls, args, kwargs, tp_kwargs)
        new = _divisible_or_skip(reg.dist_cls, *args, **kwargs)
        _load_full_state(new, module.state_dict(), type(module).__name__)
        if reg.forward_hook is not None or reg.return_hook is not None:
            new.__class__ = _hooked_class(type(new), reg.forward_hook, reg.return_hook)
    new.train(module.training)
    return new


def _override(cls: type, args: tuple, kwargs: dict, options: dict) -> tuple[tuple, dict]:
    """``cls``'s constructor arguments with each entry of ``options`` that it takes by name
    replacing the value given (positionally or not); entries it does not take are dropped."""
    signature = inspect.signature(cls)
    params = signature.parameters
    var_keyword = next(
        (k for k, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise _CannotDistribute(
            f"the init hook's arguments do not fit {cls.__name__}: {exc}"
        ) from exc
    for key, value in options.items():
        if key in params and key != var_keyword:
            bound.arguments[key] = value
        elif var_keyword is not None:
            bound.arguments.setdefault(var_keyword, {})[key] = value
    return bound.args, bound.kwargs


def _load_full_state(new: nn.Module, full: dict[str, torch.Tensor], what: str) -> None:
    local = tpf.shard_state(full, dict(new.named_parameters()), _size(new), _rank(new))
    missing, unexpected = new.load_state_dict(local, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"smp: the distributed version {type(new).__name__} of {what} must have the same "
            f"state-dict keys (with full shapes) to take its weights; missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    with torch.no_grad():  # tag what the distributed class left untagged: replicated in region
        for p in new.parameters():
            if not hasattr(p, "_smp_tp_reduce"):
                p._smp_tp_split, p._smp_tp_reduce = None, "rdp"


def _size(module: nn.Module) -> int:
    return getattr(module, "tp_size", 1)


def _rank(module: nn.Module) -> int:
    return getattr(module, "tp_rank", 0)


_hooked_classes: dict[tuple, type] = {}


def _hooked_class(cls: type, forward_hook, return_hook) -> type:
    key = (cls, forward_hook, return_hook)
    if key not in _hooked_classes:

        def forward(self, *args, **kwargs):
            if forward_hook is not None:
                args, kwargs = forward_hook(*args, **kwargs)
            out = cls.forward(self, *args, **kwargs)
            return return_hook(out) if return_hook is not None else out

        _hooked_classes[key] = type(cls.__name__, (cls,), {"forward": forward})
    return _hooked_classes[key]


# ---- built-in converters: torch.nn ---------------------------------------------------------------


def _divisible_or_skip(factory: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """``factory(*args, **kwargs)``; a ValueError from it (e.g. sizes not divisible by the degree)
    means the module stays whole, with the error as the warning's reason."""
    try:
        return factory(*args, **kwargs)
    except ValueError as exc:
        raise _CannotDistribute(str(exc)) from exc


def _convert_linear(module: nn.Linear, tp: dict, group: Any) -> nn.Module:
    new = _divisible_or_skip(
        DistributedLinear,
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        split="row",
        group=group,
        dtype=module.weight.dtype,
        device=module.weight.device,
    )
    _load_full_state(new, module.state_dict(), "nn.Linear")
    return new


def _convert_embedding(module: nn.Embedding, tp: dict, group: Any) -> nn.Module:
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise _CannotDistribute("max_norm, sparse and scale_grad_by_freq are not supported")
    return _divisible_or_skip(
        DistributedEmbedding,
        module.num_embeddings,
        module.embedding_dim,
        padding_idx=module.padding_idx,
        group=group,
        full_weight=module.weight.detach().clone(),
    )


def _convert_layernorm(module: nn.LayerNorm, tp: dict, group: Any) -> nn.Module:
    if len(module.normalized_shape) != 1:
        raise _CannotDistribute("only LayerNorm over the last dimension is supported")
    new = _divisible_or_skip(
        DistributedLayerNorm,
        module.normalized_shape[0],
        eps=module.eps,
        elementwise_affine=module.elementwise_affine,
        bias=module.bias is not None,
        group=group,
        dtype=module.weight.dtype if module.weight is not None else None,
    )
    _load_full_state(new, module.state_dict(), "nn.LayerNorm")
    return new


_registry_builtin = {
    nn.Linear: _convert_linear,
    nn.Embedding: _convert_embedding,
    nn.LayerNorm: _convert_layernorm,
}
for _cls, _fn in _registry_builtin.items():
    _registry[_cls] = _Registration(convert=_fn)


# ---- built-in converters: Hugging Face blocks (sharding plans) ----------------------------------


@dataclasses.dataclass
class _Plan:
    """Which projections of a block are column- or row-parallel, and the attributes to divide.

    ``column``/``row``: submodule paths (nn.Linear, or transformers' Conv1D with its [in, out]
    weight). ``fused``: path -> number of equal output blocks (GPT-2's fused QKV = 3).
    ``divide``: (submodule path, attribute) whose value becomes value / degree (head counts,
    split sizes). ``heads``: (submodule path, attribute) that must divide by the degree.
    """

    column: tuple[str, ...]
    row: tuple[str, ...]
    fused: dict[str, int] = dataclasses.field(default_factory=dict)
    divide: tuple[tuple[str, str], ...] = ()
    heads: tuple[tuple[str, str], ...] = ()


class _ShardedBlock:
    """Mixin of a Hugging Face block whose projections were sharded: its forward is a TP region
    (batch semantics as any distributed module) run with the TP-aware replicated RNG (the CPU's
    and, on a GPU, that device's), so dropout after the row-parallel projections draws the same
    mask on every rank of the group."""

    tp_group: Any
    tp_size: int
    tp_rank: int
    _smp_atomic = True  # never split across pipeline stages (see DistributedModule)

    def forward(self, *args, **kwargs):
        base = super().forward  # type: ignore[misc]
        if not self.training:
            return run_region(self, base, args, kwargs)
        # The block's dropout draws from torch's default generators: the CPU one and, for a
        # block on a GPU, that GPU's. Both are swapped for the replicated TP streams.
        device = next(self.parameters()).device
        on_gpu = device.type == "cuda"
        cpu_stream = tpf.tp_rng("replicated")
        gpu_stream = tpf.tp_rng("replicated", device) if on_gpu else None
        with torch.random.fork_rng(devices=[device.index] if on_gpu else []):
            torch.set_rng_state(cpu_stream.get_state())
            if gpu_stream is not None:
                torch.cuda.set_rng_state(gpu_stream.get_state(), device)
            try:
                return run_region(self, base, args, kwargs)
            finally:
                cpu_stream.set_state(torch.get_rng_state())
                if gpu_stream is not None:
                    gpu_stream.set_state(torch.cuda.get_rng_state(device))


_sharded_classes: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _sharded_classes:
        _sharded_classes[cls] = type(f"TP{cls.__name__}", (_ShardedBlock, cls), {})
    return _sharded_classes[cls]


def _linear_dims(module: nn.Module) -> tuple[int, int, bool]:
    """(in, out, transposed) of an nn.Linear (or a subclass computing its function) or a
    transformers Conv1D. Conv1D is recognised as transformers' class, not by its name: another
    class called Conv1D with an [out, in] weight would be split transposed, and of a square one
    nothing would say so."""
    if isinstance(module, nn.Linear):
        if not computes_linear(module):
            raise _CannotDistribute(
                f"{type(module).__qualname__} defines its own forward, which does not compute "
                "nn.Linear's function"
            )
        return module.in_features, module.out_features, False
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if (
        conv1d is not None
        and isinstance(module, conv1d)
        and own_forward(module, conv1d) is None
        and module.weight.dim() == 2
    ):
        return module.weight.size(0), module.weight.size(1), True
    raise _CannotDistribute(f"{type(module).__name__} is not a linear projection")


def _apply_plan(block: nn.Module, plan: _Plan, group: Any) -> nn.Module:
    n = group.size()
    for path, attr in plan.heads:
        value = block
        for part in (*filter(None, path.split(".")), attr):
            value = getattr(value, part)
        if value % n:
            raise _CannotDistribute(
                f"{path}.{attr} = {value} is not divisible by the tensor-parallel degree {n}"
            )
    replacements: dict[str, nn.Module] = {}
    for path in (*plan.column, *plan.row):
        old = block.get_submodule(path)
        in_f, out_f, transposed = _linear_dims(old)
        column = path in plan.column
        new = _divisible_or_skip(
            DistributedLinear,
            in_f,
            out_f,
            bias=old.bias is not None,
            split="column" if column else "row",
            gather_output=False,
            input_is_parallel=True,
            fused=plan.fused.get(path, 1),
            transposed=transposed,
            group=group,
            dtype=old.weight.dtype,
            device=old.weight.device,
        )
        _load_full_state(new, old.state_dict(), type(old).__name__)
        replacements[path] = new
    for path, new in replacements.items():
        block.set_submodule(path, new)
    for path, attr in plan.divide:
        sub = block.get_submodule(path)
        setattr(sub, attr, getattr(sub, attr) // n)
    for p in block.parameters():  # norms, row biases: replicated inside the region
        if not hasattr(p, "_smp_tp_reduce"):
            p._smp_tp_split, p._smp_tp_reduce = None, "rdp"
    block.__class__ = _sharded_class(type(block))
    block.tp_group, block.tp_size, block.tp_rank = group, n, group.rank()
    return block


def _plan_converter(plan: _Plan) -> Callable[[nn.Module, dict, Any], nn.Module]:
    def convert(block: nn.Module, tp: dict, group: Any) -> nn.Module:
        return _apply_plan(block, plan, group)

    return convert


def tp_register_plan(
    cls: type,
    column: tuple[str, ...] | list[str],
    row: tuple[str, ...] | list[str],
    fused: dict[str, int] | None = None,
    divide: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    heads: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
) -> None:
    """Registers a *sharding plan* for blocks of class ``cls``: the block keeps its own forward;
    its projections become tensor-parallel shards, and its forward becomes one TP region.

    Args:
        column: paths of nn.Linear (or transformers Conv1D) submodules split along their output
            features (Q, K, V, MLP-in): their outputs stay split.
        row: paths split along their input features (attention-out, MLP-out): their partial
            outputs are summed (one all-reduce each) before the bias.
        fused: path -> number of equal output blocks split one by one (a fused QKV is 3).
        divide: (submodule path, attribute) pairs divided by the degree, for forwards that
            reshape with per-layer head counts (prefer ``view(B, T, -1, head_dim)``).
        heads: (dotted path, attribute) of head counts that must divide by the degree.

    Each column projection's consumers must use only its rank-local features until a row
    projection (attention heads and MLP activations are local), as in Megatron-LM.

    Example (a GPT block whose attention reshapes with -1 heads):
        smp.tp_register_plan(Block, column=["attn.c_attn", "mlp.c_fc"],
                             row=["attn.c_proj", "mlp.c_proj"], fused={"attn.c_attn": 3})
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"tp_register_plan: {cls!r} is not an nn.Module class")
    column, row = tuple(column), tuple(row)
    overlap = set(column) & set(row)
    if overlap:
        raise ValueError(f"tp_register_plan: {sorted(overlap)} listed as both column and row")
    fused = dict(fused or {})
    for path in fused:
        if path not in column:
            raise ValueError(f"tp_register_plan: fused path {path!r} must be a column path")
    plan = _Plan(column, row, fused, tuple(map(tuple, divide)), tuple(map(tuple, heads)))
    _registry[cls] = _Registration(convert=_plan_converter(plan))


_GPT2 = _Plan(
    column=("attn.c_attn", "mlp.c_fc"),
    row=("attn.c_proj", "mlp.c_proj"),
    fused={"attn.c_attn": 3},
    divide=(("attn", "split_size"), ("attn", "num_heads")),
    heads=(("attn", "num_heads"),),
)
_BERT = _Plan(
    column=(
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "intermediate.dense",
    ),
    row=("attention.output.dense", "output.dense"),
    divide=(("attention.self", "num_attention_heads"), ("attention.self", "all_head_size")),
    heads=(("attention.self", "num_attention_heads"),),
)
_LLAMA = _Plan(
    column=(
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ),
    row=("self_attn.o_proj", "mlp.down_proj"),
    heads=(
        ("self_attn.config", "num_attention_heads"),
        ("self_attn.config", "num_key_value_heads"),
    ),
)

_lazy_registry.update(
    {
        "transformers.models.gpt2.modeling_gpt2.GPT2Block": _plan_converter(_GPT2),
        "transformers.models.bert.modeling_bert.BertLayer": _plan_converter(_BERT),
        "transformers.models.roberta.modeling_roberta.RobertaLayer": _plan_converter(_BERT),
        "transformers.models.llama.modeling_llama.LlamaDecoderLayer": _plan_converter(_LLAMA),
    }
)
