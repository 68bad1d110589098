"""Where modules run: the user's pins and the tracing pass (api.md §6).

**Pins** from ``smp.partition(i)`` contexts and ``smp.set_partition`` are constraints of the
partitioner (smp.partitioning.plan); with ``auto_partition=False`` every unpinned module is
pinned to ``default_partition``.

**Tracing** runs the model's forward once with gradients off and records, for every module, its
first-call order, call count, output bytes and own compute — FLOPs attributed to the innermost
running module (deterministic), or measured time with ``trace_execution_times`` — and, per
caller (the module whose forward makes the call), the calls and the bytes of their arguments
and outputs: what would cross if caller and callee ran on different stages. RNG streams and
buffers are restored afterwards, so training sees the same state as without tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from smp.core.creation import creation_hook
from smp.core.rng import random_streams, set_random_streams
from smp.core.tracing import tracing_pass

__all__ = [
    "partition",
    "set_partition",
    "ModuleTrace",
    "CallTrace",
    "trace_modules",
    "recording",
]

_PIN_ATTR = "_smp_partition"

# ---- manual placement ---------------------------------------------------------------------------

_pin_stack = threading.local()


def _pin(module: nn.Module) -> None:
    stack = getattr(_pin_stack, "indices", None)
    if stack:
        object.__setattr__(module, _PIN_ATTR, stack[-1])


def _check_index(index: Any, what: str) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"{what}: the pipeline stage must be an int >= 0, got {index!r}")
    return index


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside the context are placed on pipeline stage ``index``.

    Nested contexts: the innermost wins. Submodules created by a module's constructor inside the
    context are pinned too, unless an inner context says otherwise.

    Example:
        with smp.partition(0):
            self.embed = nn.Embedding(50000, 1024)
        with smp.partition(1):
            self.head = nn.Linear(1024, 50000)
    """
    _check_index(index, "smp.partition")
    stack = getattr(_pin_stack, "indices", None)
    if stack is None:
        stack = _pin_stack.indices = []
    stack.append(index)
    try:
        with creation_hook(_pin):
            yield
    finally:
        stack.pop()


def set_partition(module: nn.Module, index: int) -> None:
    """Places an existing ``module`` (and its unpinned submodules) on pipeline stage ``index``."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"smp.set_partition takes an nn.Module, got {type(module).__name__}")
    object.__setattr__(module, _PIN_ATTR, _check_index(index, "smp.set_partition"))


def _pin_of(module: nn.Module) -> int | None:
    return module.__dict__.get(_PIN_ATTR)


# ---- tracing ------------------------------------------------------------------------------------


@dataclasses.dataclass
class CallTrace:
    """The calls one caller made to a module during the traced forward (sums over the calls).

    A floating-point tensor is taken to carry a gradient back in backward (an upper bound: masks
    and rotary tables, for instance, take none)."""

    calls: int = 0
    input_bytes: int = 0  # tensors among the arguments (positional and keyword)
    output_bytes: int = 0
    input_grad_bytes: int = 0  # the floating-point ones: gradients that come back in backward
    output_grad_bytes: int = 0


@dataclasses.dataclass
class ModuleTrace:
    """What tracing recorded for one module (own = exclusive of submodules)."""

    first_call: int | None = None  # order of the first call; None if never called
    calls: int = 0
    output_bytes: int = 0  # summed over calls
    flops: float = 0.0  # own FLOPs (elementwise ops count one per output element)
    seconds: float = 0.0  # own wall time (only with execution times)
    input_bytes: int = 0  # tensors among the arguments, summed over calls
    # Per caller: the path of the module whose forward made the calls, None for code outside
    # the model (the step function).
    callers: dict[str | None, CallTrace] = dataclasses.field(default_factory=dict)


def _tensor_bytes(value: Any, floating_only: bool = False) -> int:
    if isinstance(value, torch.Tensor):
        if floating_only and not (value.is_floating_point() or value.is_complex()):
            return 0
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, floating_only) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, floating_only) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(
            _tensor_bytes(getattr(value, f.name), floating_only) for f in dataclasses.fields(value)
        )
    return 0


def _output_numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_output_numel(v) for v in value)
    return 0


def formula_flops(func, args, kwargs, out) -> float | None:
    """An ATen op's FLOPs by torch's flop counter's formula (matmuls, convolutions, the CUDA
    attention kernels); None for an op without one, or an exotic overload the formula does not
    take."""
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return None
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - an exotic overload
        return None


class _FlopAttribution(TorchDispatchMode):
    """Adds every ATen op's FLOPs to the module running it (the top of the tracer's stack)."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:  # views and transposes move no data
            flops = 0
        else:
            flops = formula_flops(func, args, kwargs, out)
            if flops is None:
                flops = _output_numel(out)
        self.tracer.add_flops(flops)
        return out


class _Tracer:
    def __init__(self, module: nn.Module, measure_time: bool):
        self.names = {id(m): name for name, m in module.named_modules()}
        self.records = {id(m): ModuleTrace() for _, m in module.named_modules()}
        self.root_id = id(module)
        self.measure_time = measure_time
        self.stack: list[tuple[int, float, CallTrace]] = []  # (module id, start time, its call)
        self.child_seconds: list[float] = []
        self.order = 0
        self.handles = []
        for _, m in module.named_modules():
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True))

    def add_flops(self, flops: float) -> None:
        key = self.stack[-1][0] if self.stack else self.root_id
        self.records[key].flops += flops

    def _pre(self, module, args, kwargs):
        record = self.records[id(module)]
        if record.first_call is None:
            record.first_call = self.order
            self.order += 1
        record.calls += 1
        caller = self.names[self.stack[-1][0]] if self.stack else None
        call = record.callers.setdefault(caller, CallTrace())
        call.calls += 1
        inputs = (args, kwargs)
        call.input_bytes += _tensor_bytes(inputs)
        call.input_grad_bytes += _tensor_bytes(inputs, floating_only=True)
        record.input_bytes += _tensor_bytes(inputs)
        self.stack.append((id(module), time.perf_counter(), call))
        self.child_seconds.append(0.0)

    def _post(self, module, args, kwargs, output):
        key, start, call = self.stack.pop()
        elapsed = time.perf_counter() - start
        children = self.child_seconds.pop()
        record = self.records[key]
        output_bytes = _tensor_bytes(output)
        record.output_bytes += output_bytes
        call.output_bytes += output_bytes
        call.output_grad_bytes += _tensor_bytes(output, floating_only=True)
        record.seconds += max(0.0, elapsed - children)
        if self.child_seconds:
            self.child_seconds[-1] += elapsed

    def innermost(self) -> str | None:
        return self.names.get(self.stack[-1][0]) if self.stack else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def _preserved_state(module: nn.Module) -> Iterator[None]:
    """Restores the RNG streams and every buffer after the block: tracing must not be seen.

    The TP generators too: rank 0 traces alone, and a draw there that its TP peers do not make
    would give the group different "replicated" dropout masks from then on (and replicated
    parameters that drift apart)."""
    streams = random_streams()
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        set_random_streams(streams)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def trace_modules(
    module: nn.Module,
    run_forward: Callable[[], Any],
    trace_execution_times: bool = False,
    warmup_runs: int = 1,
) -> dict[str, ModuleTrace]:
    """Runs ``run_forward()`` (which calls ``module``) once with gradients off and records every
    module of ``module``.

    Args:
        module: the model.
        run_forward: calls the model on an example microbatch.
        trace_execution_times: measure own wall time per module (after ``warmup_runs`` untimed
            runs) instead of counting FLOPs.

    Returns:
        {module path: ModuleTrace}; the root's path is "".

    Raises:
        RuntimeError: the forward failed; the message names the module it failed in.
    """
    with _preserved_state(module), torch.no_grad(), tracing_pass():
        return _traced(module, run_forward, trace_execution_times, warmup_runs)


@contextlib.contextmanager
def recording(module: nn.Module) -> Iterator[dict[str, ModuleTrace]]:
    """Records, as :func:`trace_modules` does with FLOPs, every module of ``module`` over the
    forwards the block runs itself (the planner's, on fake tensors): the dict it yields is filled
    when the block ends. Nothing is run, and no state is saved or restored, here."""
    records: dict[str, ModuleTrace] = {}
    tracer = _Tracer(module, False)
    try:
        with _FlopAttribution(tracer):
            yield records
    finally:
        tracer.remove()
        records.update({tracer.names[key]: record for key, record in tracer.records.items()})


def _traced(module, run_forward, trace_execution_times: bool, warmup_runs: int) -> dict:
    if trace_execution_times:
        for _ in range(warmup_runs):
            _run_named(run_forward, None)
    tracer = _Tracer(module, trace_execution_times)
    try:
        if trace_execution_times:
            _run_named(run_forward, tracer)
        else:
            with _FlopAttribution(tracer):
                _run_named(run_forward, tracer)
    finally:
        tracer.remove()
    return {tracer.names[key]: record for key, record in tracer.records.items()}


def _run_named(run_forward: Callable[[], Any], tracer: _Tracer | None) -> None:
    try:
        run_forward()
    except Exception as exc:
        where = tracer.innermost() if tracer else None
        location = f"in module '{where}' " if where else ""
        raise RuntimeError(
            f"smp: tracing the model failed {location}({type(exc).__name__}: {exc})"
        ) from exc
