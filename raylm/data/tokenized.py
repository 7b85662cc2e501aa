"""Tokenize the training files once, with Ray Data, into a parquet cache with global sample ids.

Layout of a cache directory (``<cache_root>/tokens-<key>/``)::

    manifest.json                       what TokenizedDataset.load reads; written last
    shard-<file>-<first block>.parquet  columns input_ids (list<int32>, block_size long)
                                        and length (int32)

Sample ids are global and independent of how Ray Data schedules the work: files in the
order given (``resolve_files`` sorts them), blocks in file order. Each Ray Data task
tokenizes whole files and tags every block with (file index, block number in the file);
the driver writes what arrives into shards named by those tags and orders the shards by
them. Ray Data's ``preserve_order`` would also give a stable order, but only the tags make
the ids provably independent of block splitting and coalescing inside Ray Data.

The driver writes the shards (not the tasks), so the cache lands where the driver can see
it even when tasks run on other nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import hashlib
import itertools
import json
import os
import posixpath
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raylm.data.pieces import DEFAULT_PIECE_MB, Piece, plan_pieces
from raylm.data.sources import (TEXT_CHUNK_BYTES, filesystem_for, first_row, iter_texts,
                                iter_token_ids, table_column)
from raylm.errors import ConfigError

# Bump when the meaning or layout of the cached data changes: old caches are then ignored.
FORMAT_VERSION = 2  # 2: files cut into pieces (raylm.data.pieces)
MANIFEST = "manifest.json"
CACHE_PREFIX = "tokens-"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600  # a temporary build directory idle this long was left by a crash

# Each tokenization task asks for half a CPU: on a 2-CPU machine a whole CPU per task
# could starve the rest of the pipeline (see notes/platform-facts.md), and the tokenizer
# spends much of its time in Rust threads anyway.
TASK_NUM_CPUS = 0.5

# What every tokenization task yields. `error` is set (on a single row) when a file is bad:
# Ray Data wraps exceptions raised in a UDF in UserCodeException and keeps only their
# traceback text, so a ConfigError raised in a task would reach the driver as a traceback
# rather than as one line. Returning it as data keeps the message intact.
_TASK_SCHEMA = pa.schema([
    ("piece", pa.int32()),        # raylm.data.pieces: Piece.index
    ("seq", pa.int64()),          # block number within its piece
    ("input_ids", pa.list_(pa.int32())),
    ("length", pa.int32()),
    ("error", pa.string()),
])


@dataclass
class TokenizedDataset:
    """A tokenized corpus on disk: samples 0..num_samples-1, each ``block_size`` tokens."""

    cache_dir: str            # directory (or URI) holding manifest.json and the shards
    num_samples: int          # N; sample ids are 0..N-1
    block_size: int
    line_by_line: bool
    pad_token_id: int
    shard_files: list[str]    # parquet files, in global-id order
    shard_offsets: list[int]  # first sample id of each shard
    reused: bool = False      # True when the cache existed and nothing was tokenized
    samples_per_file: list[int] = dataclasses.field(default_factory=list)  # input order

    def file_ids(self) -> list:
        """The sample ids of each input file, in the order the files were given."""
        ends = np.cumsum(self.samples_per_file, dtype=np.int64)
        return [np.arange(end - n, end, dtype=np.int64)
                for n, end in zip(self.samples_per_file, ends)]

    @classmethod
    def load(cls, cache_dir: str) -> "TokenizedDataset":
        fs, path = filesystem_for(cache_dir)
        try:
            with fs.open_input_stream(posixpath.join(path, MANIFEST)) as f:
                manifest = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{cache_dir} is not a raylm token cache "
                              f"(no {MANIFEST})") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{cache_dir}: token cache format "
                              f"{manifest.get('format_version')} is not {FORMAT_VERSION}")
        shards = manifest["shards"]
        return cls(
            cache_dir=cache_dir,
            num_samples=manifest["num_samples"],
            block_size=manifest["block_size"],
            line_by_line=manifest["line_by_line"],
            pad_token_id=manifest["pad_token_id"],
            shard_files=[_join(cache_dir, s["file"]) for s in shards],
            shard_offsets=[s["offset"] for s in shards],
            samples_per_file=[s["samples"] for s in manifest.get("sources", [])],
        )


def absolute_inputs(files: list[str], tokenizer_dir: str) -> tuple[list[str], str]:
    """Local paths made absolute: Ray workers need not share the driver's working
    directory (URIs and Hub names stay as they are)."""
    files = [f if "://" in f else os.path.abspath(os.path.expanduser(f)) for f in files]
    if os.path.isdir(tokenizer_dir):
        tokenizer_dir = os.path.abspath(tokenizer_dir)
    return files, tokenizer_dir


def default_cache_root() -> str:
    return os.environ.get("RAYLM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "raylm")


def build_tokenized_dataset(files: list[str], tokenizer_dir: str, block_size: int, *,
                            line_by_line: bool = False, text_column: Optional[str] = None,
                            cache_root: Optional[str] = None,
                            num_workers: Optional[int] = None, keep_linebreaks: bool = True,
                            overwrite: bool = False,
                            before_tokenizing: Optional[Callable[[], None]] = None,
                            piece_mb: float = DEFAULT_PIECE_MB) -> TokenizedDataset:
    """Tokenize ``files`` into the cache, or return the cache built earlier from the same inputs.

    Default: run_clm's ``group_texts`` per file (concatenate the token ids of all its texts,
    cut ``block_size`` blocks, drop the remainder), or per piece of ``piece_mb`` MiB of a
    larger file (raylm.data.pieces: the pieces tokenize in parallel); a text file's texts
    are its lines, with their line breaks unless ``keep_linebreaks`` is False (run_clm's --keep_linebreaks).
    ``line_by_line``: one sample per non-empty line or row, truncated to ``block_size`` and
    padded (lines without their breaks, as run_mlm reads them). ``overwrite``: build anew
    even when the cache holds these inputs (--overwrite_cache), replacing the old build
    atomically. ``before_tokenizing``: called once the cache is known not to hold these
    inputs, before Ray Data's tasks start. Ray must be initialised.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"--block_size: must be a positive integer, got {block_size!r}")
    if num_workers is not None and num_workers < 1:
        raise ConfigError(f"--preprocessing_num_workers: must be >= 1, got {num_workers}")
    if not files:
        raise ConfigError("no data files to tokenize")
    files, tokenizer_dir = absolute_inputs(files, tokenizer_dir)

    root = cache_root or default_cache_root()
    keep_linebreaks = keep_linebreaks and not line_by_line
    key = cache_key(files, tokenizer_dir, block_size, line_by_line, text_column,
                    keep_linebreaks, piece_mb)
    fs, root_path = filesystem_for(root)
    final_path = posixpath.join(root_path, CACHE_PREFIX + key)
    local = isinstance(fs, pafs.LocalFileSystem)
    final = final_path if local else _join(root, CACHE_PREFIX + key)
    if _has_manifest(fs, final_path) and not overwrite:
        return dataclasses.replace(TokenizedDataset.load(final), reused=True)

    if before_tokenizing is not None:
        before_tokenizing()
    remove_stale_tmp(fs, root_path, key)
    tokenizer = load_tokenizer(tokenizer_dir)
    pad_token_id = pad_token_id_for(tokenizer, line_by_line, tokenizer_dir)

    # Everything is written under a temporary name and renamed into place at the end: a
    # build that crashes leaves only a .tmp- directory, which is never read as a cache.
    tmp_path = posixpath.join(root_path, f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
    fs.create_dir(tmp_path, recursive=True)
    try:
        shards, per_file = _tokenize_into(tmp_path, fs, plan_pieces(files, piece_mb), len(files),
                                          tokenizer_dir, block_size, line_by_line,
                                          text_column, pad_token_id, num_workers,
                                          keep_linebreaks)
        num_samples = sum(per_file)
        if num_samples == 0:
            raise ConfigError(_no_samples_message(files, block_size, line_by_line))
        manifest = {
            "format_version": FORMAT_VERSION,
            "key": key,
            "num_samples": num_samples,
            "block_size": block_size,
            "line_by_line": line_by_line,
            "keep_linebreaks": keep_linebreaks,
            "pad_token_id": pad_token_id,
            "text_column": text_column,
            "tokenizer": tokenizer_dir,
            "sources": [{"path": p, "samples": n} for p, n in zip(files, per_file)],
            "shards": shards,
        }
        with fs.open_output_stream(posixpath.join(tmp_path, MANIFEST)) as f:
            f.write(json.dumps(manifest, indent=1).encode("utf-8"))
        commit_build(fs, tmp_path, final_path, replace=overwrite)
    finally:
        # After a local commit the directory is gone already; otherwise (failure, lost race,
        # object-store copy) it is removed here.
        with contextlib.suppress(OSError):
            fs.delete_dir(tmp_path)
    return TokenizedDataset.load(final)


def remove_stale_tmp(fs, root_path: str, key: str) -> None:
    """Delete what builds of this key killed mid-way left behind, on a local disk or in an
    object store.

    Only directories where nothing was written for STALE_TMP_S: a build still running
    (another process tokenizing the same inputs) keeps writing shards into its own,
    younger, directory. (An object store's directories have no time of their own: the
    newest object in one dates it.)
    """
    prefix = f"{TMP_PREFIX}{key}-"
    try:
        entries = fs.get_file_info(pafs.FileSelector(root_path, allow_not_found=True))
    except OSError:
        return
    for entry in entries:
        if entry.type != pafs.FileType.Directory or not entry.base_name.startswith(prefix):
            continue
        try:
            inside = fs.get_file_info(pafs.FileSelector(entry.path, recursive=True))
            written = [i.mtime.timestamp() for i in [entry, *inside] if i.mtime is not None]
            if written and time.time() - max(written) > STALE_TMP_S:
                fs.delete_dir(entry.path)
        except OSError:
            continue  # (gone meanwhile: another build cleared it)


# --- cache identity ------------------------------------------------------------------------

def cache_key(files: list[str], tokenizer_dir: str, block_size: int, line_by_line: bool,
              text_column: Optional[str], keep_linebreaks: bool = True,
              piece_mb: float = DEFAULT_PIECE_MB) -> str:
    """Digest of everything the cached samples depend on.

    Files are identified by path, size and modification time (what the filesystem reports
    without reading them); the tokenizer by the content of its files.
    """
    identities = []
    for path in files:
        fs, fs_path = filesystem_for(path)
        info = fs.get_file_info(fs_path)
        if info.type == pafs.FileType.NotFound:
            raise ConfigError(f"no such file or directory: {path}")
        identities.append([path, info.size, info.mtime_ns])
    spec = {
        "format_version": FORMAT_VERSION,
        "files": identities,
        "tokenizer": tokenizer_digest(tokenizer_dir),
        "block_size": block_size,
        "line_by_line": bool(line_by_line),
        "text_column": text_column,
        "keep_linebreaks": bool(keep_linebreaks),
        "piece_mb": float(piece_mb),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def tokenizer_digest(tokenizer_dir: str) -> str:
    """Hash of a local tokenizer's files (names and bytes, ``_tokenizer_files``); for a
    Hub name, the name. A model directory's weights and checkpoints are not read: they
    would cost a read of the whole model and a new cache whenever a checkpoint lands."""
    h = hashlib.sha256()
    if not os.path.isdir(tokenizer_dir):
        h.update(f"name:{tokenizer_dir}".encode())
        return h.hexdigest()
    for full in _tokenizer_files(tokenizer_dir):
        h.update(os.path.relpath(full, tokenizer_dir).encode() + b"\0")
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


# What AutoTokenizer reads from a directory: transformers' own file names
# (tokenization_utils_base), config.json (it may pick the tokenizer's class), and the
# vocabulary files of every tokenizer kind (vocab.json, merges.txt, vocab.txt,
# spiece.model, tokenizer.model, *.tiktoken, ...).
_TOKENIZER_NAMES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "chat_template.jinja", "chat_template.json",
                    "config.json"}
_TOKENIZER_PATTERNS = ("vocab*", "merges*", "tokenizer*", "spiece*", "sentencepiece*",
                       "*.model", "*.tiktoken")
_CHAT_TEMPLATES_DIR = "additional_chat_templates"


def _tokenizer_files(tokenizer_dir: str) -> list[str]:
    """The files of ``tokenizer_dir`` a tokenizer is loaded from, in a fixed order."""
    out = []
    for name in sorted(os.listdir(tokenizer_dir)):
        full = os.path.join(tokenizer_dir, name)
        if name == _CHAT_TEMPLATES_DIR and os.path.isdir(full):
            out += sorted(os.path.join(full, n) for n in os.listdir(full)
                          if os.path.isfile(os.path.join(full, n)))
        elif os.path.isfile(full) and (name in _TOKENIZER_NAMES or any(
                fnmatch.fnmatch(name, p) for p in _TOKENIZER_PATTERNS)):
            out.append(full)
    return out


def _has_manifest(fs: pafs.FileSystem, dir_path: str) -> bool:
    return fs.get_file_info(posixpath.join(dir_path, MANIFEST)).type == pafs.FileType.File


def _join(base: str, name: str) -> str:
    """``base``/``name`` for a local path or a URI (keeping a URI's ?query at the end)."""
    if "://" not in base:
        return os.path.join(base, name)
    base, _, query = base.partition("?")
    return base.rstrip("/") + "/" + name + (f"?{query}" if query else "")


def commit_build(fs: pafs.FileSystem, tmp_path: str, final_path: str,
                 replace: bool = False, src_fs: pafs.FileSystem | None = None) -> None:
    """Move a finished cache directory into place.

    Locally this is one rename(2): atomic. Object stores have no directory rename, so the
    files are copied with the manifest last; since a cache counts only once its manifest
    exists, a crash midway still leaves nothing that is read as a cache. ``replace``: an
    existing build is moved aside first (locally a rename, so a reader sees the old
    build or the new one, never a mix; on an object store it is deleted, manifest first).
    ``src_fs``: the file system ``tmp_path`` is on when it is not ``fs`` (a build made on
    local disk for an object store: its files are uploaded, the manifest last).
    """
    if _has_manifest(fs, final_path):
        if not replace:
            # Another build of the same inputs finished first; its result is identical.
            return
        if isinstance(fs, pafs.LocalFileSystem) and src_fs is None:
            # (named as a build's temporary directory: one a crash leaves is cleared)
            old = posixpath.join(posixpath.dirname(final_path), TMP_PREFIX
                                 + posixpath.basename(final_path)[len(CACHE_PREFIX):]
                                 + f"-old-{uuid.uuid4().hex[:8]}")
            fs.move(final_path, old)
            fs.move(tmp_path, final_path)
            fs.delete_dir(old)
            return
        fs.delete_file(posixpath.join(final_path, MANIFEST))
    if fs.get_file_info(final_path).type != pafs.FileType.NotFound:
        # A directory without a manifest is an interrupted object-store commit: replace it.
        fs.delete_dir(final_path)
    if src_fs is None:
        try:
            fs.move(tmp_path, final_path)
            return
        except (OSError, pa.ArrowNotImplementedError):
            if isinstance(fs, pafs.LocalFileSystem):
                if _has_manifest(fs, final_path):  # lost a race to a concurrent build
                    return
                raise
    src = src_fs or fs
    names = [i.base_name for i in src.get_file_info(pafs.FileSelector(tmp_path))]
    for name in sorted(names, key=lambda n: n == MANIFEST):
        pafs.copy_files(posixpath.join(tmp_path, name), posixpath.join(final_path, name),
                        source_filesystem=src, destination_filesystem=fs)


# --- tokenization --------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str):
    """The fast tokenizer in ``tokenizer_dir``, loaded once per process (Ray reuses worker
    processes, so a task pays for loading only the first time it lands on a worker)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as e:  # transformers raises many types for an unreadable tokenizer
        raise ConfigError(f"--tokenizer_name: cannot load a tokenizer from {tokenizer_dir}: "
                          f"{' '.join(str(e).split())}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"--tokenizer_name: {tokenizer_dir} has no fast (Rust) tokenizer "
                          "(tokenizer.json); raylm needs one")
    return tokenizer


# Texts the driver encodes both ways before it hands tasks the Rust half: special-token
# strings inside text, unicode, whitespace, a text long enough to truncate.
_PROBE = ["Hello, world!", "  spaces  ", "ünïcödé ✓ 😀", "", "a [SEP] b <|endoftext|> c",
          "<s> x </s> [CLS] y [MASK]", "word " * 64, "tabs\tand\r\nends\n"]


@functools.lru_cache(maxsize=4)
def task_tokenizer_state(tokenizer_dir: str) -> dict:
    """What a tokenizing task needs of the fast tokenizer in ``tokenizer_dir``, read on
    the driver: its Rust half (``tokenizers.Tokenizer``) as transformers configured it,
    serialized, and the two settings transformers applies on each call; or, for a
    tokenizer whose ids the Rust half alone does not reproduce on a probe (a class of
    transformers that encodes in Python), just the directory: its tasks load it with
    transformers. Once per process and directory, as load_tokenizer (a stream starts a
    Ray Data job per epoch and per rewind). Not to be modified: it is shared."""
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizer.backend_tokenizer.to_str()
    state = {"backend": backend, "digest": hashlib.sha256(backend.encode()).hexdigest(),
             "truncation_side": tokenizer.truncation_side,
             "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))}
    rust = RustTokenizer(state)
    same = all(rust(_PROBE, **kw)["input_ids"] == tokenizer(_PROBE, **kw)["input_ids"]
               for kw in ({}, {"truncation": True, "max_length": 8}))
    return state if same else {"tokenizer_dir": tokenizer_dir}


class RustTokenizer:
    """A fast tokenizer's Rust half, called as tokenize_file calls transformers' fast
    tokenizer, and giving the same ids: transformers' call (TokenizersBackend's
    ``_encode_plus`` in transformers/tokenization_utils_tokenizers.py) sets truncation
    and padding on the backend (``set_truncation_and_padding``: truncation to
    ``max_length``, stride 0, longest_first, its truncation side; no padding) and
    ``encode_special_tokens``, then runs this ``encode_batch`` with special tokens.
    task_tokenizer_state checks that on a probe before tasks get it.

    Why not transformers' tokenizer in the tasks: importing transformers pulls in torch,
    which costs a fresh Ray worker 4-10 s here, before a task's first block; the
    ``tokenizers`` library alone loads in milliseconds. So a stream's first block, and
    every build's first tasks, wait for the tokenization only."""

    def __init__(self, state: dict):
        import tokenizers

        self._tk = tokenizers.Tokenizer.from_str(state["backend"])
        self._tk.no_padding()
        self._tk.no_truncation()
        self._tk.encode_special_tokens = state["split_special_tokens"]
        self._side = state["truncation_side"]
        self._truncating = None

    def __len__(self) -> int:  # (len(tokenizer) of transformers': added tokens counted)
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __call__(self, texts: list[str], truncation: bool = False,
                 max_length: Optional[int] = None, return_attention_mask: bool = False,
                 return_token_type_ids: bool = False) -> dict:
        if truncation and max_length is None or return_attention_mask \
                or return_token_type_ids:
            raise ValueError("RustTokenizer: only input_ids, truncated to a given max_length "
                             "or not")
        mode = max_length if truncation else None
        if mode != self._truncating:
            if mode is None:
                self._tk.no_truncation()
            else:
                self._tk.enable_truncation(mode, stride=0, strategy="longest_first",
                                           direction=self._side)
            self._truncating = mode
        return {"input_ids": [e.ids for e in self._tk.encode_batch(texts,
                                                                   add_special_tokens=True)]}


_TASK_TOKENIZERS: dict = {}  # digest -> RustTokenizer: one per process (Ray reuses workers)


def _task_tokenizer(state: dict):
    """The tokenizer a task runs, from task_tokenizer_state's state."""
    if "tokenizer_dir" in state:
        return load_tokenizer(state["tokenizer_dir"])
    if state["digest"] not in _TASK_TOKENIZERS:
        _TASK_TOKENIZERS.clear()  # (a worker serves one run's tokenizer at a time)
        _TASK_TOKENIZERS[state["digest"]] = RustTokenizer(state)
    return _TASK_TOKENIZERS[state["digest"]]


def pad_token_id_for(tokenizer, line_by_line: bool, tokenizer_dir: str) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        if line_by_line:
            raise ConfigError(f"--line_by_line: the tokenizer {tokenizer_dir} has neither a pad "
                              "nor an eos token to pad with")
        pad = 0  # never used: without --line_by_line every block is full
    return int(pad)


def tokenize_file(path: str, tokenizer, block_size: int, line_by_line: bool,
                  text_column: Optional[str], pad_token_id: int,
                  chunk_bytes: int = TEXT_CHUNK_BYTES,
                  keep_linebreaks: bool = False,
                  piece: Optional[tuple] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The samples of one file (or of one piece of it: raylm.data.pieces), in order, as
    (input_ids [n, block_size] int32, length [n]). A table of token ids
    (sources.table_column: rows tokenized already) is cut as the tokenizer's ids are.

    Streams: memory holds one batch of texts plus fewer than ``block_size`` carried tokens.
    """
    pending = np.empty(0, dtype=np.int32)  # tokens not yet filling a block
    for ids, lengths in _row_ids(path, tokenizer, block_size, line_by_line, text_column,
                                 chunk_bytes, keep_linebreaks, piece):
        if line_by_line:
            if not len(lengths):
                continue
            blocks = np.full((len(lengths), block_size), pad_token_id, dtype=np.int32)
            # Row-major fill: the first lengths[i] slots of row i get that row's tokens.
            blocks[np.arange(block_size) < lengths[:, None]] = ids
            yield blocks, lengths
        else:
            tokens = np.concatenate([pending, ids])
            n = len(tokens) // block_size
            pending = tokens[n * block_size:].copy()
            if n:
                yield (tokens[:n * block_size].reshape(n, block_size),
                       np.full(n, block_size, dtype=np.int32))
    # What is left in `pending` is the remainder shorter than a block: dropped, as
    # run_clm's group_texts does.


def _row_ids(path: str, tokenizer, block_size: int, line_by_line: bool,
             text_column: Optional[str], chunk_bytes: int, keep_linebreaks: bool,
             piece: Optional[tuple]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The token ids of a file's rows (texts tokenized, or the ids a table holds), in
    batches: (the rows' ids one after another, int32; each row's count). --line_by_line:
    each row truncated to ``block_size`` (a text by the tokenizer, a row of ids to its
    first ``block_size``), empty rows left out."""
    column, tokenized = table_column(path, text_column, None, piece)
    if not tokenized:
        cut = dict(truncation=True, max_length=block_size) if line_by_line else {}
        for texts in iter_texts(path, column, chunk_bytes=chunk_bytes,
                                keep_linebreaks=keep_linebreaks, piece=piece,
                                resolved=column is not None):
            if line_by_line:
                texts = [t for t in texts if t and not t.isspace()]
                if not texts:
                    continue
            ids = tokenizer(texts, return_attention_mask=False, return_token_type_ids=False,
                            **cut)["input_ids"]
            lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
            yield _flatten(ids, int(lengths.sum())), lengths
        return
    vocab, row = len(tokenizer), 0
    for ids, lengths in iter_token_ids(path, column, piece=piece):
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            at = int(np.argmax(bad))
            where = row + int(np.searchsorted(np.cumsum(lengths), at, side="right"))
            start = first_row(path, piece)  # (None: a byte range's rows, counted in it)
            part = f"row {start + where}" if start is not None else \
                f"the row {where} of its bytes {piece[0]}-{piece[1]}"
            raise ConfigError(f"{path}: {part} of column '{column}' holds token id "
                              f"{int(ids[at])}, outside the tokenizer's vocabulary of {vocab} "
                              "(the ids must be the run's tokenizer's: --tokenizer_name)")
        row += len(lengths)
        if line_by_line:
            # (each row's first block_size ids, cut as they are: a tokenizer that ends a
            # text with a special token, BERT's [SEP], keeps it when it truncates a text)
            within = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            ids, lengths = ids[within < block_size], np.minimum(lengths, block_size)
            lengths = lengths[lengths > 0]
        yield ids.astype(np.int32), lengths.astype(np.int32)


def _flatten(ids: list[list[int]], total: int) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)


def _tokenize_task(batch: pa.Table, *, tokenizer_state: dict, block_size: int,
                   line_by_line: bool, text_column: Optional[str],
                   pad_token_id: int, keep_linebreaks: bool,
                   chunk_bytes: int = TEXT_CHUNK_BYTES) -> Iterator[pa.Table]:
    """Ray Data UDF: tokenize the pieces listed in ``batch`` (Piece.to_item's columns),
    yielding a table per ``chunk_bytes`` of text read (the tokenizer: _task_tokenizer of
    ``tokenizer_state``, task_tokenizer_state's)."""
    with interrupts_deferred():
        tokenizer = _task_tokenizer(tokenizer_state)
    for item in batch.to_pylist():
        piece = Piece.from_item(item)
        seq = 0
        try:
            for blocks, lengths in tokenize_file(piece.path, tokenizer, block_size,
                                                 line_by_line, text_column, pad_token_id,
                                                 chunk_bytes=chunk_bytes,
                                                 keep_linebreaks=keep_linebreaks,
                                                 piece=piece.range):
                yield _task_table(piece.index, seq, blocks, lengths)
                seq += len(blocks)
        except ConfigError as e:
            yield _error_table(piece.index, str(e))
            return


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back a KeyboardInterrupt until the block is done (main thread only).

    Ray Data cancels its running tasks when its executor stops (a stream closes at the
    end of a run), and Ray delivers a cancel as a KeyboardInterrupt in the task
    (``_thread.interrupt_main``, which runs Python's SIGINT handler). One that lands
    while a worker's first task imports modules leaves them half-initialized in a
    process Ray reuses, and every later task there fails to import them (seen with
    transformers and torch: "partially initialized module 'torch'"). Ray guards its own
    argument deserialization the same way, with a private helper (DeferSigint); this is
    that guard, for the tokenizer's import and load. Yields the list of interrupts held
    back so far."""
    received: list = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        # (None: a handler not set from Python; the default is what Ray's cancel needs)
        signal.signal(signal.SIGINT, previous if previous is not None
                      else signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


def _task_table(index: int, seq0: int, blocks: np.ndarray, lengths: np.ndarray) -> pa.Table:
    n, width = blocks.shape
    # list<int32> built from a flat buffer and offsets: no per-row Python objects.
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    return pa.Table.from_arrays([
        pa.array(np.full(n, index, np.int32)),
        pa.array(np.arange(seq0, seq0 + n, dtype=np.int64)),
        pa.ListArray.from_arrays(offsets, pa.array(blocks.reshape(-1), pa.int32())),
        pa.array(lengths, pa.int32()),
        pa.nulls(n, pa.string()),
    ], schema=_TASK_SCHEMA)


def _error_table(index: int, message: str) -> pa.Table:
    return pa.Table.from_pylist(
        [{"piece": index, "seq": -1, "input_ids": [], "length": 0, "error": message}],
        schema=_TASK_SCHEMA)


def quiet_ray_data() -> None:
    """raylm logs one summary line per build; Ray Data's progress lines would drown it."""
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    # (its notice that the progress bars are off: raylm turned them off)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def tokenizing_dataset(pieces: list[Piece], tokenizer_dir: str, block_size: int,
                       line_by_line: bool, text_column: Optional[str], pad_token_id: int,
                       num_workers: Optional[int], keep_linebreaks: bool,
                       num_cpus: float = TASK_NUM_CPUS, chunk_bytes: int = TEXT_CHUNK_BYTES):
    """The Ray Data pipeline that tokenizes ``pieces``: one input row, and one block, per
    piece, so Ray Data runs a task per piece (or per few when there are many), at most
    ``num_workers`` at a time. Its rows: _TASK_SCHEMA."""
    import ray.data

    quiet_ray_data()
    items = [p.to_item() for p in pieces]
    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    return ds.map_batches(
        _tokenize_task, batch_size=1, batch_format="pyarrow",
        fn_kwargs=dict(tokenizer_state=task_tokenizer_state(tokenizer_dir),
                       block_size=block_size,
                       line_by_line=line_by_line, text_column=text_column,
                       pad_token_id=pad_token_id, keep_linebreaks=keep_linebreaks,
                       chunk_bytes=chunk_bytes),
        num_cpus=num_cpus,
        compute=ray.data.TaskPoolStrategy(size=num_workers) if num_workers else None)


def _tokenize_into(out_path: str, fs: pafs.FileSystem, pieces: list[Piece], num_files: int,
                   tokenizer_dir: str, block_size: int, line_by_line: bool,
                   text_column: Optional[str], pad_token_id: int,
                   num_workers: Optional[int], keep_linebreaks: bool):
    """Run the Ray Data job and write its output as shards under ``out_path``.

    Returns the shard list for the manifest (in global-id order, with offsets) and the
    number of samples per input file.
    """
    ds = tokenizing_dataset(pieces, tokenizer_dir, block_size, line_by_line, text_column,
                            pad_token_id, num_workers, keep_linebreaks)

    runs = []  # (file_index, first seq, rows, shard file name)
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        errors = batch.column("error").drop_null()
        if len(errors):
            raise ConfigError(errors[0].as_py())
        for index, seq0, table in _contiguous_runs(batch):
            name = f"shard-{index:06d}-{seq0:012d}.parquet"
            pq.write_table(table.select(["input_ids", "length"]),
                           posixpath.join(out_path, name), filesystem=fs)
            runs.append((index, seq0, table.num_rows, name))

    # Order the shards by (piece, first block) and check they tile each piece exactly.
    runs.sort()
    per_piece = [0] * len(pieces)
    per_file = [0] * num_files
    shards, offset = [], 0
    for index, seq0, rows, name in runs:
        if seq0 != per_piece[index]:
            raise RuntimeError(f"internal error: blocks of {pieces[index].describe()} arrived "
                               f"with a gap or overlap at block {seq0}")
        per_piece[index] += rows
        per_file[pieces[index].file_index] += rows
        shards.append({"file": name, "offset": offset, "rows": rows})
        offset += rows
    return shards, per_file


def _contiguous_runs(batch: pa.Table) -> Iterator[tuple[int, int, pa.Table]]:
    """Split a batch into runs of consecutive blocks of one file.

    Ray Data may coalesce or split the tables a task yields, so a batch is not assumed to
    hold one file or to be in order.
    """
    if batch.num_rows == 0:
        return
    file_index = batch.column("piece").to_numpy()
    seq = batch.column("seq").to_numpy()
    order = np.lexsort((seq, file_index))
    if not np.array_equal(order, np.arange(len(order))):
        batch, file_index, seq = batch.take(order), file_index[order], seq[order]
    breaks = np.flatnonzero((np.diff(file_index) != 0) | (np.diff(seq) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(seq)]])
    for start, end in zip(starts, ends):
        yield int(file_index[start]), int(seq[start]), batch.slice(start, end - start)


def _no_samples_message(files: list[str], block_size: int, line_by_line: bool) -> str:
    where = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
    if line_by_line:
        return f"the data in {where} has no non-empty line or row to make a sample from"
    return (f"the data in {where} yields no samples: every file is shorter than one block "
            f"of {block_size} tokens; use a smaller --block_size or --line_by_line")
