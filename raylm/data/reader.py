"""Worker-side random access to tokenized samples by global id, and read-ahead.

Each rank reads exactly the ids its sampler assigns, so the data a step sees depends only on
the ids, not on Ray Data's scheduling: this is what lets a run resume, or continue on a
different number of workers, with the same sample order.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raylm.data.images import read_shard
from raylm.data.sources import filesystem_for
from raylm.data.stream import sample_ids
from raylm.data.tokenized import TokenizedDataset

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip
PAD_ID = -1  # a sample id that reads as a filler row: no labels, so no loss and no gradient


class _ShardReader:
    """Random access by global sample id to a dataset stored as shards of consecutive ids
    (``shard_files``, ``shard_offsets``, ``num_samples``): a shard is loaded whole on first
    use (``_load``) and kept, so later reads are numpy fancy indexing."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._offsets = np.asarray(dataset.shard_offsets, dtype=np.int64)
        self._shards: dict = {}
        self._lock = threading.Lock()  # the Prefetcher's thread and the caller may both read

    def _locate(self, ids) -> tuple:
        """(ids as int64, which are PAD_ID, each id's shard (-1 for a pad)); an id out of
        range is an IndexError."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pad = ids == PAD_ID
        real = ids[~pad]
        if len(real) and (real.min() < 0 or real.max() >= self.dataset.num_samples):
            bad = real[(real < 0) | (real >= self.dataset.num_samples)][0]
            raise IndexError(f"sample id {bad} out of range 0..{self.dataset.num_samples - 1}")
        shard_of = np.searchsorted(self._offsets, ids, side="right") - 1
        shard_of[pad] = -1
        return ids, pad, shard_of

    def _rows(self, ids, shard_of):
        """(the rows of each shard touched, the shard's arrays, the rows' local indices):
        one numpy gather per shard, not one Python step per row."""
        for shard in np.unique(shard_of[shard_of >= 0]):
            rows = shard_of == shard
            yield rows, self._shard(int(shard)), ids[rows] - self._offsets[shard]

    def _shard(self, index: int):
        shard = self._shards.get(index)
        if shard is None:
            with self._lock:
                shard = self._shards.get(index)
                if shard is None:
                    shard = self._shards[index] = self._load(self.dataset.shard_files[index])
        return shard

    def _load(self, path: str):
        raise NotImplementedError


class BlockReader(_ShardReader):
    """Reads samples by id from a TokenizedDataset's shards.

    A shard is loaded whole on first use (memory-mapped parquet for local files, pyarrow's
    filesystem for URIs) and kept as a ``[rows, block_size]`` int32 array, so later reads
    are numpy fancy indexing.
    """

    def __init__(self, dataset: TokenizedDataset):
        super().__init__(dataset)
        self.block_size = dataset.block_size

    def read(self, ids: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """Rows for ``ids``: input_ids, labels, attention_mask, and the ids themselves
        (``sample_ids``, for objectives that draw per sample). An id of PAD_ID gives a
        filler row (token 0, attended to like any row so attention stays finite, every
        label IGNORE_INDEX). Pipeline schedules need equal micro-batches; fillers make an
        epoch's short last step one."""
        ids, pad, shard_of = self._locate(ids)
        input_ids = np.zeros((len(ids), self.block_size), dtype=np.int32)
        lengths = np.full(len(ids), self.block_size, dtype=np.int32)
        for rows, (tokens, shard_lengths), local in self._rows(ids, shard_of):
            input_ids[rows] = tokens[local]
            lengths[rows] = shard_lengths[local]
        return _batch(ids, input_ids, lengths, pad, self.block_size)

    def _load(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        fs, fs_path = filesystem_for(path)
        # (ParquetFile: pq.read_table goes through pyarrow.dataset, which imports pandas)
        columns = ["input_ids", "length"]
        if isinstance(fs, pafs.LocalFileSystem):
            table = pq.ParquetFile(fs_path, memory_map=True).read(columns=columns)
        else:
            with fs.open_input_file(fs_path) as f:
                table = pq.ParquetFile(f).read(columns=columns)
        column = table.column("input_ids").combine_chunks()
        # flatten() honours the list offsets; every list is block_size long by construction.
        values = _integers(column.flatten())
        if len(values) != table.num_rows * self.block_size:
            raise ValueError(f"{path}: rows are not all {self.block_size} tokens long")
        tokens = np.ascontiguousarray(values.reshape(table.num_rows, self.block_size))
        lengths = _integers(table.column("length").combine_chunks()).astype(np.int32,
                                                                          copy=False)
        return tokens, lengths


def _integers(array) -> np.ndarray:
    """An Arrow integer array as numpy, zero-copy where it has no nulls. By hand from its
    values buffer: pyarrow's Array.to_numpy (and np.asarray of an Array) import pandas at
    their first use, which took 0.2-0.35 s of each rank's first step on the 2-core
    development machine (the cache's columns are plain int32, never null)."""
    if array.null_count or not pa.types.is_integer(array.type):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(str(array.type))
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


class StreamReader:
    """Reads streamed samples by id (raylm.data.stream) from the Ray Data blocks the
    driver names with each step (``hold``): a block is fetched from the object store on
    first use (zero-copy on its own node) and dropped once neither of the last two
    steps' lists names it."""

    def __init__(self, spec):
        self.block_size = spec.block_size
        self._refs: dict = {}      # hex -> ObjectRef, of the blocks held
        self._loaded: dict = {}    # hex -> (sorted ids, their rows, tokens, lengths)
        self._last: set = set()
        self._lock = threading.Lock()

    def hold(self, refs: list) -> None:
        keys = {r.hex(): r for r in refs}
        with self._lock:
            keep = set(keys) | self._last
            self._refs = {k: r for k, r in {**self._refs, **keys}.items() if k in keep}
            self._loaded = {k: v for k, v in self._loaded.items() if k in keep}
            self._last = set(keys)

    def read(self, ids: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pad = ids == PAD_ID
        input_ids = np.zeros((len(ids), self.block_size), dtype=np.int32)
        lengths = np.full(len(ids), self.block_size, dtype=np.int32)
        missing = ~pad
        with self._lock:
            keys = list(self._refs)
        for key in keys:
            if not missing.any():
                break
            sorted_ids, rows, tokens, block_lengths = self._block(key)
            want = ids[missing]
            at = np.clip(np.searchsorted(sorted_ids, want), 0, len(sorted_ids) - 1)
            hit = sorted_ids[at] == want
            if hit.any():
                where = np.flatnonzero(missing)[hit]
                input_ids[where] = tokens[rows[at[hit]]]
                lengths[where] = block_lengths[rows[at[hit]]]
                missing[where] = False
        if missing.any():
            raise KeyError(f"sample {int(ids[missing][0])} is in none of the blocks the "
                           "driver sent with this step")
        return _batch(ids, input_ids, lengths, pad, self.block_size)

    def _block(self, key: str):
        import ray

        with self._lock:
            block = self._loaded.get(key)
            ref = self._refs.get(key)
        if block is not None:
            return block
        table = ray.get(ref)
        ids = sample_ids(_integers(table.column("piece").combine_chunks()),
                         _integers(table.column("seq").combine_chunks()))
        values = _integers(table.column("input_ids").combine_chunks().flatten())
        tokens = values.reshape(table.num_rows, self.block_size)
        order = np.argsort(ids, kind="stable")
        block = (ids[order], order, tokens,
                 _integers(table.column("length").combine_chunks()).astype(np.int32,
                                                                          copy=False))
        with self._lock:
            if key in self._refs:
                self._loaded[key] = block
        return block


def make_reader(dataset):
    """The reader of a TokenizedDataset (the cache), a StreamSpec (--streaming) or an
    ImageDataset (raylm.data.images)."""
    if getattr(dataset, "images", False):
        return ImageReader(dataset)
    if getattr(dataset, "streaming", False):
        return StreamReader(dataset)
    return BlockReader(dataset)


def _batch(ids: np.ndarray, input_ids: np.ndarray, lengths: np.ndarray, pad: np.ndarray,
           block_size: int) -> dict[str, torch.Tensor]:
    input_ids_t = torch.from_numpy(input_ids).long()
    attention_mask = torch.arange(block_size) < torch.from_numpy(lengths).long()[:, None]
    labels = input_ids_t.masked_fill(~attention_mask, IGNORE_INDEX)
    if pad.any():
        labels[torch.from_numpy(pad)] = IGNORE_INDEX
    # sample_ids: PAD_ID for filler rows; a copy, as ids may be a read-only array
    # Ray passed.
    return {"input_ids": input_ids_t, "labels": labels,
            "attention_mask": attention_mask.long(), "sample_ids": torch.tensor(ids)}


class Prefetcher:
    """Reads the next steps' microbatches in a background thread while the model computes.

    ``submit(key, ids)`` starts reading; ``get(key, ids)`` returns the result, or reads now
    when that key was not submitted (or with other ids, e.g. after the plan changed). At
    most ``depth`` submitted reads are kept: submitting more drops the oldest.
    """

    def __init__(self, reader: BlockReader, depth: int = 2, prepare=None):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.reader = reader
        self.depth = depth
        # prepare(key, batch): more work on a submitted read's batches in the same thread
        # (the engine's objective split: masked LM's and span corruption's draws).
        self.prepare = prepare
        # One thread: reads are memory-bound numpy work and come in step order.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-prefetch")
        self._pending: collections.OrderedDict[Hashable, tuple[list[np.ndarray], Future]] = (
            collections.OrderedDict())

    def submit(self, key: Hashable, ids_per_microbatch: list) -> None:
        if key in self._pending:
            return
        ids = [np.asarray(m, dtype=np.int64) for m in ids_per_microbatch]
        self._pending[key] = (ids, self._pool.submit(self._read_all, ids, key))
        while len(self._pending) > self.depth:
            _, (_, future) = self._pending.popitem(last=False)
            future.cancel()

    def get(self, key: Hashable, ids_per_microbatch: list) -> list[dict[str, torch.Tensor]]:
        ids = [np.asarray(m, dtype=np.int64) for m in ids_per_microbatch]
        pending = self._pending.pop(key, None)
        if pending is not None:
            submitted, future = pending
            same = len(submitted) == len(ids) and all(
                np.array_equal(a, b) for a, b in zip(submitted, ids))
            if same:
                return future.result()  # re-raises a read error here, in the caller
            future.cancel()
        return self._read_all(ids)

    def close(self) -> None:
        for _, future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def _read_all(self, ids: list[np.ndarray], key=None) -> list[dict[str, torch.Tensor]]:
        batches = [self.reader.read(m) for m in ids]
        if key is not None and self.prepare is not None:
            for b in batches:
                self.prepare(key, b)
        return batches

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ImageReader(_ShardReader):
    """Reads decoded images (an ImageDataset: raylm.data.images) by sample id:
    ``pixel_values`` (uint8, [B, C, H, W]), ``labels`` (int64; IGNORE_INDEX for a PAD_ID
    filler row, whose pixels are 0) and ``sample_ids``."""

    def read(self, ids: Sequence[int] | np.ndarray) -> dict:
        d = self.dataset
        ids, pad, shard_of = self._locate(ids)
        pixels = np.zeros((len(ids), d.image_size, d.image_size, d.channels), dtype=np.uint8)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        for rows, (data, shard_labels), local in self._rows(ids, shard_of):
            pixels[rows] = data[local]
            labels[rows] = shard_labels[local]
        return {"pixel_values": torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(),
                "labels": torch.from_numpy(labels),
                "sample_ids": torch.from_numpy(ids.copy())}

    def _load(self, path: str):
        d = self.dataset
        table = read_shard(path)  # (memory-mapped: the pixels stay in the page cache)
        column = table.column("pixels")
        # (one record batch per shard; combine_chunks would copy even a single chunk)
        raw = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        # a fixed_size_binary column's buffer is the rows' bytes back to back
        flat = np.frombuffer(raw.buffers()[1], dtype=np.uint8,
                             count=len(raw) * d.block_size, offset=raw.offset * d.block_size)
        data = flat.reshape(len(raw), d.image_size, d.image_size, d.channels)
        return data, table.column("label").to_numpy().astype(np.int64)
