"""``smp.save`` / ``smp.load`` (SMP v1's): ``torch.save`` / ``torch.load`` of any object, one file
per model-parallel rank with ``partial=True``.

With ``partial=True`` the file name gets this rank's model-parallel index appended
(``f"{f}_{smp.mp_rank()}"``, as v1 did): each rank of a model replica writes and reads its own
part, e.g. its ``local_state_dict()``. ``partial=False`` writes and reads ``f`` itself, e.g. a
full ``state_dict()`` that every layout (and plain torch) can load. Saving is the caller's
choice of ranks, as in v1 (typically ``smp.dp_rank() == 0``).

Every write lands atomically: the object goes to a temporary file of its own beside the target
(a unique name per writer, so several processes saving the same name at once each write whole
files and the last rename wins), which is flushed to disk and then renamed over it, and the
directory is flushed too, so a process killed mid-write leaves the previous file whole (and at
most its temporary file, which the next save of that name on the same host removes).
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import secrets
import socket
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
    """Calls ``write(file)`` on a new temporary file beside ``path``, flushes it to disk, renames
    it over ``path`` and flushes the directory: a process killed midway leaves the previous
    ``path`` whole (and at most its temporary file, which a later write of that name on this
    host removes); a failure removes it.

    Every call writes a file of its own (``.<name>.tmp-<pid>-<random>@<host hash>``, created
    with ``O_EXCL``), so concurrent writers of one ``path`` never share bytes: each rename puts a
    whole file in place and the last one wins.
    """
    _remove_stale(path)
    while True:
        tmp = path.with_name(f"{_tmp_prefix(path)}{os.getpid()}-{secrets.token_hex(6)}@{_HOST}")
        try:  # O_EXCL: never another writer's file; 0o666 & ~umask, as open(path, "wb") would
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:  # pragma: no cover - 48 random bits collided
            continue
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)  # the rename itself survives a crash
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# This host, short (a temporary name must stay within the 255 bytes of a file name).
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def fsync_directory(path: Path) -> None:
    """Flushes a directory's entries (a rename or a new file in it) to disk (where the file
    system can: some FUSE mounts refuse to sync a directory, and there is nothing more to do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _remove_stale(path: Path) -> None:
    """Removes the temporary files of earlier writes of ``path`` by processes of this host that
    no longer exist (killed mid-write); another host's, or a live process's, are left alone."""
    prefix = _tmp_prefix(path)
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix)]
    except OSError:
        return  # a missing directory: the open below says so
    for name in names:
        pid, _, rest = name[len(prefix) :].partition("-")
        if rest.rpartition("@")[2] != _HOST or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its writer is gone
            (path.parent / name).unlink(missing_ok=True)
        except OSError:  # alive (another user's) or unknowable: leave it
            pass


def load(
    f: str,
    map_location: Any = None,
    pickle_module: Any = None,
    partial: bool = True,
    weights_only: bool = False,
    **pickle_load_args: Any,
) -> Any:
    """Loads what :func:`save` wrote to ``f`` (``partial=True``: this rank's own file).

    Like ``torch.load(weights_only=False)`` by default, as v1 did, so any saved object comes back
    (kept for v1's scripts, which save objects of their own): such a file can run code when it
    loads, so load only files you trust, or pass ``weights_only=True`` (tensors and plain types,
    plus what ``torch.serialization.add_safe_globals`` allows). ``smp.resume_from_checkpoint``
    loads with ``weights_only=True``.

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
