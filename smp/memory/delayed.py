"""Delayed parameter initialisation (``smp.delay_param_initialization``; design.md §7.4).

Inside the context every parameter a module registers becomes a meta tensor of its shape, and
what the model's constructor then does to it is recorded: its value at registration (nothing
for a fresh ``torch.empty``, a constant, or else a copy), then every in-place operation on it or
on a view of it (``nn.init`` functions, Hugging Face's ``_init_weights``), with the view's
geometry and, for a random operation, the CPU generator's state before it. A random operation
also runs on a scratch tensor of the same geometry, so the generator moves on exactly as it
would have: every later draw of the constructor (other parameters, buffers, the user's own)
is what eager construction draws. Buffers and every other tensor stay real.

:func:`materialize` replays a parameter's record on a fresh tensor with the recorded generator
states (the generator's own state is restored after): the values eager construction would
have given for the same seed, bit for bit, computed only where the parameter is needed — one
parameter at a time, only for the parameters a rank owns after the partition.

What cannot be replayed is reported when the parameter is materialised, naming it: an
initialisation that copies a tensor computed from other meta tensors (``nn.init.orthogonal_``,
for one), since only operations on the parameter itself are recorded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from smp.core import tree
from smp.core.shards import shard_tensor

__all__ = ["delay_param_initialization", "materialize", "Record", "Derived"]

aten = torch.ops.aten
_RANDOM = {
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.bernoulli_.Tensor,
    aten.random_.default,
    getattr(aten.random_, "from"),  # a Python keyword
    aten.random_.to,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
}
_PROGRAM = "_smp_delayed"  # the Record on a delayed parameter (meta, then its placeholder)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Record:
    """How one delayed parameter gets its values: its geometry, its value at registration and
    the in-place operations applied to it since, in order."""

    def __init__(self, param: torch.Tensor, initial: Any):
        self.shape, self.stride = tuple(param.shape), tuple(param.stride())
        self.offset, self.dtype = param.storage_offset(), param.dtype
        self.numel = param.untyped_storage().nbytes() // param.element_size()
        self.initial = initial  # None (uninitialised), ("fill", value) or ("copy", tensor)
        self.steps: list[tuple] = []  # (op, size, stride, offset, args, kwargs, rng state)
        self.error: str | None = None
        self.name = "a parameter"

    def replay(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """The parameter's values, computed now (the CPU generator is left as it was), in
        ``base`` (a flat tensor of this record's storage size) if given."""
        if self.error is not None:
            raise RuntimeError(
                f"smp delayed parameter initialisation: {self.name} cannot be initialised "
                f"again: {self.error}; create the model without smp.delay_param_initialization"
            )
        base = torch.zeros(self.numel, dtype=self.dtype) if base is None else base.zero_()
        if self.initial is not None:
            kind, value = self.initial
            target = base.as_strided(self.shape, self.stride, self.offset)
            target.fill_(value) if kind == "fill" else target.copy_(value)
        saved = torch.get_rng_state()
        try:
            for op, size, stride, offset, args, kwargs, rng in self.steps:
                if rng is not None:
                    torch.set_rng_state(rng)
                op(base.as_strided(size, stride, offset), *args, **kwargs)
        finally:
            torch.set_rng_state(saved)
        return base.as_strided(self.shape, self.stride, self.offset)


class _Recorder(TorchDispatchMode):
    """Records the in-place operations on delayed parameters (by their meta storage), and
    which real storages are fresh ``torch.empty`` ones not written yet."""

    def __init__(self):
        super().__init__()
        self.records: dict[int, Record] = {}  # meta storage -> its parameter's record
        # Real storages from torch.empty not written since, by address, each with a weak
        # reference to its storage: an address a freed storage leaves may be reused by the
        # next one (a torch.ones right after a temporary torch.empty), which is not fresh.
        self.fresh: dict[int, weakref.ref] = {}
        self.buffer: torch.Tensor | None = None

    def is_fresh(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage came from ``torch.empty`` and was not written since."""
        ref = self.fresh.get(_storage_key(t))
        return ref is not None and ref() is not None  # alive: the address is still its

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A real tensor of ``like``'s geometry for a random operation to run on (one buffer,
        grown as needed: a fresh allocation per parameter left freed memory that a process
        with one thread did not give back, gigabytes for a 300 M model)."""
        span = 1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride()) if n > 0)
        span = span if like.numel() else 0
        if self.buffer is None or self.buffer.dtype != like.dtype or self.buffer.numel() < span:
            self.buffer = None
            self.buffer = torch.empty(max(span, 1), dtype=like.dtype)
        return self.buffer.as_strided(like.shape, like.stride())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        target = written[0] if written else None
        if target is not None and target.is_meta and _storage_key(target) in self.records:
            self._record(self.records[_storage_key(target)], func, target, args, kwargs)
        out = func(*args, **kwargs)
        for t in written:
            if not t.is_meta:
                self.fresh.pop(_storage_key(t), None)
        empty = func in (aten.empty.memory_format, aten.empty_strided.default)
        if empty and isinstance(out, torch.Tensor) and not out.is_meta:
            self.fresh[_storage_key(out)] = weakref.ref(out.untyped_storage())
        return out

    def _record(self, record: Record, func, target: torch.Tensor, args, kwargs) -> None:
        rest = args[1:]
        for t in tree.tensors((rest, kwargs)):
            if t.is_meta:
                record.error = (
                    f"its initialisation runs {func} with a tensor computed on the meta device "
                    "(only operations on the parameter itself are recorded)"
                )
                return
        rng = None
        if func in _RANDOM:  # move the generator on exactly as the eager operation would
            rng = torch.get_rng_state()
            func(self.scratch(target), *rest, **kwargs)  # (the mode is off inside its own handler)
        rest = tree.map_tensors(lambda t: t.detach().clone(), rest)
        kwargs = tree.map_tensors(lambda t: t.detach().clone(), kwargs)
        geometry = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        record.steps.append((func, *geometry, rest, kwargs, rng))


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its mutable arguments)."""
    out = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


_local = threading.local()
_original_register = nn.Module.register_parameter


def _register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    recorder: _Recorder | None = getattr(_local, "recorder", None)
    if recorder is None or param is None or getattr(param, _PROGRAM, None) is not None:
        return _original_register(self, name, param)
    if param.is_meta or recorder.is_fresh(param) or param.numel() == 0:
        initial = None
    else:
        flat = param.detach().reshape(-1)
        first = flat[0]
        constant = bool((flat == first).all()) or bool(flat.isnan().all())
        initial = ("fill", first.item()) if constant else ("copy", param.detach().clone())
    meta = nn.Parameter(
        torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta"),
        requires_grad=param.requires_grad,
    )
    meta.__dict__.update(param.__dict__)
    record = Record(meta, initial)
    setattr(meta, _PROGRAM, record)
    recorder.records[_storage_key(meta)] = record
    return _original_register(self, name, meta)


# torch.nn.init functions that return at once for a meta tensor (nothing drawn: the values and
# every later draw would differ from eager construction): run on a scratch tensor instead, and
# recorded as one step.
_SKIPPING_META = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
_init_originals = {name: getattr(nn.init, name) for name in _SKIPPING_META}


def _recorded_init(name: str):
    original = _init_originals[name]

    def init(tensor, *args, **kwargs):
        recorder: _Recorder | None = getattr(_local, "recorder", None)
        record = None
        if recorder is not None and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            record = recorder.records.get(_storage_key(tensor))
        if record is None:
            return original(tensor, *args, **kwargs)
        rng = torch.get_rng_state()
        original(recorder.scratch(tensor), *args, **kwargs)  # moves the generator on as eagerly
        geometry = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        record.steps.append((original, *geometry, args, kwargs, rng))
        return tensor

    init.__name__ = name
    return init


_init_patches = {name: _recorded_init(name) for name in _SKIPPING_META}
_patch_lock = threading.Lock()
_active = 0


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Builds a model without allocating its parameters: see the module's docstring. The
    model must then be wrapped by ``smp.DistributedModel``, which gives each rank the values of
    the parameters it owns."""
    global _active
    if not enabled:
        yield
        return
    if getattr(_local, "recorder", None) is not None:
        yield  # nested: the outer context records
        return
    recorder = _Recorder()
    # Recording allocates and frees scratch tensors: large ones mapped alone while it runs,
    # glibc's threshold put back when it ends, however it ends (DistributedModel maps them alone
    # again while it gives the parameters values).
    with returning_memory():
        with _patch_lock:
            _active += 1
            nn.Module.register_parameter = _register_parameter
            for name, patched in _init_patches.items():
                setattr(nn.init, name, patched)
        _local.recorder = recorder
        try:
            with recorder:
                yield
        finally:
            _local.recorder = None
            with _patch_lock:
                _active -= 1
                if not _active:
                    nn.Module.register_parameter = _original_register
                    for name, original in _init_originals.items():
                        setattr(nn.init, name, original)


def has_delayed(module: nn.Module) -> bool:
    """Whether ``module`` has parameters created under delayed initialisation."""
    return any(getattr(p, _PROGRAM, None) is not None for p in module.parameters())


def placeholders(module: nn.Module) -> dict[int, Record]:
    """Replaces every delayed (meta) parameter of ``module`` by a CPU parameter of shape (0,)
    carrying its record (one object per parameter, so tied ones stay tied), names the records,
    and returns {id(placeholder): record}."""
    new: dict[int, nn.Parameter] = {}
    records: dict[int, Record] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            record = getattr(p, _PROGRAM, None) if p is not None else None
            if record is None or not p.is_meta:
                continue
            if id(p) not in new:
                holder = nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
                holder.__dict__.update(p.__dict__)
                record.name = f"parameter '{path + '.' if path else ''}{name}'"
                new[id(p)] = holder
                records[id(holder)] = record
            sub._parameters[name] = new[id(p)]
    return records


def materialize(param: nn.Parameter, pool: dict | None = None) -> None:
    """Gives a delayed parameter its values (as eager construction would have), in a storage
    of ``pool`` ({(numel, dtype): [flat tensors]}) when one of its size is there."""
    record: Record = getattr(param, _PROGRAM)
    # A shard's record has no fixed storage size (Derived.numel): a storage of its shard's size.
    numel = record.source.numel // record.size if isinstance(record, Derived) else record.numel
    with torch.no_grad():
        param.data = record.replay(_take(pool, numel, record.dtype)).to(param.device)


def _take(pool: dict | None, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A flat storage of ``numel`` elements of ``dtype`` from ``pool``, if it holds one."""
    free = (pool or {}).get((numel, dtype))
    return free.pop() if free else None


def recycle(tensors: list[torch.Tensor], pool: dict) -> None:
    """Puts the storages of ``tensors`` (values nothing uses any more) into ``pool`` for
    :func:`materialize` to replay into: a process that frees and allocates large tensors one
    after another does not get its freed memory back (design.md §7.4)."""
    for t in tensors:
        flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        pool.setdefault((flat.numel(), flat.dtype), []).append(flat)


def _replayed_into_pool(record: Record, pool: dict | None) -> torch.Tensor:
    """``record``'s values, replayed into a storage of ``pool`` (a fresh one if it holds none),
    which goes back to ``pool`` with them: use them before the pool is drawn on again."""
    flat = _take(pool, record.numel, record.dtype)
    if flat is None:
        flat = torch.empty(record.numel, dtype=record.dtype)
    values = record.replay(flat)
    if pool is not None:
        recycle([flat], pool)
    return values


def release(param: nn.Parameter, pool: dict | None = None) -> None:
    """Takes a materialised delayed parameter's values away again (size-0 storage); its storage
    goes to ``pool`` when given (:func:`recycle`)."""
    if pool is not None:
        recycle([param.detach()], pool)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


@contextlib.contextmanager
def materialized_while_called(module: nn.Module, pool: dict) -> Iterator[None]:
    """While the body runs, each module's delayed parameters hold values during its forward
    only: what tracing on one rank needs without ever holding the whole model. Freed storages
    go to ``pool`` ({(numel, dtype): [flat tensors]}) and are reused (the layers repeat; what
    is left there the caller may reuse too: memory a process freed is not always given back
    to the system, so reusing it keeps the peak down)."""
    handles = []

    def own(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m._parameters.values() if p is not None and waiting(p)]

    def pre(m, *_):
        for p in own(m):
            materialize(p, pool)
            m.__dict__.setdefault("_smp_delayed_live", []).append(p)

    def post(m, *_):
        for p in m.__dict__.pop("_smp_delayed_live", []):
            # A shard's record (Derived) has no fixed storage size: not pooled.
            release(p, pool if getattr(p, _PROGRAM).numel else None)

    for m in module.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in module.modules():
            post(m)


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
_MAPPED_ALONE = 1 << 20
_GLIBC_INITIAL = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD (and M_TRIM_THRESHOLD)
_malloc_lock = threading.Lock()
_mapping = [0]  # depth of returning_memory contexts (all threads)
# The M_MMAP_THRESHOLD smp set last (None: never): glibc has no getter, so this is what smp
# knows of the process's threshold.
_threshold_set: list[int | None] = [None]


def _glibc():
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


@contextlib.contextmanager
def returning_memory(enabled: bool = True) -> Iterator[None]:
    """Inside, every allocation of 1 MiB or more is mapped on its own and goes back to the
    operating system when freed (glibc's ``mallopt(M_MMAP_THRESHOLD)``). Giving delayed
    parameters their values allocates and frees whole weights one after another; glibc's
    default moves large allocations onto its heap after the first frees, and there freed
    weights interleaved with kept shards stay in the process (measured at tp 2: the whole
    model's size again, design.md §7.4). When the outermost context ends, however it ends,
    glibc's settings go back as close to what they were as glibc allows
    (:func:`_glibc_settings`). Without glibc, nothing changes."""
    libc = _glibc() if enabled else None
    if libc is None:
        yield
        return
    with _malloc_lock:
        _mapping[0] += 1
        if _mapping[0] == 1:
            libc.mallopt(_M_MMAP_THRESHOLD, _MAPPED_ALONE)
            _threshold_set[0] = _MAPPED_ALONE
    try:
        yield
    finally:
        with _malloc_lock:
            _mapping[0] -= 1
            if _mapping[0] == 0:
                for param, value in _glibc_settings():
                    libc.mallopt(param, value)
                    if param == _M_MMAP_THRESHOLD:
                        _threshold_set[0] = value


def _glibc_settings(environ: dict[str, str] | None = None) -> list[tuple[int, int]]:
    """The ``mallopt`` calls that put glibc back as close as it allows to where it was before
    smp's first call. glibc has no getter and cannot return to its dynamic threshold once
    ``M_MMAP_THRESHOLD`` was set (mallopt(3): setting it, ``M_TRIM_THRESHOLD``, ``M_TOP_PAD`` or
    ``M_MMAP_MAX`` disables the adjustment for good), so what the process started with is read
    from the environment glibc itself reads at startup:

    - a threshold the user chose (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=N`` or
      ``MALLOC_MMAP_THRESHOLD_=N``): that threshold again;
    - another of those settings chosen (dynamic adjustment off from the start): glibc's initial
      threshold, 128 KiB, which the process had;
    - none (glibc's default, dynamic): the state the dynamic adjustment converges to once blocks
      of its ceiling have been freed, as they are in any process that builds a model: the
      threshold at its ceiling, 32 MiB on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``, 4 MiB x
      sizeof(long)), and the trim threshold twice that, the pair the adjustment keeps.
    """
    import ctypes

    environ = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        if name.startswith("glibc.malloc."):
            chosen[name.removeprefix("glibc.malloc.")] = value
    for name in ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max"):
        legacy = environ.get(f"MALLOC_{name.upper()}_")
        if legacy is not None:
            chosen.setdefault(name, legacy)
    if "mmap_threshold" in chosen:
        try:
            return [(_M_MMAP_THRESHOLD, int(chosen["mmap_threshold"], 0))]
        except ValueError:
            pass  # glibc ignored it as well: as if not set
        chosen.pop("mmap_threshold")
    if chosen.keys() & {"trim_threshold", "top_pad", "mmap_max"}:
        return [(_M_MMAP_THRESHOLD, _GLIBC_INITIAL)]
    ceiling = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
    return [(_M_MMAP_THRESHOLD, ceiling), (_M_TRIM_THRESHOLD, 2 * ceiling)]


def waiting(p: torch.Tensor) -> bool:
    return getattr(p, _PROGRAM, None) is not None and p.numel() == 0


class Derived:
    """The record of a tensor-parallel shard of a delayed parameter: ``source``'s values, then
    this rank's shard of them (``functional.shard_tensor``), computed when needed."""

    def __init__(self, source: Record, split: tuple[int, int], size: int, rank: int):
        self.source, self.split, self.size, self.rank = source, split, size, rank
        self.name = source.name

    def replay(self, base: torch.Tensor | None = None, pool: dict | None = None) -> torch.Tensor:
        """This rank's shard (in ``base`` when its size fits); the whole source replays into a
        storage of ``pool`` when one of its size is there, and goes back to it after."""
        full = _replayed_into_pool(self.source, pool)
        shard = shard_tensor(full, self.split[0], self.split[1], self.size, self.rank)
        if base is None or base.numel() != shard.numel():
            return shard.clone()
        return base.view(shard.shape).copy_(shard)

    @property
    def numel(self) -> int:
        return 0  # not pooled: the shard's size is known only once computed

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype


@contextlib.contextmanager
def converting(module: nn.Module, size: int, rank: int) -> Iterator[dict]:
    """Around the tensor-parallel conversion of ``module`` (the body stores the converted module
    as ``out["new"]``, ``module`` itself when converted in place): ``module``'s delayed
    parameters hold their values during the conversion (one module's worth at a time), and
    afterwards each parameter of the converted module that came from one of them (same name)
    is a delayed placeholder again, recorded as that parameter's shard (or the parameter
    itself, replicated). A converted value that the record would not give back (a conversion
    that does more than cut along one dimension) stays as it is."""
    before = {name: p for name, p in module.named_parameters() if waiting(p)}
    out: dict = {}
    if not before:
        yield out
        return
    records = {name: getattr(p, _PROGRAM) for name, p in before.items()}
    pool: dict = {}  # the module's whole weights, replayed into again for the checks below
    for p in before.values():
        materialize(p, pool)
    kept: set[int] = set()  # converted values a record would not give back
    try:
        yield out
        new = out.get("new")
        for name, p in new.named_parameters() if new is not None else ():
            record = records.get(name)
            if record is None or p.numel() == 0:
                continue
            split = getattr(p, "_smp_tp_split", None)
            derived = record if split is None else Derived(record, split, size, rank)
            if _replays_to(derived, p.detach(), pool):
                setattr(p, _PROGRAM, derived)
                release(p)  # the conversion's own tensor: freed, not reused
            else:
                kept.add(id(p))
    finally:
        # A storage a converted parameter still uses (a view kept as it is) is not reused.
        new = out.get("new")
        live = {
            q.untyped_storage().data_ptr()
            for q in (new.parameters() if new is not None else ())
            if q.numel() > 0
        }
        for p in before.values():
            if p.numel() > 0 and id(p) not in kept:
                shared = p.untyped_storage().data_ptr() in live
                release(p, None if shared else pool)


def _replays_to(record: Record | Derived, value: torch.Tensor, pool: dict) -> bool:
    """Whether ``record`` replays to ``value`` (replayed into a storage of ``pool``)."""
    if isinstance(record, Derived):
        return torch.equal(record.replay(None, pool), value)
    return torch.equal(_replayed_into_pool(record, pool), value)
