"""``smp.save`` / ``smp.load`` (SMP v1's): ``torch.save`` / ``torch.load`` of any object, one file
per model-parallel rank with ``partial=True``.

With ``partial=True`` the file name gets this rank's model-parallel index appended
(``f"{f}_{smp.mp_rank()}"``, as v1 did): each rank of a model replica writes and reads its own
part, e.g. its ``local_state_dict()``. ``partial=False`` writes and reads ``f`` itself, e.g. a
full ``state_dict()`` that every layout (and plain torch) can load. Saving is the caller's
choice of ranks, as in v1 (typically ``smp.dp_rank() == 0``).

Every write lands atomically: the object goes to a temporary file beside the target, which is
flushed to disk and then renamed over it, so a process killed mid-write leaves the previous file
whole (and at most a temporary file, which the next save of that name removes).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["save", "load", "partial_path"]


def partial_path(f: str) -> str:
    """The file a ``partial=True`` save or load of ``f`` uses on this rank."""
    from smp import comm

    return f"{f}_{comm.mp_rank()}"


def _check_name(f: Any, what: str) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise ValueError(f"smp.{what} takes a file name (str), got {type(f).__name__}")
    return os.fspath(f)


def save(
    obj: Any,
    f: str,
    partial: bool = True,
    pickle_module: Any = pickle,
    pickle_protocol: int = 2,
) -> str:
    """Saves ``obj`` with ``torch.save`` to ``f`` (``partial=True``: to ``f`` with this rank's
    model-parallel index appended). Returns the path written.

    Raises:
        ValueError: ``f`` is not a file name.
        OSError: the directory is missing or not writable (the previous file is untouched).
    """
    path = Path(partial_path(_check_name(f, "save")) if partial else _check_name(f, "save"))
    write_atomically(
        path,
        lambda out: torch.save(
            obj, out, pickle_module=pickle_module, pickle_protocol=pickle_protocol
        ),
    )
    return str(path)


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Calls ``write(file)`` on a temporary file beside ``path``, flushes it to disk and renames
    it over ``path``: a process killed midway leaves the previous ``path`` whole (and at most
    the temporary file, which the next write of that name replaces); a failure removes it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load(
    f: str,
    map_location: Any = None,
    pickle_module: Any = None,
    partial: bool = True,
    weights_only: bool = False,
    **pickle_load_args: Any,
) -> Any:
    """Loads what :func:`save` wrote to ``f`` (``partial=True``: this rank's own file).

    Like ``torch.load(weights_only=False)`` by default, as v1 did, so any saved object comes back:
    load only files you trust (``weights_only=True`` restricts it to tensors and plain types).

    Raises:
        FileNotFoundError: the file is missing; for a partial load the message says which
            model-parallel rank it belongs to (partial files load on the layout that saved them).
    """
    name = _check_name(f, "load")
    path = partial_path(name) if partial else name
    if not os.path.exists(path):
        if partial:
            from smp import comm

            raise FileNotFoundError(
                f"smp.load: {path} does not exist: the partial file of model-parallel rank "
                f"{comm.mp_rank()} (pp rank {comm.pp_rank()}, tp rank {comm.tp_rank()}) of "
                f"{name!r}. Partial files load on the layout that saved them (each "
                "model-parallel rank its own); save with partial=False to load on another layout"
            )
        raise FileNotFoundError(f"smp.load: {path} does not exist")
    kwargs = dict(pickle_load_args)
    if pickle_module is not None:
        kwargs["pickle_module"] = pickle_module
    return torch.load(path, map_location=map_location, weights_only=weights_only, **kwargs)
