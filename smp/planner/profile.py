"""What a model holds and computes, measured from the model itself (design.md §13.2).

:func:`profile_model` runs one forward of the model under fake tensors (``FakeTensorMode``:
shapes, dtypes and autograd without data, so a 175B-parameter layer traces on a laptop) with grad
on and the model in training mode, and records per module:

- ``parameter_bytes``: the parameters it owns itself (a parameter shared by several modules
  counts once, at the first module that registers it, in ``named_modules`` order);
- ``activation_bytes``: the storage of every tensor autograd saved for backward while this
  module's own code ran (not its submodules'), each storage counted once over the whole forward,
  at the module that saved it first: three projections taking one input share it; a saved view
  keeps its whole base. Parameters and buffers are not activations. This is what the forward
  leaves behind for its backward, per microbatch;
- ``ops``: each ATen op its own code ran, as (matmul FLOPs, bytes read and written, dtype): what
  the time model prices on a device (smp.planner.plan);
- ``collectives``: the tensor-parallel primitives its own code ran (a model converted for a TP
  rank and run under ``smp.tp.functional.local_only``), with the bytes each moves;

and, in ``traces``, what smp's partitioner reads (smp.partitioning.trace.recording: calls,
FLOPs, input and output bytes), so a plan is priced on the partition smp will make.

Why not a formula: the literature's per-layer activation formula (Korthikanti et al. 2022,
34·sbh + 5·as²b) describes Megatron's layer; a user's module saves what its own code saves (SDPA
saves no s² terms; SwiGLU saves three ffn-wide tensors; HF's Llama saves its rotary tables), and
measuring it costs one fake forward. The formula is a check: an eager Megatron-style GPT-3 layer
traces to it (smp.planner.literature).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import sdpa_flop_count

from smp.partitioning.trace import ModuleTrace, formula_flops, recording
from smp.tp.functional import observing

__all__ = ["ModelProfile", "ModuleProfile", "profile_model"]


@dataclasses.dataclass
class ModuleProfile:
    """What one module holds and runs (own: not counting its submodules). ``activation_bytes``:
    the storages it saved first (one that several modules save counts at the first); ``ops``:
    (matmul FLOPs, bytes read and written, dtype name) per ATen op its own code ran."""

    parameter_bytes: int = 0
    parameter_tensors: int = 0
    largest_parameter: int = 0  # bytes of its largest parameter
    activation_bytes: int = 0
    ops: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    # tensor-parallel primitives its own code ran, (name, bytes of the whole buffer)
    collectives: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ModelProfile:
    """:func:`profile_model`'s result: per module path ("" is the root), own bytes and ops; each
    saved storage's bytes with the modules that saved it (a stage holding any of them holds it);
    the partitioner's traces."""

    modules: dict[str, ModuleProfile]
    saved: list[tuple[int, frozenset[str]]] = dataclasses.field(default_factory=list)
    traces: dict[str, ModuleTrace] = dataclasses.field(default_factory=dict)
    # Values between modules: (bytes, producer, the value's number among the producer's,
    # consumer) (Note [Values between modules])
    flows: list[tuple[int, str, int, str]] = dataclasses.field(default_factory=list)
    # How the repeated blocks were traced (Note [Sampled blocks]): "" when all were.
    sampled: str = dataclasses.field(default="", compare=False)
    # sums already asked for: a search asks for the same blocks' bytes per candidate
    _sums: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def _within(self, paths: str | Sequence[str]) -> Callable[[str], bool]:
        paths = [paths] if isinstance(paths, str) else list(paths)
        if "" in paths:
            return lambda name: True
        prefixes = tuple(f"{p}." for p in paths)
        exact = set(paths)
        return lambda name: name in exact or name.startswith(prefixes)

    def _sum(self, kind: str, paths: str | Sequence[str]) -> int:
        key = (kind, paths if isinstance(paths, str) else tuple(paths))
        if key not in self._sums:
            inside = self._within(paths)
            if kind == "parameters":
                total = sum(r.parameter_bytes for name, r in self.modules.items() if inside(name))
            else:
                total = sum(n for n, owners in self.saved if any(map(inside, owners)))
            self._sums[key] = total
        return self._sums[key]

    def parameter_bytes(self, paths: str | Sequence[str] = "") -> int:
        """Parameters of the subtrees of ``paths`` (the whole model by default)."""
        return self._sum("parameters", paths)

    def stage_totals(self, assignment: Mapping[str, int], num_stages: int) -> list[dict[str, Any]]:
        """Per stage of a partition (``assignment``: module path -> stage, as
        ``PartitionPlan.assignment``), what its modules' own code holds and runs: parameter
        bytes, saved activation bytes (a storage saved on several stages counts on each), their
        ops (a ``Counter``: each distinct op and how often it runs; repeated blocks run the
        same ops), their tensor-parallel collectives (a ``Counter`` too), and for the host's
        costs the parameter tensors and the module calls per forward."""
        totals = [
            {
                "parameter_bytes": 0,
                "parameter_tensors": 0,
                "largest_parameter": 0,
                "calls": 0,
                "activation_bytes": 0,
                "ops": Counter(),
                "collectives": Counter(),
            }
            for _ in range(num_stages)
        ]
        for name, record in self.modules.items():
            stage = assignment.get(name, 0)
            totals[stage]["parameter_bytes"] += record.parameter_bytes
            totals[stage]["parameter_tensors"] += record.parameter_tensors
            totals[stage]["largest_parameter"] = max(
                totals[stage]["largest_parameter"], record.largest_parameter
            )
            trace = self.traces.get(name)
            totals[stage]["calls"] += trace.calls if trace is not None else 0
            totals[stage]["ops"].update(record.ops)
            totals[stage]["collectives"].update(record.collectives)
        for nbytes, owners in self.saved:
            for stage in {assignment.get(owner, 0) for owner in owners}:
                totals[stage]["activation_bytes"] += nbytes
        return totals

    def ops(self, paths: str | Sequence[str] = "") -> Counter:
        """The ops the subtrees of ``paths`` run, each distinct one with its count."""
        key = ("ops", paths if isinstance(paths, str) else tuple(paths))
        if key not in self._sums:
            inside = self._within(paths)
            self._sums[key] = Counter(
                op for name, r in self.modules.items() if inside(name) for op in r.ops
            )
        return self._sums[key]

    def calls(self, paths: str | Sequence[str] = "") -> int:
        """Module calls per traced forward in the subtrees of ``paths``."""
        key = ("calls", paths if isinstance(paths, str) else tuple(paths))
        if key not in self._sums:
            inside = self._within(paths)
            self._sums[key] = sum(t.calls for name, t in self.traces.items() if inside(name))
        return self._sums[key]

    def message_bytes(self, assignment: Mapping[str, int], num_stages: int) -> list[int]:
        """Per stage of a partition, the bytes of the values that cross between its modules and
        another stage's, forward and (for those that need one) their gradients back, and the
        outputs of its modules' calls from other stages, per traced forward (Note [Values
        between modules])."""
        out = [0] * num_stages
        sent = set()  # a value goes to a stage once, however many of its modules read it
        for nbytes, producer, number, consumer in self.flows:
            a, b = assignment.get(producer, 0), assignment.get(consumer, 0)
            if a != b and (producer, number, b) not in sent:
                sent.add((producer, number, b))
                out[a] += nbytes
                out[b] += nbytes
        # A call from another stage keeps its outputs on its own until its backward begins,
        # whether another stage reads them or not (the head's logits, which the loss reads on
        # the head's stage).
        for name, trace in self.traces.items():
            stage = assignment.get(name, 0)
            for caller, calls in trace.callers.items():
                if assignment.get(caller or "", 0) != stage:
                    out[stage] += calls.output_bytes
        return out

    def activation_bytes(self, paths: str | Sequence[str] = "") -> int:
        """What the subtrees of ``paths`` save for their backward per traced forward: every
        storage one of their modules saved, once (a stage of those modules holds this)."""
        return self._sum("activations", paths)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _below(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is inside module ``ancestor`` ("" is the root)."""
    return path != ancestor and path.startswith(f"{ancestor}." if ancestor else "")


# Note [Values between modules]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What a pipeline sends is what flows between its stages' modules, not every argument and
# output of a call that crosses: smp's runtime passes a value between calls served on one stage
# by reference, sends a call's outputs only where they are read, and runs an op on a future
# where its value is (design.md §4.3, §4.6). So the trace follows values: every storage an op
# makes has a producer, the module whose own code ran the op; an op reading a storage that
# another module made is a flow from that module to this one, once per storage and consumer,
# with its bytes (twice, for a value that needs a gradient, which comes back the same way). A
# value goes to a stage once, however many of its modules read it.
# The model's inputs are the root's. An ancestor's code running on a descendant's value (a
# residual add in a parent, a loss on the head's logits) runs where that value is: the op's
# place is the descendant, and what it makes is the descendant's. A stage's messages are the
# flows between its modules and another stage's.


class _Recorder:
    """Module hooks keeping the innermost running module, and the saved-tensor pack hook."""

    def __init__(self, model: nn.Module, exclude: set[StorageWeakRef]):
        self.stack: list[str] = []
        # A module registered under two names (T5's shared embedding) is known by its first,
        # as named_modules() and the partitioner name it.
        self.names = {id(m): name for name, m in model.named_modules()}
        self.records: dict[str, ModuleProfile] = {
            name: ModuleProfile() for name, _ in model.named_modules()
        }
        self.exclude = exclude
        self.saved: dict[StorageWeakRef, tuple[int, set[str]]] = {}
        # Note [Values between modules]: each storage's producer and its number among the
        # producer's storages, and each flow of one into a module that did not make it,
        # (storage, consumer) -> (bytes, producer, number).
        self.producers: dict[StorageWeakRef, tuple[str, int]] = {}
        self.made: dict[str, int] = {}
        self.flows: dict[tuple[StorageWeakRef, str], tuple[int, str, int]] = {}
        # Every saved tensor, held until the trace ends: a storage freed mid-forward (a dead
        # branch's graph) could otherwise be replaced by a new one at its address, which its
        # weak reference would take for it.
        self.alive: list[torch.Tensor] = []
        self.handles = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module, args) -> None:
        self.stack.append(self.names[id(module)])

    def _leave(self, module, args, output) -> None:
        self.stack.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key in self.exclude:
            return tensor
        owner = self.stack[-1] if self.stack else ""
        self.alive.append(tensor)
        if key not in self.saved:
            self.saved[key] = (storage.nbytes(), set())
            self.records[owner].activation_bytes += storage.nbytes()
        self.saved[key][1].add(owner)
        made = self.producers.get(key)
        if made is not None and _below(made[0], owner):
            # An ancestor's op on a descendant's value may run where the value is (Note [Values
            # between modules]): a stage holding either module holds what it saved.
            self.saved[key][1].add(made[0])
        return tensor

    def add_inputs(self, tensors) -> None:
        """The model's inputs: made by the caller's code, which runs with the root module."""
        for t in tensors:
            self._produced(StorageWeakRef(t.untyped_storage()), "", t)

    def _produced(self, key: StorageWeakRef, place: str, t: torch.Tensor) -> None:
        if key not in self.producers:
            self.producers[key] = (place, self.made.get(place, 0))
            self.made[place] = self.made.get(place, 0) + 1
            self.alive.append(t)

    def add_flow(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Note [Values between modules], for one op: where it runs, what it reads from other
        modules, what it makes."""
        here = self.stack[-1] if self.stack else ""
        keys = []
        place = here
        for t in inputs:
            key = StorageWeakRef(t.untyped_storage())
            made = self.producers.get(key)
            if key in self.exclude or made is None:
                continue
            keys.append((key, t, made))
            if place == here and _below(made[0], here):
                place = made[0]  # an ancestor's code on a descendant's value runs there
        for key, t, (producer, number) in keys:
            if producer != place and (key, place) not in self.flows:
                grad = 2 if t.requires_grad else 1  # its gradient comes back the same way
                self.flows[key, place] = (grad * t.untyped_storage().nbytes(), producer, number)
        for t in outputs:
            self._produced(StorageWeakRef(t.untyped_storage()), place, t)

    def add_collective(self, name: str, nbytes: int) -> None:
        self.records[self.stack[-1] if self.stack else ""].collectives.append((name, nbytes))

    def add_op(self, flops: float, nbytes: int, dtype: str) -> None:
        self.records[self.stack[-1] if self.stack else ""].ops.append((flops, nbytes, dtype))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# The dtype names a device's peak FLOP/s are given under (smp.planner.cluster.Device).
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class _OpCosts(TorchDispatchMode):
    """Adds each ATen op to the module running it: its FLOPs where torch's flop counter has a
    formula (matmuls, convolutions, attention), the bytes of its tensor inputs and outputs (the
    memory it moves), the dtype of its first floating input. Views move nothing and count none."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        if func._overloadpacket is _CPU_ATTENTION:  # torch's counter has the CUDA kernels only
            flops = float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
        else:
            flops = formula_flops(func, args, kwargs, out) or 0.0  # else priced by its bytes
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        tensors = inputs + outputs
        dtype = next((DTYPE_NAMES[t.dtype] for t in tensors if t.dtype in DTYPE_NAMES), "fp32")
        self.recorder.add_op(flops, sum(_bytes(t) for t in tensors), dtype)
        self.recorder.add_flow(inputs, outputs)
        return out


def _fake_like(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor standing for ``t``: made in the mode for a meta tensor (no memory), its
    fake copy otherwise."""
    if t.is_meta:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return mode.from_tensor(t.detach().cpu() if t.device.type != "cpu" else t.detach())


def _fake_state(model: nn.Module, mode: FakeTensorMode) -> dict[str, torch.Tensor]:
    """Fake copies of the model's parameters (requiring grad, as they do) and buffers, by name."""
    state: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}  # one fake per tensor: tied names share it
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            made[id(p)] = nn.Parameter(_fake_like(mode, p), requires_grad=p.requires_grad)
        state[name] = made[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in made:
            made[id(b)] = _fake_like(mode, b)
        state[name] = made[id(b)]
    return state


# Note [Kernels of the target device]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# What an op saves for backward depends on the kernel that runs it. Tracing runs on fake CPU
# tensors (a CPU-only torch cannot run ops on fake CUDA tensors, and on the meta device
# scaled_dot_product_attention takes the math path, saving the s × s attention matrix that
# flash kernels never hold). Two CPU kernels save what their CUDA ones do not:
# - dropout: CUDA runs the fused native_dropout, saving a 1-byte mask; the CPU's composite
#   dropout saves a noise tensor of the input's dtype;
# - scaled_dot_product_attention with dropout: CUDA's flash and memory-efficient kernels save
#   the inputs, the output, the log-sum-exp and a seed; the CPU falls back to the math path.
# For ``device="cuda"`` the trace runs those ops as the CUDA kernels would save: native_dropout
# (the op CUDA's dropout calls), and attention without its dropout (the same saved tensors as
# the kernel with it, up to the seed's few bytes). Outputs keep their shapes and dtypes.


class _CudaKernels(torch.overrides.TorchFunctionMode):
    """Note [Kernels of the target device]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.functional.dropout, torch.dropout):
            x, p, training = _dropout_args(func, args, kwargs)
            if training and 0 < p < 1 and x.requires_grad:
                return torch.native_dropout(x, p, True)[0]
        elif func is torch.nn.functional.scaled_dot_product_attention and len(args) > 3:
            # Positional options by name, then no dropout.
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            kwargs = {**dict(zip(names, args[3:])), **kwargs, "dropout_p": 0.0}
            args = args[:3]
        elif func is torch.nn.functional.scaled_dot_product_attention:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


def _dropout_args(func, args, kwargs) -> tuple[torch.Tensor, float, bool]:
    if func is torch.nn.functional.dropout:
        names = ("input", "p", "training", "inplace")
        defaults = {"p": 0.5, "training": True}
    else:  # torch.dropout(input, p, train)
        names = ("input", "p", "train")
        defaults = {}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    training = bound.get("training", bound.get("train", True))
    return bound["input"], float(bound["p"]), bool(training)


def profile_model(
    model: nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    run: Callable[..., Any] | None = None,
    device: str = "cpu",
    sample: bool = False,
) -> ModelProfile:
    """Traces one training forward of ``model(*args, **kwargs)`` under fake tensors and returns
    each module's own parameters, saved activations, outputs and ops (module docstring).

    The model may be on the meta device or a real one; nothing is allocated, run or changed:
    parameters, buffers and inputs are fake CPU tensors swapped in for the call
    (``torch.func.functional_call``), the training mode is put back, and the random generator's
    state is restored. ``run(model, *args, **kwargs)``, when given, is called instead of the
    model, for a loss computed outside it. ``device``: the kernels whose saved tensors count,
    "cpu" or "cuda" (Note [Kernels of the target device]). ``sample``: trace a few of the
    largest ``nn.ModuleList``'s blocks and extend to the rest where the evidence allows (Note
    [Sampled blocks]; ``profile.sampled`` says what was traced), else trace every block.

    Raises:
        ValueError: an unknown ``device``.
        RuntimeError: the forward cannot run on fake tensors (it reads a tensor's values: a
            data-dependent branch); torch's error names the op.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"smp: profile_model's device is 'cpu' or 'cuda', not {device!r}")

    def trace() -> ModelProfile:
        return _trace(model, args, dict(kwargs or {}), run, device)

    if not sample:
        return trace()
    found = largest_module_list(model)
    why = "no nn.ModuleList of 8 or more blocks"
    if found is not None and len(found[1]) >= 8:
        prefix, blocks = found
        why = _sampled(model, prefix, blocks, trace)
        if isinstance(why, ModelProfile):
            return why
    profile = trace()
    profile.sampled = f"every block traced: {why}"
    return profile


def largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's largest ``nn.ModuleList`` (its transformer blocks) with its path, the first
    in ``named_modules`` order among equals; None without one."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > (len(best[1]) if best else 0):
            best = (path, module)
    return best


def _sampled(
    model: nn.Module, prefix: str, blocks: nn.ModuleList, trace: Callable[[], ModelProfile]
) -> ModelProfile | str:
    """The profile from a few of ``blocks`` traced (Note [Sampled blocks]), or why not."""
    n = len(blocks)
    where = prefix or "the model"
    if len({id(b) for b in blocks}) != n:
        return f"{where} holds one module more than once"
    found = _periodic(_signatures(list(blocks)))
    if found is None:
        return f"the blocks of {where} do not repeat with a period of 4 or less"
    start, period = found
    fewer, more = start + 3 * period, start + 4 * period
    with _cut(blocks, fewer):
        small = trace()
    with _cut(blocks, more):
        large = trace()
        traced_names = [name for name, _ in model.named_modules()]
    check = _extend(small, traced_names, prefix, fewer, more, period)
    if not _same(check, large):
        return (
            f"the profile of {fewer} blocks of {where}, extended by one period, differs from "
            f"the trace of {more}"
        )
    names = [name for name, _ in model.named_modules()]
    profile = _extend(large, names, prefix, more, n, period)
    for record in profile.modules.values():
        record.parameter_bytes = record.parameter_tensors = record.largest_parameter = 0
    _count_parameters(model, profile.modules)
    profile.sampled = f"{more} of {n} blocks of {where} traced (period {period} from block {start})"
    return profile


def _same(a: ModelProfile, b: ModelProfile) -> bool:
    """The same records, saved storages and traces (less the traces' wall times)."""

    def untimed(traces: Mapping[str, ModuleTrace]) -> dict[str, ModuleTrace]:
        return {name: dataclasses.replace(t, seconds=0.0) for name, t in traces.items()}

    return (
        a.modules == b.modules
        and Counter(a.saved) == Counter(b.saved)
        and Counter(a.flows) == Counter(b.flows)
        and untimed(a.traces) == untimed(b.traces)
    )


def _count_parameters(model: nn.Module, records: Mapping[str, ModuleProfile]) -> None:
    """Adds each parameter's bytes to the first module that registers it."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                records[name].parameter_bytes += _bytes(p)
                records[name].parameter_tensors += 1
                records[name].largest_parameter = max(records[name].largest_parameter, _bytes(p))


def _trace(model, args, kwargs, run, device) -> ModelProfile:
    # Real tensors a ``run`` closes over (targets, masks) become fake as they are used.
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(value):
        if isinstance(value, torch.Tensor):
            return _fake_like(mode, value)
        if isinstance(value, Mapping):
            return type(value)({k: fake(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(fake(v) for v in value)
        return value

    was_training = model.training
    state = _fake_state(model, mode)
    f_args, f_kwargs = fake(tuple(args)), fake(kwargs)
    exclude = {StorageWeakRef(t.untyped_storage()) for t in state.values()}
    recorder = _Recorder(model, exclude)
    recorder.add_inputs(t for t in tree_leaves((f_args, f_kwargs)) if isinstance(t, torch.Tensor))
    runner = _Run(model, run)
    state = {f"model.{name}": value for name, value in state.items()}
    rng = torch.random.get_rng_state()
    try:
        model.train()
        with (
            mode,
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t),
            _CudaKernels() if device == "cuda" else contextlib.nullcontext(),
            recording(model) as traces,
            observing(recorder.add_collective),
            _OpCosts(recorder),
        ):
            torch.func.functional_call(runner, state, f_args, f_kwargs, tie_weights=True)
    finally:
        recorder.remove()
        model.train(was_training)
        torch.random.set_rng_state(rng)
    _count_parameters(model, recorder.records)
    saved = [(nbytes, frozenset(owners)) for nbytes, owners in recorder.saved.values()]
    flows = [
        (nbytes, producer, number, consumer)
        for (_, consumer), (nbytes, producer, number) in recorder.flows.items()
    ]
    recorder.alive.clear()
    return ModelProfile(recorder.records, saved, traces, flows)


class _Run(nn.Module):
    """Calls ``run(model, ...)`` (or the model) as a module, for ``functional_call``."""

    def __init__(self, model: nn.Module, run: Callable[..., Any] | None):
        super().__init__()
        self.model = model
        self.run = run

    def forward(self, *args, **kwargs):
        if self.run is None:
            return self.model(*args, **kwargs)
        return self.run(self.model, *args, **kwargs)


# ---- repeated blocks: trace a few, extend to all ------------------------------------------------

# Note [Sampled blocks]
# ~~~~~~~~~~~~~~~~~~~~
# A transformer's blocks run the same code on the same shapes: tracing 96 of them costs 96 times
# one, and a search traces the model once per TP degree. ``profile_model(sample=True)`` traces the
# model with its largest ``nn.ModuleList`` cut to its first blocks and extends the profile to the
# whole list. It does so only on evidence:
# - the blocks' signatures (their submodules' types, parameter and buffer shapes, dtypes and
#   public attributes of plain values, less one that holds each block's own index, HF's
#   ``layer_idx``) are periodic from some start s with some period p (one or more distinct
#   leading blocks, alternating local and global attention, ...): blocks s + kp + i share a
#   signature for every k;
# - the list holds distinct module objects, and N - s is a whole number of periods;
# - the extension rule reproduces a real trace: the profile of s + 3p blocks, extended by one
#   period, equals the profile traced with s + 4p blocks exactly (every module's ops, saved
#   storages and their owners, the values between modules, the partitioner's traces). Only then
#   is the s + 4p profile extended to N.
# The rule: a block past the trace is its period's last traced twin (its records, its saved
# storages, its traces, renamed, calls renumbered); a storage saved only by the last two traced
# periods (a tensor passed between blocks) repeats with its owners shifted; one saved by blocks
# of every period (a mask, a position bias) gains the new blocks as owners; one saved by the last
# period and modules after the list (the final norm's input) moves to the list's new end.
# What none of this sees is code outside the blocks that treats block i differently from its twin
# (``if i == 50``); ``sample=False`` traces every block.

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _plain(value: Any) -> Any:
    """A comparable form of an attribute's value: plain values as they are, containers of them
    and ``functools.partial`` by content, anything else by identity (shared by every block, as
    a config is, or not)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if isinstance(value, Mapping):
        return ("map", tuple((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, functools.partial):  # HF's activations: partial(gelu, approximate=)
        return ("partial", id(value.func), _plain(value.args), _plain(value.keywords))
    return ("object", id(value))


def _signatures(blocks: Sequence[nn.Module]) -> list[tuple]:
    """Each block's signature: per submodule its type, public plain attributes (less those that
    hold the block's own index in every block, HF's ``layer_idx``), parameters and buffers."""
    raw = []
    for block in blocks:
        parts = []
        for name, module in block.named_modules():
            attrs = {key: value for key, value in vars(module).items() if not key.startswith("_")}
            tensors = tuple(
                (kind, key, tuple(t.shape), t.dtype, t.requires_grad)
                for kind, items in (("p", module._parameters), ("b", module._buffers))
                for key, t in items.items()
                if t is not None
            )
            parts.append((name, type(module).__qualname__, attrs, tensors))
        raw.append(parts)
    counted = [
        {
            (name, key)
            for name, _, attrs, _ in parts
            for key, v in attrs.items()
            if type(v) is int and v == i
        }
        for i, parts in enumerate(raw)
    ]
    index_keys = set.intersection(*counted) if counted else set()
    return [
        tuple(
            (
                name,
                kind,
                tuple(
                    (key, _plain(value))
                    for key, value in sorted(attrs.items())
                    if (name, key) not in index_keys
                ),
                tensors,
            )
            for name, kind, attrs, tensors in parts
        )
        for parts in raw
    ]


def _periodic(signatures: Sequence[tuple]) -> tuple[int, int] | None:
    """(s, p): the smallest start and period from which the blocks' signatures repeat, with
    s + 4p blocks worth tracing (half the list at most) and N - s whole periods; else None."""
    n = len(signatures)
    for period in range(1, 5):
        for start in range(0, n):
            if start + 4 * period > n // 2:
                break
            if (n - start) % period == 0 and all(
                signatures[i] == signatures[i + period] for i in range(start, n - period)
            ):
                return start, period
    return None


@contextlib.contextmanager
def _cut(blocks: nn.ModuleList, keep: int):
    """The list with its first ``keep`` entries only, for the duration."""
    whole = blocks._modules
    blocks._modules = dict(list(whole.items())[:keep])
    try:
        yield
    finally:
        blocks._modules = whole


class _Blocks:
    """Paths inside the list ``prefix`` (entries 0..N-1): which block, and renamed."""

    def __init__(self, prefix: str):
        self.prefix = f"{prefix}." if prefix else ""

    def index(self, path: str | None) -> int | None:
        if path is None or not path.startswith(self.prefix):
            return None
        head = path[len(self.prefix) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def shift(self, path: str | None, by: int) -> str | None:
        index = self.index(path)
        if index is None or by == 0:
            return path
        rest = path[len(self.prefix) + len(str(index)) :]
        return f"{self.prefix}{index + by}{rest}"


def _extend(
    profile: ModelProfile, names: Sequence[str], prefix: str, traced: int, total: int, period: int
) -> ModelProfile:
    """``profile`` (traced with the list at ``prefix`` cut to ``traced`` blocks) extended to
    ``total`` blocks by Note [Sampled blocks]'s rule; ``names``: the extended model's module
    paths in ``named_modules`` order."""
    blocks = _Blocks(prefix)
    extra = (total - traced) // period
    last = set(range(traced - period, traced))  # the last traced period
    earlier = traced - 2 * period  # before the last two periods

    def twin(index: int) -> tuple[int, int]:  # (traced twin, periods later)
        k = (index - (traced - period)) // period
        return index - k * period, k

    records: dict[str, ModuleProfile] = {}
    for name in names:
        index = blocks.index(name)
        if index is not None and index >= traced:
            origin, _ = twin(index)
            records[name] = dataclasses.replace(profile.modules[blocks.shift(name, origin - index)])
        else:
            records[name] = dataclasses.replace(profile.modules[name])
        records[name].ops = list(records[name].ops)
        records[name].collectives = list(records[name].collectives)

    saved: list[tuple[int, frozenset[str]]] = []
    for nbytes, owners in profile.saved:
        indices = {blocks.index(o) for o in owners} - {None}
        outside = any(blocks.index(o) is None for o in owners)
        if not indices & last:
            saved.append((nbytes, owners))
        elif min(indices) < earlier:
            # Saved by blocks of every period (a mask): the new blocks save it too.
            grown = set(owners)
            for k in range(1, extra + 1):
                grown |= {blocks.shift(o, k * period) for o in owners if blocks.index(o) in last}
            saved.append((nbytes, frozenset(grown)))
        elif not outside:
            # Between the last two periods' blocks only: each later period has its own.
            for k in range(extra + 1):
                saved.append((nbytes, frozenset(blocks.shift(o, k * period) for o in owners)))
        else:
            # The last period's and modules' after the list (the final norm's input): at the
            # list's new end.
            saved.append((nbytes, frozenset(blocks.shift(o, extra * period) for o in owners)))

    flows: list[tuple[int, str, int, str]] = []
    for nbytes, producer, number, consumer in profile.flows:
        made, read = blocks.index(producer), blocks.index(consumer)
        if made not in last and read not in last:
            flows.append((nbytes, producer, number, consumer))
        elif made is not None and read is not None and min(made, read) >= earlier:
            # Between the last two periods' blocks (the hidden state): every later period too.
            for k in range(extra + 1):
                shift = k * period
                flows.append(
                    (nbytes, blocks.shift(producer, shift), number, blocks.shift(consumer, shift))
                )
        elif made is None or made not in last:
            # From before the list or an early block (a mask, a position bias) into the last
            # period: into every new block too.
            for k in range(extra + 1):
                flows.append((nbytes, producer, number, blocks.shift(consumer, k * period)))
        elif read is None:
            # From the last period out of the list (into the final norm): from the new end.
            flows.append((nbytes, blocks.shift(producer, extra * period), number, consumer))
        else:  # from the last period into an early block: every new block's too
            for k in range(extra + 1):
                flows.append((nbytes, blocks.shift(producer, k * period), number, consumer))

    traces: dict[str, ModuleTrace] = {}
    firsts = [
        profile.traces[n].first_call
        for n in profile.traces
        if blocks.index(n) in last and profile.traces[n].first_call is not None
    ]
    previous = [
        profile.traces[n].first_call
        for n in profile.traces
        if blocks.index(n) in range(traced - 2 * period, traced - period)
        and profile.traces[n].first_call is not None
    ]
    step = min(firsts) - min(previous)  # module calls per period
    after = max(firsts)

    def renamed(trace: ModuleTrace, by: int, calls_later: int) -> ModuleTrace:
        out = dataclasses.replace(
            trace,
            callers={blocks.shift(c, by): dataclasses.replace(t) for c, t in trace.callers.items()},
        )
        if out.first_call is not None:
            out.first_call += calls_later
        return out

    for name in names:
        index = blocks.index(name)
        if index is not None and index >= traced:
            origin, k = twin(index)
            source = blocks.shift(name, origin - index)
            if source in profile.traces:
                traces[name] = renamed(profile.traces[source], index - origin, k * step)
        elif name in profile.traces:
            trace = profile.traces[name]
            later = trace.first_call is not None and trace.first_call > after and index is None
            traces[name] = renamed(trace, 0, extra * step if later else 0)
    return ModelProfile(records, saved, traces, flows)
