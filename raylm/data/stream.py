"""--streaming: Ray Data tokenizes the pieces of the corpus while training runs, and the
ranks read the blocks it produces straight from Ray's object store.

The order is a pure function of the seed and the pieces, never of the cluster:

- epoch e visits the pieces (raylm.data.pieces) in a seeded permutation (seed, e);
- Ray Data tokenizes them in that order (``preserve_order``: its output is in input
  order however many tasks run), so the epoch's samples form one deterministic stream;
- the stream is cut into windows of ``window`` samples, and each window is shuffled with
  a generator seeded by (seed, e, where the window starts): a bounded shuffle, like
  ``datasets``' ``IterableDataset.shuffle(buffer_size)``, but reproducible from the
  window's start alone;
- the driver numbers the windows' samples with global positions, epoch after epoch, and
  step k trains on positions [k*B, (k+1)*B) of that sequence; each data-parallel rank
  gets its share of those, as with the cache (raylm.data.sampler).

So a layout, a resize or a resume changes nothing in the order. A sample's id is
``piece << 32 | row in the piece``: the same sample has the same id on every run.

Token arrays are not sent through the driver: it keeps Ray Data's block references, and
each rank gets, with its step, the references of the blocks its samples are in and
fetches them from the object store (raylm.data.reader.StreamReader). The driver reads
each block's two id columns: in place when the block is in the driver's node's
object store (zero-copy), by a small task on the node that holds it otherwise, so a block
made on another node goes only to the ranks that train on it.

Resuming: the position of a window's start is compact (epoch, index of its piece in the
epoch's order, row in that piece), and a checkpoint records it for the window the next
step reads from. Resuming restarts Ray Data at that piece, so what is re-read is at
most one window and the piece it begins in, never the epoch's trained part.

Memory: the driver holds the windows from the last step to the one read ahead (two or
three windows), Ray Data at most ``buffer_mb`` of finished blocks waiting to be taken
(its object-store budget, after which it pauses its tasks).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from raylm.data.pieces import Piece
from raylm.errors import ConfigError

log = logging.getLogger("raylm")

DEFAULT_WINDOW = 1000  # samples per shuffle window (datasets' default buffer_size)
DEFAULT_BUFFER_MB = 256  # Ray Data's budget for finished blocks waiting for the trainer
PIECE_SHIFT = 32
# A streaming task hands Ray Data a table per this much text, and Ray Data cuts its
# output into blocks of at most STREAM_BLOCK_BYTES: blocks reach the trainer while their
# piece is still being tokenized (Ray Data's default, 128 MiB blocks, would hold a piece's
# samples back until the whole piece is done).
STREAM_CHUNK_BYTES = 256 << 10
STREAM_BLOCK_BYTES = 1 << 20
ROW_MASK = (1 << PIECE_SHIFT) - 1


class DataStreamError(ConfigError):
    """A piece failed to read or tokenize mid-stream (the message names the file and
    where in it). The driver saves the steps trained so far before it stops."""


def sample_ids(piece: np.ndarray, seq: np.ndarray) -> np.ndarray:
    return (piece.astype(np.int64) << PIECE_SHIFT) | seq.astype(np.int64)


def piece_order(num_pieces: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order epoch ``epoch`` reads the pieces in."""
    if not shuffle:
        return np.arange(num_pieces)
    return np.random.default_rng([seed, 7919, epoch]).permutation(num_pieces)


@dataclass
class StreamSpec:
    """What a rank needs to read streamed samples (the cache's TokenizedDataset's part)."""

    block_size: int
    line_by_line: bool
    pad_token_id: int
    streaming: bool = True


@dataclass
class _Window:
    start: int                # global position of its first sample
    epoch: int
    where: tuple              # (epoch, piece order index, row in piece): its start
    ids: np.ndarray           # sample ids in training order (shuffled)
    refs: list                # the blocks its samples are in
    block_of: np.ndarray      # index into refs for each of ids

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


@dataclass
class StreamStats:
    samples: int = 0          # samples taken from Ray Data
    wait_s: float = 0.0       # time the driver waited for Ray Data
    tasks: set = field(default_factory=set)  # Ray Data tasks whose blocks were taken
    blocks_read_here: int = 0   # blocks whose ids the driver read in its node's store
    blocks_read_there: int = 0  # ... that a task read on the node holding them
    started: float = field(default_factory=time.time)


class TokenStream:
    """The driver's side of --streaming: global batches of sample ids, and the blocks
    that hold them, step by step."""

    def __init__(self, pieces: list[Piece], tokenize: dict, global_batch_size: int,
                 seed: int, window: int = DEFAULT_WINDOW, shuffle: bool = True,
                 num_workers: Optional[int] = None, task_cpus: float = 0.5,
                 buffer_mb: float = DEFAULT_BUFFER_MB, identity: str = ""):
        if window < 1:
            raise ConfigError(f"--shuffle_buffer_size: must be >= 1, got {window}")
        self.pieces = pieces
        self.tokenize = tokenize  # tokenizing_dataset's keyword arguments
        self.batch = global_batch_size
        self.seed, self.window, self.shuffle = seed, window, shuffle
        self.num_workers, self.task_cpus, self.buffer_mb = num_workers, task_cpus, buffer_mb
        self.windows: list[_Window] = []
        self.starts: list[int] = []          # windows' start positions (bisect)
        self.marks: dict[int, tuple] = {}    # start position -> where, for every window seen
        self.stats = StreamStats()
        self._rows: Optional[Iterator] = None
        self._carry = None                   # rows read but not yet in a window
        self._next_start = 0                 # global position of the next window
        self._next_where = (0, 0, 0)         # where the source stands
        self.steps_per_epoch = None          # unknown: a stream has no length up front
        self._lock = threading.RLock()       # prefetch's thread and the driver's
        self._error: Optional[BaseException] = None
        self._mark_starts: list[int] = []    # sorted keys of marks (epoch_of, _rewind)
        self.identity = identity             # the data's digest (a resume must match)
        self._locations_warned = False

    def prefetch(self, step: int) -> None:
        """Read the window of step ``step`` in a thread (Ray Data starts at once: its
        start-up overlaps the ranks')."""
        def run():
            try:
                self.global_batch(step)
            except BaseException as e:  # raised again by the driver's next call
                self._error = e

        threading.Thread(target=run, name="raylm-stream", daemon=True).start()

    # -- the order ------------------------------------------------------------------------
    def piece_order(self, epoch: int) -> np.ndarray:
        return piece_order(len(self.pieces), self.seed, epoch, self.shuffle)

    def global_batch(self, step: int) -> np.ndarray:
        ids, _ = self._slice(step * self.batch, (step + 1) * self.batch)
        return ids

    def blocks(self, steps: list) -> list:
        """The block references the given steps read (for the ranks)."""
        refs: dict = {}
        for step in steps:
            if step is None:
                continue
            for r in self._slice(step * self.batch, (step + 1) * self.batch)[1]:
                refs[r.hex()] = r
        return list(refs.values())

    def epoch_of(self, step: int) -> float:
        """The pass over the data that step ``step`` (1-based: the last trained) was in
        (from the windows' marks: the window may be released already)."""
        pos = max(0, step * self.batch - 1)
        with self._lock:
            i = bisect.bisect_right(self._mark_starts, pos) - 1
            return float(self.marks[self._mark_starts[i]][0]) if i >= 0 else 0.0

    def _mark(self, start: int, where: tuple) -> None:
        if start not in self.marks:
            bisect.insort(self._mark_starts, start)
        self.marks[start] = tuple(where)

    def state_at(self, step: int) -> dict:
        """What a checkpoint after ``step`` steps records: the start of the window the
        next step begins in."""
        pos = step * self.batch
        with self._lock:
            i = bisect.bisect_right(self.starts, pos) - 1
            if i >= 0 and pos < self.windows[i].end:
                start, where = self.windows[i].start, self.windows[i].where
            elif pos == self._next_start:  # (the next window is not read: a data error)
                start, where = self._next_start, self._next_where
            else:
                self._slice(pos, pos + 1)
                return self.state_at(step)
        return {"window_start": start, "where": list(where), "window": self.window,
                "pieces": len(self.pieces), "data": self.identity}

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's state_at."""
        if state.get("window") != self.window or state.get("pieces") != len(self.pieces):
            raise ConfigError(
                "--streaming: the checkpoint's stream was cut into windows of "
                f"{state.get('window')} samples over {state.get('pieces')} pieces; this run "
                f"has {self.window} and {len(self.pieces)} (keep --shuffle_buffer_size, "
                "--piece_size_mb and the files to resume)")
        if state.get("data", "") != self.identity:
            raise ConfigError(
                "--streaming: the training files, tokenizer or block settings changed since "
                "the checkpoint was saved, so its stream position no longer names the same "
                "samples; resume with the data it was saved with, or start over with "
                "--overwrite_output_dir")
        with self._lock:
            self._mark(int(state["window_start"]), tuple(state["where"]))
            self._restart(int(state["window_start"]), tuple(state["where"]))

    def next_window(self) -> "_Window":
        """Read the window after those read so far and return it (a benchmark's pass
        over the stream, without steps)."""
        with self._lock:
            self._slice(self._next_start, self._next_start + 1)
            return self.windows[-1]

    def release_before(self, step: int) -> None:
        """Drop the windows that end before step ``step`` (their blocks are freed)."""
        pos = step * self.batch
        with self._lock:
            while self.windows and self.windows[0].end <= pos:
                self.windows.pop(0)
                self.starts.pop(0)

    def close(self) -> None:
        # (a prefetch blocked on Ray Data holds the lock: not waited for past 30 s; its
        # daemon thread ends with Ray)
        if self._lock.acquire(timeout=30):
            try:
                self._close_source()
                self.windows, self.starts = [], []
            finally:
                self._lock.release()

    def _close_source(self) -> None:
        if self._rows is not None:
            self._rows.close()  # (Ray Data's executor stops: _blocks' finally)
            self._rows = None

    # -- internals ----------------------------------------------------------------------
    def _slice(self, lo: int, hi: int) -> tuple[np.ndarray, list]:
        with self._lock:
            if self._error is not None:
                raise self._error
            try:
                return self._slice_locked(lo, hi)
            except BaseException as e:
                self._error = e  # the source is spent: every later call fails the same way
                raise

    def _slice_locked(self, lo: int, hi: int) -> tuple[np.ndarray, list]:
        held_from = self.starts[0] if self.starts else self._next_start
        if lo < held_from or self._rows is None and not self.starts:
            self._rewind(lo)  # (the first read, too: from the window holding lo)
        while self._next_start < hi:
            self._fill_window()
        ids, refs = [], {}
        i = bisect.bisect_right(self.starts, lo) - 1
        while i < len(self.windows) and self.windows[i].start < hi:
            w = self.windows[i]
            a, b = max(lo, w.start) - w.start, min(hi, w.end) - w.start
            ids.append(w.ids[a:b])
            for k in np.unique(w.block_of[a:b]):
                ref = w.refs[int(k)]
                refs[ref.hex()] = ref
            i += 1
        return (np.concatenate(ids) if ids else np.empty(0, np.int64)), list(refs.values())

    def _rewind(self, pos: int) -> None:
        """Read again from the window holding ``pos`` (a resume, or a recovery to an
        earlier step than the windows held)."""
        i = bisect.bisect_right(self._mark_starts, pos) - 1
        if i < 0:
            self._restart(0, (0, 0, 0))
        else:
            start = self._mark_starts[i]
            self._restart(start, self.marks[start])

    def _restart(self, start: int, where: tuple) -> None:
        self._close_source()
        self.windows, self.starts = [], []
        self._carry = None
        self._next_start, self._next_where = start, tuple(int(x) for x in where)
        self._rows = self._read_from(*self._next_where)

    def _fill_window(self) -> None:
        """Take the next window from the source: ``window`` samples, fewer at an epoch's
        end (a window never spans two epochs)."""
        if self._rows is None:
            self._rows = self._read_from(*self._next_where)
        ids, blocks, refs = [], [], []
        n, where, epoch = 0, None, None
        while n < self.window:
            chunk = self._carry if self._carry is not None else self._next_chunk()
            self._carry = None
            if chunk is None:  # nothing left at all (cannot happen: epochs repeat)
                break
            c_epoch, c_where, ref, c_ids = chunk
            if epoch is not None and c_epoch != epoch:
                self._carry = chunk  # the epoch ended: this window is its last
                break
            if epoch is None:
                epoch, where = c_epoch, c_where
            take = min(self.window - n, len(c_ids))
            refs.append(ref)
            ids.append(c_ids[:take])
            blocks.append(np.full(take, len(refs) - 1, np.int32))
            n += take
            if take < len(c_ids):
                rest = c_ids[take:]
                piece = int(rest[0] >> PIECE_SHIFT)
                order_index = c_where[1] if int(c_ids[0] >> PIECE_SHIFT) == piece else \
                    self._order_index(c_epoch, piece)
                self._carry = (c_epoch, (c_epoch, order_index, int(rest[0] & ROW_MASK)), ref,
                               rest)
        ids_a = np.concatenate(ids)
        block_of = np.concatenate(blocks)
        # Where the source stands after this window: past its last sample (pre-shuffle).
        # A restart from there reads on exactly as this source would.
        last = int(ids_a[-1])
        piece = last >> PIECE_SHIFT
        self._next_where = (epoch, self._order_index(epoch, piece), (last & ROW_MASK) + 1)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, 104729, *where])
            perm = rng.permutation(n)
            ids_a, block_of = ids_a[perm], block_of[perm]
        w = _Window(self._next_start, epoch, where, ids_a, refs, block_of)
        self.windows.append(w)
        self.starts.append(w.start)
        self._mark(w.start, where)
        self._next_start = w.end

    def _order_index(self, epoch: int, piece: int) -> int:
        return int(np.flatnonzero(self.piece_order(epoch) == piece)[0])

    def _next_chunk(self):
        try:
            return next(self._rows)
        except StopIteration:
            return None

    def _read_from(self, epoch: int, order_index: int, row: int) -> Iterator[tuple]:
        """(epoch, where, block ref, sample ids) for the rows of each block Ray Data
        produces, from piece ``order_index`` of ``epoch``'s order (skipping its first
        ``row`` rows), then every later epoch."""
        while True:
            order = self.piece_order(epoch)
            pieces = [self.pieces[i] for i in order[order_index:]]
            position = {p.index: order_index + k for k, p in enumerate(pieces)}
            got = False
            for ref, piece, seq in self._blocks(pieces):
                if pieces and piece[0] == pieces[0].index and row:
                    keep = ~((piece == pieces[0].index) & (seq < row))
                    piece, seq = piece[keep], seq[keep]
                if not len(piece):
                    continue
                got = True
                yield (epoch, (epoch, position[int(piece[0])], int(seq[0])), ref,
                       sample_ids(piece, seq))
            if not got and order_index == 0 and row == 0:
                raise ConfigError("--streaming: the data yields no samples: every file is "
                                  "shorter than one block; use a smaller --block_size or "
                                  "--line_by_line")
            epoch, order_index, row = epoch + 1, 0, 0

    def _blocks(self, pieces: list[Piece]) -> Iterator[tuple]:
        """(ref, piece column, seq column) of each block of Ray Data's output, in order."""
        from raylm.data.tokenized import tokenizing_dataset

        if not pieces:
            return
        ds = tokenizing_dataset(pieces, num_workers=self.num_workers, num_cpus=self.task_cpus,
                                chunk_bytes=STREAM_CHUNK_BYTES, **self.tokenize)
        ctx = ds.context
        ctx.target_max_block_size = STREAM_BLOCK_BYTES
        ctx.execution_options.preserve_order = True
        ctx.execution_options.resource_limits = \
            ctx.execution_options.resource_limits.copy(
                object_store_memory=self.buffer_mb * (1 << 20))
        t0 = time.time()
        bundles = ds.iter_internal_ref_bundles()  # (returns once the first bundle is out)
        self.stats.wait_s += time.time() - t0
        failure = None
        try:
            yield from self._take(bundles)
        except DataStreamError as e:
            failure = str(e)
        finally:
            # Dropping the iterator closes Ray Data's, which stops its executor.
            bundles = ds = None  # noqa: F841
        if failure is not None:
            # Raised anew, outside the frames that hold Ray Data's iterator: the error is
            # kept (and re-raised) by the driver, and a traceback through those frames
            # would keep the executor alive past Ray's end (its finalizer calls Ray).
            raise DataStreamError(failure)

    def _take(self, bundles) -> Iterator[tuple]:
        while True:
            t0 = time.time()
            try:
                bundle = next(bundles)
            except StopIteration:
                return
            finally:
                self.stats.wait_s += time.time() - t0
            entries = list(zip(bundle.blocks, bundle.slices))
            for entry, _ in entries:
                stats = entry.metadata.exec_stats
                if stats is not None and stats.task_idx is not None:
                    self.stats.tasks.add(stats.task_idx)
            t0 = time.time()
            columns = self._id_columns([entry.ref for entry, _ in entries],
                                       [None if cut is None else (cut.start_offset, cut.num_rows)
                                        for _, cut in entries])
            self.stats.wait_s += time.time() - t0
            for (entry, _), (piece, seq, error) in zip(entries, columns):
                if error is not None:
                    raise DataStreamError(f"--streaming: {error}")
                self.stats.samples += len(seq)
                yield entry.ref, piece, seq

    def _id_columns(self, refs: list, cuts: list) -> list:
        """(piece, seq, first error) of each block. A block in the driver's node's
        object store is read in place (zero-copy); the ids of blocks held by other nodes
        are read by a small task on their node, so the blocks themselves never travel
        to the driver (only the ranks that train on them fetch them). Ray Data's
        RefBundle knows sizes, not where a block is: ray.experimental's object
        locations say that. A block with no location in any store (returned inline to
        the driver's process, being small, or spilled to disk) is read here."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        try:
            where = ray.experimental.get_object_locations(refs, timeout_ms=10_000)
        except ray.exceptions.RayError as e:
            if not self._locations_warned:
                self._locations_warned = True
                log.warning("--streaming: Ray did not say where blocks are (%s): their ids "
                            "are read on the driver's node, which copies them there", e)
            where = {}
        by_node: dict = {}
        for k, ref in enumerate(refs):
            nodes = where.get(ref, {}).get("node_ids") or []
            node = here if here in nodes or not nodes else nodes[0]
            by_node.setdefault(node, []).append(k)
        pending = []  # (the other nodes' tasks first: they run while this node reads)
        for node, ks in by_node.items():
            if node != here:
                task = _remote_ids().options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=node, soft=True))
                pending.append((ks, task.remote([cuts[k] for k in ks],
                                                *[refs[k] for k in ks])))
                self.stats.blocks_read_there += len(ks)
        out: list = [None] * len(refs)
        local = by_node.get(here, [])
        if local:
            tables = ray.get([refs[k] for k in local])
            for k, cols in zip(local, _ids_of_tables([cuts[k] for k in local], *tables)):
                out[k] = cols
            self.stats.blocks_read_here += len(local)
        for ks, ref in pending:
            for k, cols in zip(ks, ray.get(ref)):
                out[k] = cols
        return out


def _ids_of_tables(cuts: list, *tables) -> list:
    """(piece, seq, first error or None) of each Ray Data output table (sliced by its
    bundle's cut, when it has one)."""
    out = []
    for cut, table in zip(cuts, tables):
        if cut is not None:
            table = table.slice(*cut)
        errors = table.column("error").drop_null()
        out.append((table.column("piece").to_numpy(), table.column("seq").to_numpy(),
                    errors[0].as_py() if len(errors) else None))
    return out


_REMOTE_IDS = None


def _remote_ids():
    """_ids_of_tables as a Ray task (made on first use: this module does not import Ray
    at import time). No CPU reserved: it reads two columns of blocks already in memory."""
    global _REMOTE_IDS
    if _REMOTE_IDS is None:
        import ray

        _REMOTE_IDS = ray.remote(num_cpus=0, max_retries=3)(_ids_of_tables)
    return _REMOTE_IDS
