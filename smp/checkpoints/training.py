"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` (api.md §9): checkpoints of the
model, the optimizer, the loss scale, every rank's random state and the user's own content,
that survive a process killed mid-save and load under another (pp, tp, dp) layout.

A checkpoint is a directory ``path/tag``:

- ``partial=True`` (the default): a torch.distributed.checkpoint (DCP) directory. Every rank
  hands DCP the tensors it holds under their original names (``model/<key>``,
  ``optim/<parameter key>/<state key>``), a tensor-parallel shard described as the chunk(s) of
  the full tensor it is, so DCP's planner writes each piece once (data-parallel replicas are
  deduplicated) and reads back whatever pieces another layout needs. smp does not define a
  file format of its own for the tensors.
- ``partial=False``: ``model.pt`` holds ``model.state_dict()`` (original keys, full shapes:
  ``torch.load`` + ``load_state_dict`` into the unwrapped model), ``optimizer.pt`` the full
  ``optimizer.state_dict()``; written by rank 0.

Both also hold ``user_content.pt`` (rank 0's ``user_content``), ``rng.pt`` (every rank's
random state: torch's, CUDA's, python's and the TP generators') and ``smp_checkpoint.json``,
the manifest: the layout that saved it and every file's size and CRC-32C (per item range for
DCP's data files), written last.

Fault safety: a save writes into ``path/.<tag>.tmp-<id>``; once every rank's files are on
disk (fsync'd) rank 0 writes the manifest, renames the directory to ``path/tag`` (an older
``path/tag`` is moved aside first and removed only after) and then replaces ``path/newest``
atomically; the parent directory is fsync'd after every rename. A process killed at any point
leaves the previous checkpoints and ``newest`` whole; the next save removes the leftovers. The
manifest numbers the saves in ``path`` (``sequence``), and ``num_kept_partial_checkpoints``
keeps the highest numbers: the order does not depend on the clock.

Trust: loading runs no code from the checkpoint. ``rng.pt``, ``optimizer.pt`` and
``user_content.pt`` are read with ``torch.load(weights_only=True)`` (tensors and plain Python
values), DCP's ``.metadata`` with an unpickler that takes only DCP's metadata classes, and its
byte items (hyperparameters, the loss scale) with ``weights_only=True``; a user type in
``user_content`` must be allowed with ``torch.serialization.add_safe_globals``
(:class:`CheckpointError` names it otherwise).

The optimizer may be created before or after ``resume_from_checkpoint``: when no
DistributedOptimizer exists yet as the state loads, the checkpoint's optimizer state is held and
loaded into the first DistributedOptimizer created over the model (:class:`_HeldOptimizerState`).
Loading checks the manifest, every file's size and
the small files' checksums first, and each data item's checksum as DCP reads it; a problem
fails on every rank with :class:`CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from smp.checkpoints.entries import (
    materialize_optimizer_state,
    model_entries,
    optimizer_entries,
    owned_optimizer_params,
    stateful_params,
)
from smp.checkpoints.files import fsync_directory, write_atomically
from smp.checkpoints.integrity import CheckpointError, _digest, _load_plain, _torch_save
from smp.checkpoints.keys import MASTER_KEY
from smp.core.rng import random_streams, set_random_streams
from smp.state import get_state

__all__ = ["save_checkpoint", "resume_from_checkpoint", "CheckpointError"]

logger = logging.getLogger("smp")

FORMAT = 1
MANIFEST = "smp_checkpoint.json"
NEWEST = "newest"


# ---- random state --------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    """This rank's random streams (smp.tp.functional.random_streams) and Python's."""
    return {**random_streams(), "python": random.getstate()}


def _set_rng_state(saved: dict[str, Any]) -> None:
    set_random_streams(saved)
    random.setstate(saved["python"])


# ---- agreement -----------------------------------------------------------------------------------


def _agree(state, failure: BaseException | None, what: str) -> None:
    """Raises on every rank if ``failure`` happened on any rank (one small all-gather)."""
    outcomes: list[Any] = [None] * state.world_size
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    try:
        dist.all_gather_object(outcomes, message, group=state.groups["world"])
    except RuntimeError as exc:  # a rank is gone (killed, crashed): say so, at once
        raise CheckpointError(
            f"{what} failed: another rank stopped answering ({exc}); "
            f"{'this rank had failed too: ' + message if message else 'this rank was fine'}"
        ) from (failure or exc)
    if failure is not None:
        if isinstance(failure, CheckpointError):
            raise failure
        raise CheckpointError(f"{what} failed on rank {state.rank}: {message}") from failure
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            raise CheckpointError(f"{what} failed on rank {rank}: {outcome}")


def _from_rank0(state, make: Callable[[], Any], what: str) -> Any:
    """``make()`` run on rank 0, its result (or its failure) given to every rank."""
    payload: list[Any] = [None]
    if state.rank == 0:
        try:
            payload = [("ok", make())]
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            payload = [("error", f"{type(exc).__name__}: {exc}")]
            error = exc
    try:
        dist.broadcast_object_list(payload, src=0, group=state.groups["world"])
    except RuntimeError as exc:  # a rank is gone (killed, crashed): say so, at once
        raise CheckpointError(f"{what} failed: another rank stopped answering ({exc})") from exc
    status, value = payload[0]
    if status == "error":
        if state.rank == 0 and isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{what} failed on rank 0: {value}")
    return value


def _the_model(given, state):
    """``given``, else the newest DistributedModel."""
    if given is not None:
        return given
    models = list(state.models)
    if not models:
        raise ValueError(
            "smp checkpoints: no smp.DistributedModel exists; create one (or pass model=)"
        )
    return models[-1]


def _optimizer_of(model, state):
    """The newest DistributedOptimizer over ``model``'s parameters, or None."""
    mine = {id(p) for p in model.parameters()}
    for optimizer in reversed(list(state.optimizers)):
        params = (optimizer.model_parameter(p) for g in optimizer.param_groups for p in g["params"])
        if any(id(p) in mine for p in params):
            return optimizer
    return None


def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or tag == NEWEST:
        raise ValueError(
            f"smp.save_checkpoint: tag must be a non-empty file name (no '/', not starting with "
            f"'.', not {NEWEST!r}), got {tag!r}"
        )
    return tag


def _layout(state) -> dict[str, int]:
    return {
        "pp": state.axis_size("pp"),
        "tp": state.axis_size("tp"),
        "dp": state.axis_size("rdp"),
        "world": state.world_size,
    }


# ---- save ----------------------------------------------------------------------------------------


def save_checkpoint(
    path: str,
    tag: str,
    partial: bool = True,
    model=None,
    optimizer=None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> str:
    """Saves a checkpoint to ``path/tag`` and names it in ``path/newest``; a collective: every
    rank calls it, after a step (not inside one).

    Args:
        path: the checkpoints' directory (created if missing; on a file system every rank sees).
        tag: this checkpoint's name, e.g. ``f"step_{n}"``; an existing one is replaced once the
            new one is whole.
        partial: True: every rank writes its part through DCP (loads under any layout).
            False: rank 0 writes the full state dicts (``torch.load``-able; slower, more memory).
        model, optimizer: default to the newest DistributedModel and the newest
            DistributedOptimizer over its parameters.
        user_content: any picklable object (e.g. the step and data position) that
            :func:`resume_from_checkpoint` returns; rank 0's is kept.
        translate_if_full: SMP v1's translation of a full checkpoint back to the model's own
            (e.g. Hugging Face) keys; smp splits modules in place, so ``state_dict()`` has those
            keys already and there is nothing to translate.
        num_kept_partial_checkpoints: keep only this many newest complete checkpoints in
            ``path`` (older complete ones are deleted after this one is whole).

    Returns:
        The checkpoint's directory.

    Raises:
        ValueError: a bad argument, or no model. CheckpointError: a failure on any rank (raised
        on every rank; the previous checkpoints stay as they were).
    """
    state = get_state()
    if state.in_step:
        raise RuntimeError("smp.save_checkpoint is called between steps, not inside smp.step")
    tag = _check_tag(tag)
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"smp.save_checkpoint: path must be a directory name, got {path!r}")
    if num_kept_partial_checkpoints is not None and (
        not isinstance(num_kept_partial_checkpoints, int) or num_kept_partial_checkpoints < 1
    ):
        raise ValueError(
            "smp.save_checkpoint: num_kept_partial_checkpoints must be an int >= 1 or None, got "
            f"{num_kept_partial_checkpoints!r}"
        )
    model = _the_model(model, state)
    optimizer = optimizer if optimizer is not None else _optimizer_of(model, state)
    if not model.partitioned:
        raise ValueError(
            "smp.save_checkpoint: the model is not partitioned yet (pipeline_parallel_degree > 1 "
            "partitions it at the first smp.step); save after a step"
        )
    if optimizer is None and state.rank == 0:
        logger.info("smp.save_checkpoint: no smp.DistributedOptimizer over the model; saving none")
    root = Path(path)
    started = time.perf_counter()

    def prepare() -> str:
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            fsync_directory(root.absolute().parent)  # the new directory's entry survives a crash
        name = f".{tag}.tmp-{uuid.uuid4().hex[:12]}"
        (root / name).mkdir()
        return name

    tmp = root / _from_rank0(state, prepare, "smp.save_checkpoint: creating the directory")
    files: dict[str, dict[str, int]] = {}
    failure: BaseException | None = None
    try:
        if partial:
            files = _save_partial(tmp, model, optimizer, state)
        else:
            files = _save_full(tmp, model, optimizer, state)
        rngs: list[Any] = [None] * state.world_size
        dist.all_gather_object(rngs, _rng_state(), group=state.groups["world"])
        if state.rank == 0:
            files["rng.pt"] = _torch_save(tmp / "rng.pt", rngs)
            if user_content is not None:
                files["user_content.pt"] = _torch_save(tmp / "user_content.pt", user_content)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        failure = exc
    _agree(state, failure, "smp.save_checkpoint: writing")

    def publish() -> str:
        manifest = {
            "format": FORMAT,
            "tag": tag,
            "partial": bool(partial),
            "layout": _layout(state),
            # The saves' order in this directory, for pruning: a clock may step back.
            "sequence": 1 + max((_sequence(m) for _, m in _checkpoints(root)), default=0),
            "saved_at": time.time(),  # informational only
            "files": dict(sorted(files.items())),
        }
        # write_atomically fsyncs the file and its directory (tmp) after the rename.
        write_atomically(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        final = root / tag
        aside = None
        if final.exists():
            aside = root / f".{tag}.replaced-{tmp.name.rpartition('-')[2]}"
            os.rename(final, aside)
            fsync_directory(root)
        os.rename(tmp, final)
        fsync_directory(root)  # the checkpoint is in place before newest names it
        write_atomically(root / NEWEST, lambda f: f.write(tag.encode()))
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        _remove_leftovers(root)
        if num_kept_partial_checkpoints is not None:
            _prune(root, num_kept_partial_checkpoints)
        return str(final)

    final = _from_rank0(state, publish, "smp.save_checkpoint: publishing")
    if state.rank == 0:
        total = sum(f["bytes"] for f in files.values())
        logger.info(
            "smp: checkpoint %s saved (%s, %.1f MB written by rank 0) in %.2f s",
            final,
            "partial" if partial else "full",
            total / 1e6,
            time.perf_counter() - started,
        )
    return final


def _save_partial(tmp: Path, model, optimizer, state) -> dict[str, dict[str, int]]:
    import torch.distributed.checkpoint as dcp

    from smp.checkpoints.dcp import _SavePlanner, _Writer

    entries = model_entries(model, state)
    if optimizer is not None:
        entries.update(optimizer_entries(model, optimizer, state))
    writer = _Writer(tmp)
    dcp.save(
        entries, storage_writer=writer, planner=_SavePlanner(), process_group=state.groups["world"]
    )
    parts: list[Any] = [None] * state.world_size
    dist.all_gather_object(parts, writer.digests, group=state.groups["world"])
    return {name: digest for part in parts for name, digest in part.items()}


def _save_full(tmp: Path, model, optimizer, state) -> dict[str, dict[str, int]]:
    full = model.state_dict()
    optim = optimizer.state_dict() if optimizer is not None else None
    files = {}
    if state.rank == 0:
        files["model.pt"] = _torch_save(tmp / "model.pt", full)
        if optim is not None:
            files["optimizer.pt"] = _torch_save(tmp / "optimizer.pt", optim)
    return files


def _complete(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def _remove_leftovers(root: Path) -> None:
    """Removes what interrupted saves left (``.<tag>.tmp-*``), and a moved-aside older copy
    once its tag exists again."""
    for entry in root.iterdir():
        name = entry.name
        if (
            name.startswith(".")
            and ".tmp-" in name
            and entry.is_dir()
            or (
                name.startswith(".")
                and ".replaced-" in name
                and entry.is_dir()
                and _complete(root / name[1:].rpartition(".replaced-")[0]) is not None
            )
        ):
            shutil.rmtree(entry, ignore_errors=True)


def _checkpoints(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The complete checkpoints in ``root`` (directories with a manifest) and their manifests."""
    found = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            manifest = _complete(entry)
            if manifest is not None:
                found.append((entry, manifest))
    return found


def _sequence(manifest: dict[str, Any]) -> int:
    """A save's number in its directory (0: saved before smp numbered them)."""
    value = manifest.get("sequence", 0)
    return value if isinstance(value, int) else 0


def _prune(root: Path, keep: int) -> None:
    """Deletes all but the ``keep`` newest complete checkpoints, newest by the manifests'
    ``sequence`` (the save order smp records), not by a clock; unnumbered ones (older smp) are
    older than any numbered one and ordered among themselves by ``saved_at``."""
    found = sorted(
        (_sequence(m), m.get("saved_at", 0.0), entry.name, entry) for entry, m in _checkpoints(root)
    )
    for *_, entry in found[: max(0, len(found) - keep)]:
        shutil.rmtree(entry, ignore_errors=True)
        logger.info("smp: removed checkpoint %s (num_kept_partial_checkpoints=%d)", entry, keep)


# ---- resume --------------------------------------------------------------------------------------


def resume_from_checkpoint(
    path: str,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable | None = None,
) -> Any:
    """Resumes from ``path/tag`` (default: the tag ``path/newest`` names) and returns the
    ``user_content`` it was saved with; a collective: every rank calls it.

    The files are checked against the manifest (size, CRC-32C) at once, on every rank. The
    model's and optimizer's state then load as soon as this rank knows its part: now if the
    model is partitioned, else right after the first ``smp.step`` partitions it (as in SMP v1).
    The checkpoint may come from another (pp, tp, dp) layout (``partial=True`` and ``False``
    alike); random states are restored only on the layout that saved them.

    The DistributedOptimizer may be created before or after this call: if none exists over
    the model when the state loads, the optimizer state is held and loaded into the first one
    created (a collective then: every rank creates it, as usual). Nothing in the checkpoint
    runs code: its files are read with ``torch.load(weights_only=True)``; a ``user_content``
    holding a type of your own needs ``torch.serialization.add_safe_globals([YourType])``.

    Args:
        strict: every model key must be in the checkpoint and every checkpoint key in the model.
        load_optimizer: also load the optimizer's state (and the fp16 loss scale). False
            leaves the optimizer's state as it is, or, before the optimizer exists, as it will
            be: fresh, or what an earlier resume held for it.
        load_sharded_optimizer_state: SMP v1's; changes nothing: optimizer state is stored
            by parameter name whichever rank held it (with ``shard_optimizer_state`` each rank
            wrote and loads the parameters it owns), so any rdp degree loads it.
        translate_function: for ``partial=False``, applied to the loaded model state dict
            before it is loaded (e.g. a checkpoint written with other keys); smp's own full
            checkpoints hold the model's keys and need none.

    Raises:
        CheckpointError: no such checkpoint, an incomplete one, a missing, truncated or
            corrupted file, a state that does not match the model (on every rank), or a file
            holding a type ``torch.load(weights_only=True)`` does not load (named).
    """
    state = get_state()
    if state.in_step:
        raise RuntimeError("smp.resume_from_checkpoint is called between steps, not inside one")
    root = Path(path)
    failure: BaseException | None = None
    directory = manifest = None
    try:
        tag = _newest(root) if tag is None else tag
        directory = _locate(root, tag)
        manifest = _complete(directory)
        if manifest is None:
            raise CheckpointError(
                f"checkpoint {directory} is incomplete: {MANIFEST} is missing or unreadable (a "
                "save did not finish); resume from an earlier tag"
            )
        if bool(manifest["partial"]) != bool(partial):
            kind = "partial" if manifest["partial"] else "full"
            raise CheckpointError(
                f"checkpoint {directory} is a {kind} checkpoint; call resume_from_checkpoint "
                f"with partial={bool(manifest['partial'])}"
            )
    except Exception as exc:  # noqa: BLE001 - agreed on below
        failure = exc
    _agree(state, failure, "smp.resume_from_checkpoint")
    _verify(directory, manifest, state)

    user_content = None
    if "user_content.pt" in manifest["files"]:
        file = directory / "user_content.pt"
        user_content = _load_plain(file, f"{file} (the user_content saved)")
    model = _the_model(None, state)
    same_layout = manifest["layout"] == _layout(state)

    def load() -> None:
        # Looked up now, not at the call: the optimizer may be created after it (before the
        # first step), and a deferred load runs at that step.
        optimizer = _optimizer_of(model, state) if load_optimizer else None
        if manifest["partial"]:
            _load_partial(directory, manifest["files"], model, optimizer, strict, state)
        else:
            _load_full(directory, manifest, model, optimizer, strict, translate_function)
        if load_optimizer:  # replaces what an earlier resume held, as it replaces a live state
            held = None
            if optimizer is None and _holds_optimizer_state(directory, manifest):
                held = _HeldOptimizerState(directory, manifest, strict)
            model._smp_held_optimizer_state = held
        if same_layout:
            file = directory / "rng.pt"
            rngs = _load_plain(file, f"{file} (the random states)")
            _set_rng_state(rngs[state.rank])
        elif state.rank == 0:
            logger.info(
                "smp: %s was saved at layout %s, this job is %s: model and optimizer state "
                "resharded; random states start afresh",
                directory,
                manifest["layout"],
                _layout(state),
            )

    if model.partitioned:
        load()
    else:
        model._after_partition.append(load)
    return user_content


def _newest(root: Path) -> str:
    try:
        tag = (root / NEWEST).read_text().strip()
    except OSError:
        found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise CheckpointError(
            f"no checkpoint to resume in {root}: {root / NEWEST} does not exist (directories "
            f"there: {found[:10]}); pass tag= or save a checkpoint first"
        ) from None
    if not tag:
        raise CheckpointError(f"{root / NEWEST} is empty; pass tag=")
    return tag


def _locate(root: Path, tag: str) -> Path:
    directory = root / tag
    if directory.is_dir():
        return directory
    # A save replacing this tag was killed between moving the old copy aside and renaming the
    # new one in: the old copy is whole.
    aside = sorted(root.glob(f".{tag}.replaced-*")) if root.is_dir() else []
    for candidate in aside:
        if _complete(candidate) is not None:
            logger.warning(
                "smp: %s is missing; resuming from its earlier copy %s", directory, candidate
            )
            return candidate
    raise CheckpointError(f"checkpoint {directory} does not exist")


def _verify(directory: Path, manifest: dict, state) -> None:
    """Checks every file against the manifest: sizes on every rank; the checksums of whole
    files spread over the ranks (DCP's data files, checksummed per item, are checked as they
    are read: see smp.checkpoints.dcp._Reader); raises the first problem found on every rank."""
    problems: list[str] = []
    names = sorted(manifest["files"])
    for index, name in enumerate(names):
        expected = manifest["files"][name]
        file = directory / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{file} is missing (the manifest lists it, {expected['bytes']} bytes)")
            continue
        if size != expected["bytes"]:
            problems.append(
                f"{file} is truncated or was changed: {size} bytes, the manifest records "
                f"{expected['bytes']}"
            )
        elif "crc32c" in expected and index % state.world_size == state.rank:
            crc = _digest(file)["crc32c"]
            if crc != expected["crc32c"]:
                problems.append(
                    f"{file} is corrupted: its CRC-32C is {crc:#010x}, the manifest records "
                    f"{expected['crc32c']:#010x}"
                )
    found: list[Any] = [None] * state.world_size
    dist.all_gather_object(found, problems, group=state.groups["world"])
    every = sorted({p for part in found for p in part})
    if every:
        more = f" (and {len(every) - 1} more)" if len(every) > 1 else ""
        raise CheckpointError(f"checkpoint {directory}: {every[0]}{more}")


def _holds_optimizer_state(directory: Path, manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint has optimizer state (one saved while no DistributedOptimizer
    existed has none): ``optimizer.pt`` in a full one, ``optim/`` items in a partial one's DCP
    metadata."""
    if not manifest["partial"]:
        return "optimizer.pt" in manifest["files"]
    from smp.checkpoints.dcp import _Reader

    saved = _Reader(directory, {}).read_metadata().state_dict_metadata
    return any(key.startswith("optim/") for key in saved)


class _HeldOptimizerState:
    """The optimizer part of a checkpoint whose model state loaded while no DistributedOptimizer
    existed over the model: loaded into the first one created
    (``DistributedOptimizer._take_held_state``), exactly as it would have loaded with the model."""

    def __init__(self, directory: Path, manifest: dict[str, Any], strict: bool):
        self.directory, self.manifest, self.strict = directory, manifest, strict

    def untaken(self) -> CheckpointError:
        """The error of a training step that runs while no optimizer took this state (the
        model's ``backward`` raises it, on every rank, before any gradient exists)."""
        return CheckpointError(
            f"checkpoint {self.directory} holds optimizer state, and the model is training with "
            "no smp.DistributedOptimizer having taken it (an optimizer smp does not wrap would "
            "start afresh, silently). Create smp.DistributedOptimizer(...) over the model before "
            "the first training step (before or after resume_from_checkpoint), or resume with "
            "load_optimizer=False to start the optimizer afresh"
        )

    def load_into(self, model, optimizer) -> None:
        """Loads the held state into ``optimizer`` (called by it as it is created, on every
        rank: ``DistributedOptimizer._take_held_state``)."""
        state = get_state()
        if self.manifest["partial"]:
            files = self.manifest["files"]
            _load_partial(self.directory, files, model, optimizer, self.strict, state, False)
        else:
            _load_full_optimizer(self.directory, self.manifest, optimizer)
        if state.rank == 0:
            logger.info(
                "smp: optimizer state of %s loaded into the optimizer created after "
                "resume_from_checkpoint",
                self.directory,
            )


def _load_partial(
    directory: Path,
    files: dict,
    model,
    optimizer,
    strict: bool,
    state,
    with_model: bool = True,
) -> None:
    """Loads the model's (unless ``with_model`` is False) and the optimizer's state (unless
    ``optimizer`` is None) from a partial checkpoint; a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from smp.checkpoints.dcp import _full_size, _LoadPlanner, _Reader

    failure: BaseException | None = None
    try:
        targets = model_entries(model, state) if with_model else {}
        if optimizer is not None:
            materialize_optimizer_state(model, optimizer)
            targets.update(optimizer_entries(model, optimizer, state))
    except Exception as exc:  # noqa: BLE001 - agreed on below
        failure = exc
    _agree(state, failure, f"loading checkpoint {directory}")
    every_model_key = {f"model/{k}" for k in model.module.state_dict()}

    def check(metadata) -> set[str]:
        saved = metadata.state_dict_metadata
        missing = sorted(k for k in targets if k.startswith("model/") and k not in saved)
        unexpected = sorted(k for k in saved if k.startswith("model/") and k not in every_model_key)
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {directory} does not match the model (strict=True): missing keys "
                f"{[k[6:] for k in missing[:5]]}, unexpected keys {[k[6:] for k in unexpected[:5]]}"
            )
        wrong, skipped = [], set()
        for key in targets:
            md = saved.get(key)
            if md is None:
                skipped.add(key)  # not in the checkpoint: stays as it is
                continue
            size = _full_size(targets[key])
            if isinstance(md, BytesStorageMetadata) != (size is None):
                wrong.append(f"{key}: saved as {type(md).__name__}")
            elif size is not None and md.size != size:
                wrong.append(f"{key}: saved {tuple(md.size)}, this model {tuple(size)}")
        if wrong:
            raise CheckpointError(
                f"checkpoint {directory} does not match the model: {'; '.join(wrong[:5])}"
            )
        return skipped

    planner = _LoadPlanner(check)
    ranges = {
        name: {offset: (length, crc) for offset, length, crc in digest["ranges"]}
        for name, digest in files.items()
        if "ranges" in digest
    }
    reader = _Reader(directory, ranges)
    try:
        dcp.load(
            targets, storage_reader=reader, planner=planner, process_group=state.groups["world"]
        )
    except dcp.CheckpointException as exc:
        if reader.metadata_error is not None:  # every rank reads the same .metadata
            raise CheckpointError(str(reader.metadata_error)) from exc
        rank, error = min(exc.failures.items(), key=lambda item: item[0])
        if isinstance(error, CheckpointError):
            raise CheckpointError(str(error)) from exc
        raise CheckpointError(
            f"loading checkpoint {directory} failed on rank {rank}: {type(error).__name__}: {error}"
        ) from exc
    loaded = set(targets) - planner.skipped
    # Float32 master weights follow the loaded model, except those the checkpoint held.
    # (Under shard_optimizer_state a rank loads only the masters it owns: the others are
    # overwritten by their owners' broadcast at the next step.)
    held = set()
    for name, p in stateful_params(model, optimizer) if optimizer is not None else ():
        if f"optim/{name}/{MASTER_KEY}" in loaded:
            held.add(id(optimizer.model_parameter(p)))
    if with_model:
        model._refresh_masters(except_for=held)
    if optimizer is None:
        return
    for name, p in owned_optimizer_params(model, optimizer):
        saved = [k for k in loaded if k.startswith(f"optim/{name}/")]
        if not [k for k in saved if k != f"optim/{name}/{MASTER_KEY}"]:
            optimizer.state.pop(p, None)  # no state saved for it: as a fresh optimizer has
    groups = targets.get("optim/param_groups")
    if isinstance(groups, list):
        _load_groups(optimizer, groups, directory)
    scaler = getattr(optimizer, "_smp_scaler", None)
    if scaler is not None and isinstance(targets.get("optim/loss_scaler"), dict):
        scaler.load_state_dict(targets["optim/loss_scaler"])
        state.loss_scale = scaler.scale


def _load_groups(optimizer, saved: list[dict], directory: Path) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {directory}: the optimizer was saved with {len(saved)} parameter "
            f"group(s), this one has {len(optimizer.param_groups)}"
        )
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


def _load_full(directory: Path, manifest: dict, model, optimizer, strict: bool, translate) -> None:
    file = directory / "model.pt"
    full = _load_plain(file, f"{file} (the model state)", map_location="cpu")
    if translate is not None:
        full = translate(full)
    model.load_state_dict(full, strict=strict)
    if optimizer is not None:
        _load_full_optimizer(directory, manifest, optimizer)


def _load_full_optimizer(directory: Path, manifest: dict, optimizer) -> None:
    if "optimizer.pt" in manifest["files"]:
        file = directory / "optimizer.pt"
        optimizer.load_state_dict(_load_plain(file, f"{file} (the optimizer state)"))
