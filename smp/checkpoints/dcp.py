"""smp's glue to torch.distributed.checkpoint (DCP), imported only when a checkpoint is saved or
loaded: tensor-parallel shards described to DCP's planners as the chunks of the full tensor they
are, and a file-system writer that records each file's size and CRC-32C
(smp.checkpoints.integrity); a reader that checks them and runs no code from the checkpoint
(DCP's own unpickles ``.metadata`` and its byte items with plain pickle)."""

from __future__ import annotations

import io
import mmap
import os
import pathlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint import metadata as _metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)
from torch.futures import Future

from smp.checkpoints.integrity import CheckpointError, _crc, _digest, _load_plain

# ---- tensor-parallel shards as DCP chunks --------------------------------------------------------


@dataclass
class _Chunks:
    """This rank's pieces of a tensor split over the TP group: ``pieces[i]`` (a view of the
    rank's shard) sits at ``offsets[i]`` in the full tensor of shape ``size``. A fused split
    (e.g. Q, K and V in one matrix) gives one piece per fused block."""

    size: torch.Size
    offsets: list[torch.Size]
    pieces: list[torch.Tensor]

    @classmethod
    def of(cls, local: torch.Tensor, split: tuple[int, int], n: int, r: int) -> _Chunks:
        dim, fused = split
        full = list(local.shape)
        full[dim] *= n
        rows = local.size(dim) // fused  # this rank's rows of one fused block
        offsets, pieces = [], []
        for block in range(fused):
            offset = [0] * local.dim()
            offset[dim] = block * (full[dim] // fused) + r * rows
            offsets.append(torch.Size(offset))
            pieces.append(local.narrow(dim, block * rows, rows))
        return cls(torch.Size(full), offsets, pieces)

    @classmethod
    def of_rows(
        cls,
        local: torch.Tensor,
        row: int,
        whole: torch.Size,
        split: tuple[int, int] | None,
        n: int,
        r: int,
    ) -> _Chunks:
        """Rows ``[row, row + len(local))`` of a tensor of shape ``whole`` (a sharded data
        parallel chunk, design.md §7.5), that tensor being this TP rank's shard (``split``) of
        the full one, or the full one itself (``split`` None)."""
        if split is None:
            split, n, r = (0, 1), 1, 0
        dim, fused = split
        full = list(whole)
        full[dim] *= n
        block_rows = whole[dim] // fused  # this TP rank's rows of one fused block
        offsets, pieces = [], []
        for block in range(fused):
            offset = [0] * len(whole)
            offset[dim] = block * (full[dim] // fused) + r * block_rows
            if dim == 0:  # the block's rows that fall in this chunk
                lo = max(block * block_rows, row)
                hi = min((block + 1) * block_rows, row + local.size(0))
                if hi <= lo:
                    continue
                offset[0] += lo - block * block_rows
                piece = local.narrow(0, lo - row, hi - lo)
            else:
                if local.size(0) == 0:
                    continue
                offset[0] = row
                piece = local.narrow(dim, block * block_rows, block_rows)
            offsets.append(torch.Size(offset))
            pieces.append(piece)
        return cls(torch.Size(full), offsets, pieces)

    def write_items(self, fqn: str) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offset),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=piece.size()),
                    properties=TensorProperties.create_from_tensor(piece),
                    size=self.size,
                ),
            )
            for offset, piece in zip(self.offsets, self.pieces)
        ]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(o, p.size()) for o, p in zip(self.offsets, self.pieces)]


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner (deduplication, global metadata, validation that the chunks of
    every tensor tile it exactly), told about :class:`_Chunks`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            items += (
                obj.write_items(fqn) if isinstance(obj, _Chunks) else _create_write_items(fqn, obj)
            )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, _Chunks):
            return obj.pieces[obj.offsets.index(write_item.index.offset)].detach()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads into this rank's tensors (and :class:`_Chunks`) whatever saved pieces overlap them.
    ``check(metadata)`` first raises the mismatches it finds (DCP reports a failure on any rank
    to every rank) and returns the keys to leave alone (not in the checkpoint)."""

    def __init__(self, check: Callable[[Any], set[str]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._check = check
        self.skipped: set[str] = set()

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # As DefaultLoadPlanner's, without its pass over the values (it would deep-copy a
        # _Chunks, whose pieces must stay views of this rank's tensors).
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        self.skipped = self._check(self.metadata)
        items = []
        saved = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            if fqn in self.skipped:
                continue
            md = saved[fqn]
            if isinstance(obj, _Chunks):
                items += create_read_items_for_chunk_list(fqn, md, obj.chunks())
            else:
                items += _create_read_items(fqn, md, obj)
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        obj = self.state_dict[read_item.dest_index.fqn]
        if isinstance(obj, _Chunks):
            piece = obj.pieces[read_item.dest_index.index]
            return _narrow(piece, read_item.dest_offsets, read_item.lengths)
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DCP's own uses torch.load(weights_only=False); smp's byte items are plain values.
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = _load_plain(value, f"checkpoint item {fqn!r}")


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The box of ``tensor`` at ``offsets`` with ``lengths`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _full_size(obj: Any) -> torch.Size | None:
    if isinstance(obj, _Chunks):
        return obj.size
    return obj.size() if isinstance(obj, torch.Tensor) else None


class _Writer(dcp.FileSystemWriter):
    """DCP's file-system writer that also records, for every data file it wrote, its size and
    the CRC-32C of each item's byte range (the items tile the file), read back from the page
    cache once the file is fsync'd; and the size and CRC-32C of the ``.metadata`` file."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.digests: dict[str, dict[str, Any]] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        spans: dict[str, list[tuple[int, int]]] = {}
        for result in future.value():
            info = result.storage_data
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        for name, items in sorted(spans.items()):
            self.digests[name] = _range_digest(Path(self.path) / name, sorted(items))
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self.digests[".metadata"] = _digest(Path(self.path) / ".metadata")


def _range_digest(path: Path, items: list[tuple[int, int]]) -> dict[str, Any]:
    """``{"bytes": size, "ranges": [[offset, length, crc32c], ...]}`` over the whole file: the
    items' ranges, and any bytes between or after them as ranges of their own."""
    ranges = []
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        position = 0
        for offset, length in [*items, (size, 0)]:
            for start, count in ((position, offset - position), (offset, length)):
                if count > 0:
                    f.seek(start)
                    ranges.append([start, count, _crc(f, count)])
            position = max(position, offset + length)
    return {"bytes": size, "ranges": ranges}


# What DCP's ``.metadata`` pickle may name (a checkpoint's pickle can name any callable; these
# are the classes DCP writes there), besides torch's dtypes.
_METADATA_GLOBALS = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        Metadata,
        _metadata.TensorStorageMetadata,
        _metadata.BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        _metadata.StorageMeta,
        _metadata._MEM_FORMAT_ENCODING,
        _filesystem._StorageInfo,
        torch.Size,
        pathlib.PurePosixPath,
        pathlib.PosixPath,
    )
}
_METADATA_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
for _cls in (pathlib.PurePosixPath, pathlib.PosixPath):  # pickled under "pathlib" too
    _METADATA_GLOBALS[("pathlib", _cls.__name__)] = _cls


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, refusing every global but :data:`_METADATA_GLOBALS` and
    torch's dtypes: loading a checkpoint runs no code from it."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None and module == "torch":  # a dtype: torch.float32 pickles as one
            dtype = getattr(torch, name, None)
            found = dtype if isinstance(dtype, torch.dtype) else None
        if found is None:
            raise CheckpointError(
                f"refused the global {module}.{name}: DCP's metadata holds only its own classes "
                "(smp loads no code from a checkpoint); this file was not written by "
                "smp.save_checkpoint"
            )
        return found


class _Reader(dcp.FileSystemReader):
    """DCP's file-system reader that checks each item's bytes against the CRC-32C the manifest
    recorded for that range as it reads them (so a checkpoint is verified in the same pass
    that loads it), then deserializes them as DCP's own reader does; the ``.metadata`` file
    through :class:`_MetadataUnpickler` (DCP's own reader uses plain pickle)."""

    def __init__(self, path: Path, ranges: dict[str, dict[int, tuple[int, int]]]):
        super().__init__(path)
        self._ranges = ranges  # file -> {offset: (length, crc32c)}
        # Why .metadata was refused (DCP reports a failed read_metadata as "metadata is None").
        self.metadata_error: Exception | None = None

    def read_metadata(self) -> Metadata:  # no rank=: smp writes one global .metadata
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointError as exc:
                self.metadata_error = CheckpointError(f"{path}: {exc}")
                raise self.metadata_error from None
        if not isinstance(metadata, Metadata):
            self.metadata_error = CheckpointError(
                f"{path} holds a {type(metadata).__name__}, not DCP's Metadata"
            )
            raise self.metadata_error
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        from smp import _C

        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            path = Path(self.path) / name
            infos = [self.storage_data[item.storage_index] for item in items]
            if any(info.transform_descriptors for info in infos) or name not in self._ranges:
                raise CheckpointError(f"{path} was not written by smp.save_checkpoint")
            ranges = self._ranges[name]
            order = sorted(range(len(items)), key=lambda i: infos[i].offset)
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                checked: set[int] = set()
                for i in order:
                    item, info = items[i], infos[i]
                    if info.offset not in checked:  # in place, no copy: the bytes torch.load reads
                        expected = ranges.get(info.offset)
                        piece = memoryview(mapped)[info.offset : info.offset + info.length]
                        crc = _C.crc32c(piece)
                        piece.release()
                        if expected != (info.length, crc):
                            raise CheckpointError(
                                f"{path} is corrupted: bytes {info.offset}-"
                                f"{info.offset + info.length} have CRC-32C {crc:#010x}, the "
                                f"manifest records "
                                f"{'none' if expected is None else f'{expected[1]:#010x}'}"
                            )
                        checked.add(info.offset)
                    self._deliver(item, self._slice_file(f, info), planner)
        future: Future = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _deliver(item, stream, planner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = _narrow(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"{item.storage_index}: {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
