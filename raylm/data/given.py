"""train(..., train_dataset=, eval_dataset=): a dataset object in place of files.

A ``ray.data.Dataset`` (anything Ray Data reads or maps) or a Hugging Face
``datasets.Dataset`` (the HF Trainer's ``train_dataset``), holding a text column
(``--text_column``; default ``text``, else its only string column, else ``input_ids``
where it holds token ids: rows tokenized already). Each is written,
on the driver, before any rank starts, as one parquet file of that column under the data
cache; from there on it is a file like any --train_file: tokenized into the block cache by
Ray Data, each sample once per epoch in the seeded, layout-independent order, resumable.
One data path for every source, as for --dataset_name (raylm.data.hf_datasets).

The file is named by a digest of the rows (the column's name and its values, in order),
and the export pass runs at every start: a Ray Dataset carries no fingerprint, and a
``datasets.Dataset``'s is random after a map it cannot hash. Rows are taken in the
dataset's order: raylm sets ``preserve_order`` on a fresh dataset of the column alone (so
also when the user's dataset ran before), so a dataset that reads the same files through
the same maps gives the same rows in the same order, hence the same file (its row groups
are ROW_GROUP rows each, whatever the blocks), the same cache and the same samples on a
resume. A dataset whose rows change from run to run (``random_shuffle()`` with no seed;
a ``materialize()``d one, whose order is that of its tasks' ends) is a different dataset
at each start, and a resume refuses it (the digest is part of the run's fingerprint).

The rows pass through the driver once per start; that is this path's cost (here, 2 cores:
2-3 s per million lines of text, ~13 MiB/s, a fifth of tokenizing them;
benchmarks/bench_given.py), paid before the ranks start. Files are the way for corpora
the driver should not read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raylm import storage
from raylm.errors import ConfigError, first_line

log = logging.getLogger("raylm")

EXPORT_DIR = "given-datasets"
ROW_GROUP = 65_536  # rows per row group of an export
TOKEN_TYPE = pa.large_list(pa.int32())  # an export's column of token ids


def kind_of(ds, arg: str) -> str:
    """"ray" or "hf" for a dataset ``arg`` (train_dataset / eval_dataset) may be; one
    ConfigError otherwise."""
    try:
        import ray.data

        if isinstance(ds, ray.data.Dataset):
            return "ray"
    except ImportError:  # (ray is a dependency; a broken install is not this error)
        pass
    try:
        import datasets

        if isinstance(ds, datasets.Dataset):
            return "hf"
        if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            raise ConfigError(f"{arg} is a DatasetDict ({', '.join(ds)}): pass one split, "
                              f"e.g. {arg}=dataset['train']")
    except ImportError:
        pass
    raise ConfigError(f"{arg} takes a ray.data.Dataset or a datasets.Dataset, not "
                      f"{type(ds).__name__} (files: --train_file / --validation_file)")


def export(ds, arg: str, text_column: Optional[str], cache_root: str) -> tuple[str, str]:
    """(parquet path, digest) of ``ds``'s text column written under ``cache_root``, named
    by the rows (each content written once, atomically). A ``datasets.Dataset`` is read
    in this process (its arrow batches), a Ray Dataset through Ray Data, in its order."""
    from raylm.data.sources import resolve_text_column

    if kind_of(ds, arg) == "hf":
        column = resolve_text_column(ds.data.schema, text_column, "the dataset", flag=arg)
        return _export(_hf_batches(ds.select_columns([column])), arg, text_column,
                       cache_root, "hf")
    # A dataset that ran before (its schema known, without running it now) is read as a
    # fresh dataset of the column alone: an execution of its own, so the order is set
    # (not the cached blocks, in the order its tasks ended), and no other column comes
    # through the driver. One that never ran is read as it is (it executes afresh).
    schema = ds.schema(fetch_if_missing=False)
    schema = getattr(schema, "base_schema", None)
    if isinstance(schema, pa.Schema):
        column = resolve_text_column(schema, text_column, "the dataset", flag=arg)
        ds = ds.select_columns([column])
    return _export(batches(ds, arg, "pyarrow"), arg, text_column, cache_root, "ray")


def _hf_batches(ds):
    """A ``datasets.Dataset``'s rows as arrow tables of up to 10,000 rows, in order."""
    arrow = ds.with_format("arrow")
    for start in range(0, len(ds), 10_000):
        yield arrow[start:start + 10_000]


@contextlib.contextmanager
def in_order(ds):
    """Inside: ``ds`` (a Ray Dataset) yields its rows in its order (its context's
    ``preserve_order``; restored after)."""
    options = ds.context.execution_options
    preserve = options.preserve_order
    options.preserve_order = True
    try:
        yield ds
    finally:
        options.preserve_order = preserve


def as_ray(ds, arg: str):
    """``ds`` as a Ray Dataset: a ``datasets.Dataset``'s Arrow table (its rows as they
    are, selections and maps applied), as ``ray.data.from_huggingface`` converts one in
    the end. (Not through from_huggingface itself: it first asks the Hugging Face Hub
    for parquet files of the dataset's name, which offline costs half a minute of
    timeouts, and online reads the Hub's files instead of this object.)"""
    if kind_of(ds, arg) == "ray":
        return ds
    import ray.data

    # (blocks of 1024 rows: Ray Data's tasks decode a block each, in parallel)
    return ray.data.from_arrow(ds.with_format("arrow")[:],
                               override_num_blocks=max(1, -(-len(ds) // 1024)))


def batches(ds, arg: str, batch_format: str):
    """``ds``'s batches (whole blocks), in its order; what its reads and maps (the user's
    code) raise becomes one ConfigError naming ``arg``."""
    with in_order(ds):
        it = iter(ds.iter_batches(batch_size=None, batch_format=batch_format))
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except Exception as e:
                raise failure(arg, e) from e
            yield batch


def failure(arg: str, e: BaseException) -> ConfigError:
    """One line for a dataset whose reads or maps (the user's code) failed."""
    return ConfigError(f"{arg}: Ray Data could not produce its rows: {_users_error(e)}")


def _export(tables, arg: str, text_column: Optional[str], cache_root: str,
            kind: str) -> tuple[str, str]:
    """Written locally under a temporary name, then renamed into place, or uploaded in
    one request to an object-store ``cache_root`` (a crash leaves nothing that is read)."""
    from raylm.data.tokenized import TMP_PREFIX, remove_stale_tmp

    cache_root = storage.local_path(cache_root)  # (file:// URIs too)
    remote = storage.is_remote(cache_root)
    directory = storage.join(cache_root, EXPORT_DIR)
    staging = tempfile.gettempdir() if remote else directory
    os.makedirs(staging, exist_ok=True)
    if not remote:
        remove_stale_tmp(pafs.LocalFileSystem(), directory, "export")  # (a crashed export's)
    tmp = os.path.join(staging, f"{TMP_PREFIX}export-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        key, rows = _write_rows(tables, arg, text_column, os.path.join(tmp, "rows.parquet"))
        path = storage.join(directory, f"{key}.parquet")
        if storage.isfile(path):
            log.info("%s: %d rows, as exported before (%s)", arg, rows, path)
        else:
            if remote:
                storage.upload_file(os.path.join(tmp, "rows.parquet"), path)
            else:
                os.replace(os.path.join(tmp, "rows.parquet"), path)
            log.info("%s: %d rows exported to %s", arg, rows, path)
        return path, f"{kind}:{key}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _users_error(e: BaseException) -> str:
    """The user's exception in what Ray raises for a failed map: a RayTaskError holding a
    UserCodeException, whose text is the task's traceback ending with the user's
    ``Type: message`` line (Ray keeps the text, not the exception)."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    for line in reversed(lines):
        m = re.match(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$", line)
        if m and not m.group(1).split(".")[-1] in ("UserCodeException", "RayTaskError"):
            return f"{m.group(1).split('.')[-1]}: {m.group(2)}"
    return f"{type(e).__name__}: {first_line(e)}"


def _write_rows(tables, arg: str, text_column: Optional[str], tmp: str) -> tuple[str, int]:
    """(digest of the rows, number of rows): the text column of ``tables`` (arrow tables
    or record batches, in row order) written to ``tmp``."""
    from raylm.data.sources import STRING_TYPES, is_token_ids, resolve_text_column

    # The digest: of the column's name, the values' lengths (-1 for a null) and their
    # bytes, each in row order across batches; and the file's row groups are ROW_GROUP
    # rows each: neither depends on how the rows came cut into batches. (A file over
    # --piece_size_mb is tokenized in pieces of whole row groups, each dropping its own
    # remainder: the same rows must give the same row groups.)
    lengths, data = hashlib.sha256(), hashlib.sha256()
    rows, writer, column, pending, as_type = 0, None, None, [], None
    try:
        for batch in tables:
            if column is None:
                column = resolve_text_column(batch.schema, text_column, "the dataset",
                                             flag=arg)
                # Text, or token ids (rows tokenized already: sources.is_token_ids)
                ids = is_token_ids(batch.schema.field(column).type)
                as_type = TOKEN_TYPE if ids else pa.large_string()
                writer = pq.ParquetWriter(tmp, pa.schema([(column, as_type)]))
            kind = batch.schema.field(column).type
            # (a block of nulls only: null; of empty lists only: list<null>)
            if as_type == TOKEN_TYPE and not (is_token_ids(kind) or kind == pa.null() or (
                    pa.types.is_list(kind) and pa.types.is_null(kind.value_type))):
                raise ConfigError(f"{arg}: column '{column}' holds {kind}, not token ids as "
                                  "in its first rows")
            if as_type != TOKEN_TYPE and kind not in STRING_TYPES + (pa.null(),):
                raise ConfigError(f"{arg}: column '{column}' holds {kind}, not text; "
                                  "check --text_column")
            try:
                values = batch.column(column).cast(as_type)
            except pa.ArrowInvalid as e:  # (an id past int32: no tokenizer's)
                raise ConfigError(f"{arg}: column '{column}': {first_line(e)}") from None
            for chunk in getattr(values, "chunks", [values]):
                _digest(chunk, lengths, data)
                pending.append(chunk)
            rows += len(values)
            pending = _flush(writer, column, pending, as_type)
        if writer is not None:
            _flush(writer, column, pending, as_type, final=True)
    finally:
        if writer is not None:
            writer.close()
    if rows == 0:
        raise ConfigError(f"{arg} is empty (no rows)")
    # (token ids are marked: no text's rows digest as them; a text key is as it was)
    mark = b"token ids\0" if as_type == TOKEN_TYPE else b""
    key = hashlib.sha256(column.encode() + b"\0" + mark + lengths.digest() + data.digest())
    return key.hexdigest()[:24], rows


def _flush(writer, column: str, pending: list, as_type, final: bool = False) -> list:
    """Write whole row groups of ROW_GROUP rows from ``pending`` (arrays of ``as_type``;
    at the end, ``final``, the shorter last one too); returns what is left."""
    if not pending:
        return []
    whole = pa.chunked_array(pending, type=as_type)
    done = 0
    while len(whole) - done >= ROW_GROUP or (final and done < len(whole)):
        take = min(ROW_GROUP, len(whole) - done)
        writer.write_table(pa.table({column: whole.slice(done, take)}),
                           row_group_size=ROW_GROUP)
        done += take
    return [whole.slice(done).combine_chunks()] if done < len(whole) else []


def _digest(values, lengths, data) -> None:
    """Add a batch's values (a large_string array, or TOKEN_TYPE's) to the two digests,
    from the array's buffers (no Python object per row): each row's length (-1 for a
    null) and its bytes (text) or ids (little-endian int32)."""
    nulls = values.is_null().to_numpy(zero_copy_only=False) if values.null_count else None
    if nulls is not None:  # (a null's bytes, if any, are not its value)
        values = values.fill_null(pa.scalar([] if values.type == TOKEN_TYPE else "",
                                            values.type))
    if values.type == TOKEN_TYPE:
        at = values.offsets.to_numpy()
        flat = values.flatten().to_numpy(zero_copy_only=False)
        buffer, at = np.ascontiguousarray(flat, dtype="<i4").tobytes(), at - at[0]
        at = at * 4  # (bytes)
    else:
        _, offsets, buffer = values.buffers()
        at = np.frombuffer(offsets, dtype=np.int64)[values.offset:
                                                    values.offset + len(values) + 1]
    size = np.diff(at)
    if nulls is not None:
        size = np.where(nulls, -1, size)
    lengths.update(size.astype("<i8").tobytes())
    if buffer is not None and len(values):
        data.update(memoryview(buffer)[int(at[0]):int(at[-1])])
