"""The TP ranks' agreement on a region's arguments: each rank describes its call, the group
compares digests of the descriptions, and a difference either runs in turn (smp.tp.region) or
raises :class:`DivergentArgumentsError` on every rank before any collective of the region.

Note [Region agreement]
~~~~~~~~~~~~~~~~~~~~~~~
At entry (smp's batch semantics only: not nested, tp > 1, not ``prescaled_batch``) each rank
describes its call: the region's name, the grad mode, and every leaf of (args, kwargs): tensors
by dtype, shape, requires_grad and device type; None, numbers, strings, dtypes and enum members
by value; lists, tuples, named tuples and dicts (with keys of those kinds, or tuples of them) by
structure; anything else (a ``Fraction``, a numpy scalar, a dataclass) by type and a digest of
its contents, the hash of its pickle. An object that does not pickle (a lambda) has no digest: it
is taken to differ on every rank, never to agree. An object that holds tensors (a key/value
cache) is described by its type: its tensors' values cannot be compared without a copy, and on a
GPU a sync, per call, and digesting the rest costs a walk of the whole object per call (a 32-layer
Hugging Face cache: ~200 us, for each of the 32 layers' calls); such an object never travels, and
the runs in turn are exact for it only when the region reads the same state from each
rank's object. The region's name is its path in the model, so ranks in different regions show.
The TP group all-gathers a 16-byte digest of that description, on the host (Note [Agreement on
the host]). Equal digests: the region runs as it always did. Different digests: the full
descriptions are all-gathered, and then
  - a difference that cannot run (ranks in different regions, grad mode on some ranks only, an
    object holding tensors missing or of another type on some rank, an object without a digest)
    raises on every rank, naming the region, the ranks and the difference, before any collective
    of the region;
  - anything else runs *in turn* (Note [Runs in turn] in smp.tp.region).
Every rank takes the same branch: each decision is a function of the all-gathered descriptions.

Note [Agreement on the host]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The descriptions are host-side metadata, so they travel on the host: on ``host_group("tp")``,
the TP group's gloo twin ``tp_host`` under NCCL (smp.state), the gloo TP group itself otherwise,
with CPU tensors. A region call then reads no device tensor on the host: on the device the
region's collectives are only enqueued, and the host runs ahead of the stream as it does between
regions. Sent on the TP group under NCCL, the digest would cross to the device and back, a
device-to-host sync per region call (per layer, per microbatch). The cost that stays is one
host collective per region call (the digest's all-gather; the slow path adds the descriptions'):
every rank must exchange at every call, since a rank that skipped the exchange while a peer
made it would match that peer's all-gather against the region's own collectives. A group smp
made no twin for and that has no CPU backend (a user's NCCL group given to a module) carries
the exchange itself, on the device, with its host sync.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import io
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from smp.state import get_state, is_initialized
from smp.tp import functional as tpf

__all__ = ["DivergentArgumentsError", "region_name"]

logger = logging.getLogger("smp")


class DivergentArgumentsError(ValueError):
    """The ranks of a TP group called a region with arguments that cannot run together."""


def region_name(module: nn.Module) -> str:
    """The module's path in the model (set when smp.DistributedModel converts it), else its
    class name: what agreement and error messages call the region."""
    return getattr(module, "_smp_region_name", None) or type(module).__name__


# ---- describing a call --------------------------------------------------------------------------

# Leaves described (and sent) by value, with enum members and slices of ints. Everything else
# that is not a tensor, a torch.Size, a device or a container is an object: described by its
# type and a digest of its contents (:func:`_content`).
_VALUES = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), torch.dtype)
# Dict keys a spec holds as they are (their repr is the same on every rank for equal keys).
_KEYS = (str, int, bool, bytes, type(None))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_key(key: Any) -> bool:
    if type(key) is tuple:
        return all(_plain_key(k) for k in key)
    return type(key) in _KEYS or isinstance(key, enum.Enum)


class _HoldsTensors(Exception):
    """Raised by :class:`_ContentPickler` at an object's first tensor."""


class _ContentPickler(pickle.Pickler):
    """Pickles an argument for its digest, and stops at the first tensor inside it."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        # Not persistent_id: pickle calls that (in Python) for every object it meets, this only
        # for the types it does not pickle itself.
        if isinstance(obj, torch.Tensor):
            raise _HoldsTensors
        return NotImplemented


# The description of an object that holds tensors (Note [Region agreement]).
_HOLDS_TENSORS = "holds tensors"


def _content(obj: Any) -> tuple[str | None, str]:
    """(digest, why none) of an object argument's contents.

    The digest is a hash of its pickle, so two objects digest equally only if they pickle to
    the same bytes: a ``Fraction``, a numpy scalar or array, a dataclass or a user object by its
    state, a function or class by its name. Pickling that is not deterministic (a set of
    strings, iterated in the process's hash order; an object whose state holds ids) can make
    equal objects digest differently, never different ones equally: they then run in turn,
    still exact. A set of plain values is digested sorted. An object that holds a tensor is
    :data:`_HOLDS_TENSORS` (its type decides; Note [Region agreement] says why). An object that
    does not pickle (a lambda, a lock) has no digest: None and the error."""
    if type(obj) in (set, frozenset) and all(type(v) in _VALUES for v in obj):
        items = sorted((_qualified(type(v)), repr(v)) for v in obj)
        raw = repr((_qualified(type(obj)), items)).encode()
        return hashlib.blake2b(raw, digest_size=16).hexdigest(), ""
    buffer = io.BytesIO()
    try:
        _ContentPickler(buffer).dump(obj)
    except _HoldsTensors:
        return _HOLDS_TENSORS, ""
    except Exception as exc:  # noqa: BLE001 - anything pickling raises: no digest
        return None, f"{type(exc).__name__}: {exc}"
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).hexdigest(), ""


class _Call:
    """One rank's call of a region, described (Note [Region agreement]).

    ``spec`` is a tree of tuples holding only Python values and dtypes (its ``repr`` is the same
    on every rank for the same call): ``("region", name, grad_enabled, args, kwargs)``, whose
    nodes are ``("tensor", dtype, shape, requires_grad, device_type)``, ``("value", v)``,
    ``("size", dims)``, ``("device", type)``, ``("list" | "tuple", children)``,
    ``("namedtuple", name, children)``, ``("dict" | "OrderedDict", ((key, child), ...))`` and
    ``("object", qualified type name, content)``. ``content`` is the digest of the object's
    contents (:func:`_content`; ``"holds tensors"`` for an object holding tensors, described by
    its type), or, for an object that has none, ``("undigestible", tp rank,
    why)``: it differs on every rank, so such an object is never taken to be equal to its
    peers' (the ranks go to the slow path, which refuses it).
    ``tensors`` are the tensor leaves in the order of the spec, ``objects`` the leaves smp cannot
    describe by value and the named tuples' classes, by path; ``sendable`` those objects that
    hold no tensor (another rank's run can use a copy of them).
    """

    def __init__(
        self,
        spec: tuple,
        tensors: list[torch.Tensor],
        objects: dict[tuple, Any],
        sendable: dict[tuple, Any] | None = None,
    ):
        self.spec, self.tensors, self.objects = spec, tensors, objects
        self.sendable = sendable or {}

    @classmethod
    def describe(cls, module: nn.Module, args: tuple, kwargs: dict) -> _Call:
        tensors: list[torch.Tensor] = []
        objects: dict[tuple, Any] = {}
        sendable: dict[tuple, Any] = {}

        def node(obj: Any, path: tuple) -> tuple:
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
                return ("tensor", obj.dtype, tuple(obj.shape), obj.requires_grad, obj.device.type)
            kind = type(obj)
            if kind in _VALUES or isinstance(obj, enum.Enum) or _is_int_slice(obj):
                return ("value", obj)
            if kind is torch.Size:
                return ("size", tuple(obj))
            if kind is torch.device:
                return ("device", obj.type)
            if kind in (list, tuple):
                return (kind.__name__, tuple(node(v, (*path, i)) for i, v in enumerate(obj)))
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                objects[path] = kind
                children = tuple(node(v, (*path, i)) for i, v in enumerate(obj))
                return ("namedtuple", _qualified(kind), children)
            if kind in (dict, collections.OrderedDict) and all(_plain_key(k) for k in obj):
                return (kind.__name__, tuple((k, node(v, (*path, k))) for k, v in obj.items()))
            objects[path] = obj
            digest, why = _content(obj)
            if digest is None:
                rank = getattr(module, "tp_rank", 0)
                return ("object", _qualified(kind), ("undigestible", rank, why))
            if digest != _HOLDS_TENSORS:  # its pickle is the whole value: a copy can travel
                sendable[path] = obj
            return ("object", _qualified(kind), digest)

        spec = (
            "region",
            region_name(module),
            torch.is_grad_enabled(),
            node(tuple(args), ("args",)),
            node(dict(kwargs), ("kwargs",)),
        )
        return cls(spec, tensors, objects, sendable)

    def digest(self) -> torch.Tensor:
        """16 bytes of a hash of the spec, as 2 int64 (the fast path of the agreement)."""
        raw = hashlib.blake2b(repr(self.spec).encode(), digest_size=16).digest()
        return torch.frombuffer(bytearray(raw), dtype=torch.int64)


def _is_int_slice(obj: Any) -> bool:
    return type(obj) is slice and all(
        type(v) in (int, type(None)) for v in (obj.start, obj.stop, obj.step)
    )


def _tensor_nodes(node: tuple) -> Iterator[tuple]:
    """The tensor nodes of a spec, in order."""
    kind = node[0]
    if kind == "tensor":
        yield node
    elif kind in ("list", "tuple"):
        for child in node[1]:
            yield from _tensor_nodes(child)
    elif kind == "namedtuple":
        for child in node[2]:
            yield from _tensor_nodes(child)
    elif kind in ("dict", "OrderedDict"):
        for _, child in node[1]:
            yield from _tensor_nodes(child)
    elif kind == "region":
        yield from _tensor_nodes(node[3])
        yield from _tensor_nodes(node[4])


def _placed(node: tuple, path: tuple, out: dict[tuple, tuple]) -> dict[tuple, tuple]:
    """Path -> node of every leaf a rank must supply itself (objects, named tuples' classes)."""
    kind = node[0]
    if kind == "object":
        out[path] = node
    elif kind in ("list", "tuple"):
        for i, child in enumerate(node[1]):
            _placed(child, (*path, i), out)
    elif kind == "namedtuple":
        out[path] = ("namedtuple", node[1])
        for i, child in enumerate(node[2]):
            _placed(child, (*path, i), out)
    elif kind in ("dict", "OrderedDict"):
        for key, child in node[1]:
            _placed(child, (*path, key), out)
    return out


def _where(path: tuple) -> str:
    """``args[1]``, ``attention_mask``, ``position_embeddings[0]``: a path for humans."""
    if path[0] == "args":
        text = f"argument {path[1]}" if len(path) > 1 else "the positional arguments"
        rest = path[2:]
    else:
        text = str(path[1]) if len(path) > 1 else "the keyword arguments"
        rest = path[2:]
    return text + "".join(f"[{p!r}]" for p in rest)


def _what(node: tuple | None) -> str:
    """A spec node for humans."""
    if node is None:
        return "nothing"
    kind = node[0]
    if kind == "tensor":
        _, dtype, shape, requires_grad, device = node
        grad = " requiring grad" if requires_grad else ""
        return f"a {str(dtype).removeprefix('torch.')} tensor of shape {list(shape)}{grad}"
    if kind == "size":
        return f"torch.Size({list(node[1])})"
    if kind == "value":
        text = repr(node[1])
        return text if len(text) <= 40 else text[:37] + "..."
    if kind == "device":
        return f"a {node[1]} device"
    if kind in ("list", "tuple", "dict", "OrderedDict"):
        return f"a {kind} of {len(node[1])}"
    if kind == "namedtuple":
        return f"a {node[1].rsplit('.', 1)[-1]}"
    return f"a {node[1].rsplit('.', 1)[-1]}"


def _first_difference(a: tuple, b: tuple, path: tuple) -> tuple[tuple, tuple | None, tuple | None]:
    """(path, node of a, node of b) where two argument specs first differ, or () if equal."""
    if a == b:
        return ()
    kinds = (a[0], b[0])
    if kinds[0] != kinds[1] or kinds[0] in ("tensor", "value", "size", "device", "object"):
        return (path, a, b)
    if kinds[0] in ("list", "tuple", "namedtuple"):
        ca, cb = (a[2], b[2]) if kinds[0] == "namedtuple" else (a[1], b[1])
        if kinds[0] == "namedtuple" and a[1] != b[1]:
            return (path, a, b)
        for i in range(max(len(ca), len(cb))):
            if i >= len(ca) or i >= len(cb):
                return ((*path, i), ca[i] if i < len(ca) else None, cb[i] if i < len(cb) else None)
            found = _first_difference(ca[i], cb[i], (*path, i))
            if found:
                return found
        return (path, a, b)
    da, db = dict(a[1]), dict(b[1])  # dicts
    for key in list(da) + [k for k in db if k not in da]:
        if key not in da or key not in db:
            return ((*path, key), da.get(key), db.get(key))
        found = _first_difference(da[key], db[key], (*path, key))
        if found:
            return found
    return (path, a, b)  # same items, another order


def _describe_difference(specs: list[tuple], a: int, b: int) -> str:
    """How TP ranks ``a`` and ``b`` called the region differently, in one phrase."""
    for index, root in ((3, ("args",)), (4, ("kwargs",))):
        found = _first_difference(specs[a][index], specs[b][index], root)
        if found:
            path, na, nb = found
            other = _what(nb)
            if na and nb and na[0] == nb[0] == "object" and na[1] == nb[1]:
                other = "one with other contents"
            return f"{_where(path)} is {_what(na)} on TP rank {a} and {other} on TP rank {b}"
    return f"TP ranks {a} and {b} called it the same way"


# ---- agreement ----------------------------------------------------------------------------------


def _host_group(group: Any) -> Any:
    """The group that carries the agreement's messages for the TP group ``group``: smp's host
    twin of its TP group (``tp_host``, a gloo group: Note [Agreement on the host]) when
    ``group`` is smp's TP group, else ``group`` itself."""
    if is_initialized():
        state = get_state()
        if group is state.groups.get("tp"):
            return state.host_group("tp")
    return group


def _exchange(group: Any, mine: torch.Tensor) -> torch.Tensor:
    """All-gather of equal-sized 1-d CPU tensors along dim 0 over the host side of the TP group
    ``group`` (Note [Agreement on the host]); a CPU tensor (no autograd: integer tensors)."""
    host = _host_group(group)
    if torch.device("cpu") in host._device_types:
        return tpf.gather_from_region(mine, 0, host)
    # A device-only group smp made no twin for (a user's NCCL group passed to a module): the
    # message travels on the device and is read back, one host sync per call.
    return tpf.gather_from_region(mine.to(_collective_device()), 0, host).cpu()


def _collective_device() -> torch.device:
    if is_initialized() and get_state().device.type == "cuda":
        return get_state().device
    return torch.device("cuda", torch.cuda.current_device())


def _all_gather_bytes(group: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in TP rank order: two exchanges (the lengths, then the bytes padded
    to the longest), each read once on the host."""
    n = group.size()
    sizes = _exchange(group, torch.tensor([len(data)], dtype=torch.int64)).tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = _exchange(group, mine).numpy().tobytes()
    return [everyone[i * longest : i * longest + sizes[i]] for i in range(n)]


_announced = False  # the first region whose ranks' arguments differ is logged once


def _agree(module: nn.Module, mine: _Call) -> tuple[list[tuple], list[dict]] | None:
    """None if every rank of the group called the region the same way; else every rank's spec
    and the copies of every rank's sendable objects (by path), after checking that the calls
    can run in turn (Note [Region agreement])."""
    global _announced
    group, n = module.tp_group, module.tp_size
    digests = _exchange(group, mine.digest()).tolist()  # 2 int64 per rank
    if digests == digests[:2] * n:
        return None
    try:
        # The sendable objects in one pickle: one object at two paths stays one object.
        data = pickle.dumps((mine.spec, pickle.dumps(mine.sendable) if mine.sendable else b""))
    except Exception as exc:  # noqa: BLE001 - a value that does not pickle: every rank raises
        data = pickle.dumps((("unsendable", f"{type(exc).__name__}: {exc}"), b""))
    received = [pickle.loads(b) for b in _all_gather_bytes(group, data)]
    specs = [spec for spec, _ in received]
    sent: list[dict] = []
    failed = ""
    for j, (_, objects) in enumerate(received):
        try:
            sent.append(pickle.loads(objects) if objects else {})
        except Exception as exc:  # noqa: BLE001 - agreed on below, raised on every rank
            sent.append({})
            failed = failed or f"TP rank {j}'s objects ({type(exc).__name__}: {exc})"
    if any(objects for _, objects in received):  # the same on every rank: all take this branch
        # One byte first: a rank with nothing to say still sends something.
        gathered = _all_gather_bytes(group, b"!" + failed.encode())
        failures = [(i, f[1:].decode()) for i, f in enumerate(gathered) if len(f) > 1]
        if failures:
            where, what = failures[0]
            raise DivergentArgumentsError(
                f"smp: the tensor-parallel ranks called {region_name(module)} with arguments "
                f"that differ, and on TP rank {where} a copy of {what} could not be unpickled, "
                "so the ranks' arguments cannot run in turn. Pass values that unpickle, or the "
                "same values on every rank. (Raised on every rank of the TP group; this is TP "
                f"rank {module.tp_rank}.)"
            )
    problem = _cannot_run(specs, sent)
    if problem is not None:
        raise DivergentArgumentsError(
            f"smp: the tensor-parallel ranks called {region_name(module)} "
            f"({type(module).__name__}){_microbatch()} with arguments that cannot run together: "
            f"{problem[0]}. {problem[1]} (Raised on every rank of the TP group; this is TP rank "
            f"{module.tp_rank}.)"
        )
    if not _announced:
        _announced = True
        other = next((j for j in range(n) if specs[j] != specs[0]), 0)
        logger.info(
            "smp: the tensor-parallel ranks' arguments to %s differ (%s): a region whose ranks' "
            "arguments differ runs each rank's arguments in turn on the whole group (exact; the "
            "same work in %d runs). Logged once.",
            region_name(module),
            _describe_difference(specs, 0, other),
            n,
        )
    return specs, sent


def _microbatch() -> str:
    mb = get_state().microbatch if is_initialized() else None
    return f" in microbatch {mb}" if mb is not None else ""


def _node_at(spec: tuple, path: tuple) -> tuple | None:
    """The node of a region spec at ``path`` (as built by ``_Call.describe``), None if absent."""
    node = spec[3] if path[0] == "args" else spec[4]
    for key in path[1:]:
        kind = node[0]
        if kind in ("list", "tuple", "namedtuple"):
            children = node[2] if kind == "namedtuple" else node[1]
            if not isinstance(key, int) or key >= len(children):
                return None
            node = children[key]
        elif kind in ("dict", "OrderedDict"):
            node = dict(node[1]).get(key)
            if node is None:
                return None
        else:
            return None
    return node


def _cannot_run(specs: list[tuple], sent: list[dict]) -> tuple[str, str] | None:
    """(what differs, the fix) if the calls cannot run in turn, else None. It reads only the
    all-gathered specs and which objects each rank sent (``sent``), so every rank decides the
    same."""
    n = len(specs)
    for j, spec in enumerate(specs):
        if spec[0] == "unsendable":
            return (
                f"TP rank {j}'s arguments differ from its peers' and hold a value smp cannot "
                f"send ({spec[1]})",
                "Pass plain values (numbers, strings, None, enum members) or give the ranks "
                "arguments of the same shapes.",
            )
    names = [s[1] for s in specs]
    if len(set(names)) > 1:
        listing = ", ".join(f"TP rank {j} in {name}" for j, name in enumerate(names))
        return (
            f"the ranks are in different regions ({listing})",
            "The ranks of a TP group must call their distributed modules in the same order (the "
            "same branches and loop counts).",
        )
    grad = [s[2] for s in specs]
    if len(set(grad)) > 1:
        on = [j for j in range(n) if grad[j]]
        off = [j for j in range(n) if not grad[j]]
        return (
            f"grad mode is on for TP ranks {on} and off for TP ranks {off}, so the backward "
            "would run on some ranks only",
            "Run the region under torch.no_grad() on every rank of the group or on none.",
        )
    placed = [{**_placed(s[3], ("args",), {}), **_placed(s[4], ("kwargs",), {})} for s in specs]
    for j in range(n):
        for r in range(n):
            for path, node in placed[j].items():
                if r == j or path in sent[j]:  # its own, or a copy of rank j's travelled
                    continue
                theirs = placed[r].get(path)
                if node[0] == "object" and not isinstance(node[2], str):
                    return (
                        f"{_where(path)} is {_what(node)} on TP rank {j}, which smp cannot "
                        f"compare with the other ranks' ({node[2][2]}), so it could differ "
                        "between them unseen",
                        "Pass a value that pickles (smp compares arguments that are not "
                        "tensors by a digest of their pickle), or give the module this object "
                        "as an attribute instead of an argument.",
                    )
                if node[0] == "object":  # holds tensors: rank r runs it with a fork of its own
                    same = theirs is not None and theirs[0] == "object" and theirs[1] == node[1]
                else:  # a named tuple's class
                    same = theirs == node
                if same:
                    continue
                here = (
                    f"{_where(path)} is {_what(node)} on TP rank {j} and "
                    f"{_what(_node_at(specs[r], path))} on TP rank {r}"
                )
                first = _describe_difference(specs, j, r)
                also = f" (and {first})" if first != here else ""
                return (
                    f"{here}{also}. Ranks whose arguments differ run each rank's arguments in "
                    "turn, and an object that holds tensors (other than a list, tuple or dict) "
                    "cannot be sent between ranks: every rank needs one of the same type in the "
                    "same place",
                    "Pass objects of the same type in the same places on every rank (or None on "
                    "every rank).",
                )
    return None
