"""The layout-free checkpoint form kept in Ray's object store instead of files.

A rank's state goes through torch.distributed.checkpoint exactly as a checkpoint does
(raylm.checkpoint.state: parameter names, the model's own shapes, DTensor chunks with
their global offsets); only the storage differs. DCP has file-system and fsspec storage,
none that keeps the chunks in memory on the rank that wrote them and lets another
process on another node read them: ``ObjectStoreWriter`` puts each chunk in Ray's object
store (owned by the writing rank, so it lives while that rank lives) and
``ObjectStoreReader`` reads a new layout's chunks from there. DCP's planner does the
resharding (any layout to any other), as it does from a checkpoint on disk.

How it is used (raylm.runtime): after a failure every surviving rank writes its state
on its own (``no_dist``: its process group is broken); the driver merges what the
survivors wrote (``merge``: one entry per chunk, listing every live holder of it); the
ranks of the new layout read their chunks from a holder on their own node when there is
one, else spread over the holders.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import ray
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future


# Chunks go into objects of about this size: one ray.put per chunk costs more than the
# copy for the many small tensors of a model (biases, norms, AdamW's step counters).
BUCKET_BYTES = 32 * 2**20


class ObjectStoreWriter(StorageWriter):
    """DCP storage that ``ray.put``s the chunks (tensors, or the bytes of non-tensor
    values) in buckets of about BUCKET_BYTES; after ``dcp.save`` the writer's
    ``metadata`` lists the chunks and ``metadata.storage_data`` maps each chunk's
    MetadataIndex to (ObjectRef of its bucket, its key in the bucket).

    Every bucket is packed (copied out of the state's tensors) before the first put, and
    ``on_copied()`` called in between: a snapshot written in a thread of its own lets
    the rank's next optimizer step wait for that only (raylm.runtime.snapshots), with
    one copy of the state, where staging it first (DCP's async_save) would add one."""

    def __init__(self, on_copied=None):
        super().__init__()
        self.metadata = None
        self.on_copied = on_copied

    def reset(self, checkpoint_id=None) -> None:
        self.metadata = None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        packed, bucket, pending, filled = [], [], [], 0

        def pack():
            packed.append((_pack(bucket), pending))

        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                value = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                size = len(value)
            else:
                value = data.detach()
                size = value.numel() * value.element_size()
            bucket.append(value)
            pending.append((item.index, size))
            filled += size
            if filled >= BUCKET_BYTES:
                pack()
                bucket, pending, filled = [], [], 0
        if pending:
            pack()
        if self.on_copied is not None:
            self.on_copied()
        results = []
        for values, chunks in packed:
            ref = ray.put(values)
            results.extend(WriteResult(index=index, size_in_bytes=size,
                                       storage_data=(ref, key))
                           for key, (index, size) in enumerate(chunks))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        self.metadata = metadata

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return checkpoint_id is None


class ExportPlanner(DefaultSavePlanner):
    """DCP's planner, remembering the serialised form of non-tensor values: a flattened
    optimizer state has a handful of settings per parameter (lr, betas, eps, ...), which
    DCP serialises with torch.save one by one at every save, most of an export's time
    for a small model; they rarely change between exports. Keyed by (key, repr)."""

    def __init__(self):
        super().__init__()
        self.serialised: dict = {}

    def transform_object(self, write_item, object):
        if write_item.type != WriteItemType.BYTE_IO:
            return object
        key = (write_item.index.fqn, type(object).__name__, repr(object))
        data = self.serialised.get(key)
        if data is None:
            buf = io.BytesIO()
            torch.save(object, buf)
            data = self.serialised[key] = buf.getvalue()
        return io.BytesIO(data)


@dataclass
class MemoryState:
    """The state of a whole run in the object store: DCP metadata over every chunk and,
    per chunk, its holders [(ObjectRef, node id)]; the committed ``step`` it is at."""

    metadata: Metadata
    # MetadataIndex -> [((ObjectRef of a bucket, key in it), node_id)]
    holders: dict = field(default_factory=dict)
    step: int = 0

    def nbytes(self) -> int:
        return sum(_chunk_bytes(md, c) for md in self.metadata.state_dict_metadata.values()
                   if isinstance(md, TensorStorageMetadata) for c in md.chunks)


def merge(exports: list) -> MemoryState:
    """One MemoryState from what several ranks wrote (each ``{"metadata", "node_id",
    "step"}``, all at one step): a chunk that several ranks hold (data-parallel
    replicas) is listed once, with every holder."""
    steps = {e["step"] for e in exports}
    if len(steps) != 1:
        raise ValueError(f"the ranks' states are at different steps: {sorted(steps)}")
    sd_md, planner_data, holders = {}, {}, {}
    known: dict = {}  # key -> the offsets of its chunks listed so far (linear in chunks:
    # under ZeRO each dp rank holds chunks of its own, dp of them to a tensor)
    for e in exports:
        md = e["metadata"]
        planner_data.update(md.planner_data or {})
        for key, value in md.state_dict_metadata.items():
            if isinstance(value, BytesStorageMetadata):
                sd_md.setdefault(key, value)
                continue
            have = sd_md.get(key)
            if have is None:
                sd_md[key] = have = TensorStorageMetadata(value.properties, value.size, [])
                known[key] = set()
            elif tuple(have.size) != tuple(value.size):
                raise ValueError(f"{key}: global shape {tuple(value.size)} here, "
                                 f"{tuple(have.size)} on another rank")
            seen = known[key]
            for c in value.chunks:
                if tuple(c.offsets) not in seen:
                    seen.add(tuple(c.offsets))
                    have.chunks.append(c)
        for index, ref in md.storage_data.items():
            holders.setdefault(MetadataIndex(index.fqn, index.offset), []).append(
                (ref, e["node_id"]))
    return MemoryState(Metadata(state_dict_metadata=sd_md, planner_data=planner_data),
                       holders, steps.pop())


def uncovered(state: MemoryState) -> list:
    """Keys whose chunks do not add up to the whole tensor (no live copy of a part)."""
    out = []
    for key, md in state.metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            whole = int(torch.Size(md.size).numel())
            if sum(_chunk_bytes(None, c) for c in md.chunks) != whole:
                out.append(key)
    return out


class ObjectStoreReader(StorageReader):
    """DCP storage reading a MemoryState: each chunk from a holder on ``node_id`` when
    there is one, else from holder ``spread`` modulo their number (ranks pass their
    rank, which spreads the reads over the replicas)."""

    def __init__(self, state: MemoryState, node_id: str, spread: int = 0):
        super().__init__()
        self.state, self.node_id, self.spread = state, node_id, spread
        self.fetched = {"local": 0, "remote": 0}  # chunks read, by where the holder was
        self.buckets: dict = {}  # ObjectRef -> the bucket, fetched once

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        md = self.state.metadata
        md.storage_data = {}  # chunk -> holder is this reader's choice (_holder)
        return md

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _holder(self, index: MetadataIndex):
        holders = self.state.holders[MetadataIndex(index.fqn, index.offset)]
        local = [ref for ref, node in holders if node == self.node_id]
        self.fetched["local" if local else "remote"] += 1
        return local[0] if local else holders[self.spread % len(holders)][0]

    def read_data(self, plan, planner) -> Future:
        by_chunk: dict = {}
        for item in plan.items:
            by_chunk.setdefault(MetadataIndex(item.storage_index.fqn,
                                              item.storage_index.offset), []).append(item)
        for index, items in by_chunk.items():
            ref, key = self._holder(index)
            if ref not in self.buckets:
                self.buckets[ref] = _unpack(ray.get(ref))
            value = self.buckets[ref][key]
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(value))
                    continue
                src = value
                for dim, (start, length) in enumerate(zip(item.storage_offsets,
                                                          item.lengths)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise AssertionError(f"{item.storage_index}: chunk {tuple(src.size())}"
                                         f", target {tuple(target.size())}")
                target.copy_(src)
                planner.commit_tensor(item, target)
        self.buckets = {}
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return checkpoint_id is None


def _pack(values: list) -> tuple:
    """A bucket as one object Ray serialises with a single copy: the tensors' bytes in
    one flat uint8 array (each at an offset aligned for any dtype) with ("tensor",
    offset, dtype, shape) entries, the non-tensor values as ("bytes", value). (A list of
    tensors is pickled tensor by tensor: several times slower for a model's many small
    ones.)"""
    layout, total = [], 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total = -(-total // 64) * 64
            layout.append(("tensor", total, v.dtype, tuple(v.shape)))
            total += v.numel() * v.element_size()
        else:
            layout.append(("bytes", v))
    flat = torch.empty(total, dtype=torch.uint8)
    for v, entry in zip(values, layout):
        if entry[0] == "tensor" and v.numel():
            offset, n = entry[1], v.numel() * v.element_size()
            flat[offset:offset + n].view(v.dtype).copy_(v.reshape(-1))
    return layout, flat.numpy()


def _unpack(packed: tuple) -> list:
    """The values of a bucket: tensors as views of the fetched array (read only: the
    reader copies them into its own)."""
    import warnings

    layout, flat = packed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch on a read-only array: never written here
        data = torch.from_numpy(flat)
    out = []
    for entry in layout:
        if entry[0] == "tensor":
            _, offset, dtype, shape = entry
            n = int(torch.Size(shape).numel()) * torch.tensor([], dtype=dtype).element_size()
            out.append(data[offset:offset + n].view(dtype).view(shape))
        else:
            out.append(entry[1])
    return out


def _chunk_bytes(md, chunk) -> int:
    n = int(torch.Size(chunk.sizes).numel())
    if md is None:
        return n
    return n * torch.tensor([], dtype=md.properties.dtype).element_size()
