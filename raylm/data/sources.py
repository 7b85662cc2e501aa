"""Training data sources: find the files, check them, and read their texts.

A source spec is a file, a directory (searched recursively) or a glob, either a local path or
a URI that ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``, ``gs://``, ``file://``).
Everything here goes through pyarrow filesystems so the same code serves local disks and
object stores.

The texts of a file are what ``run_clm.py`` would see with ``datasets``:

- ``.txt`` / ``.text``: one text per line (``str.splitlines``, line breaks dropped), like the
  ``datasets`` text loader;
- ``.jsonl`` / ``.json`` (JSON Lines), ``.csv``, ``.parquet``: one text per row, from the text
  column (``--text_column``; default ``text``, else the only string column).

Everything is read in bounded chunks, so a file never has to fit in memory.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.fs as pafs
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from raylm.errors import ConfigError
from raylm.storage import filesystem_for

TEXT_EXTENSIONS = (".txt", ".text")
TABLE_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
SUPPORTED_EXTENSIONS = TEXT_EXTENSIONS + TABLE_EXTENSIONS
# Formats read as raw bytes that must be UTF-8 (parquet has its own encoding checks).
UTF8_EXTENSIONS = TEXT_EXTENSIONS + (".jsonl", ".json", ".csv")

DEFAULT_TEXT_COLUMN = "text"
STRING_TYPES = (pa.string(), pa.large_string(), pa.string_view())  # a column of text
# A table of rows tokenized already (a Hugging Face dataset after its tokenizing map): a
# column of lists of token ids, taken in place of text where there is no text column.
TOKEN_COLUMN = "input_ids"

# Bytes read per step when scanning or reading a text file.
TEXT_CHUNK_BYTES = 4 << 20
# Rows per batch handed to the tokenizer from .jsonl/.csv/.parquet files.
TABLE_BATCH_ROWS = 1024
# pyarrow's JSON and CSV readers need every row to fit in one block: allow long documents.
READER_BLOCK_BYTES = 16 << 20

_SAMPLE_DIR = Path(__file__).resolve().parent / "sample"


# --- filesystems and paths -----------------------------------------------------------------
# (filesystem_for: raylm.storage, the layer below; imported here for data's modules)

def display_path(spec: str, fs: pafs.FileSystem, fs_path: str) -> str:
    """How a found file is named from now on: a local absolute path, or a URI.

    ``file://`` URIs become plain local paths (the same file then has one name, and one
    cache entry). Other URIs keep the spec's scheme and credentials part (``anonymous@``)
    and query (``?region=``), so that ``filesystem_for`` reopens the same filesystem.
    """
    if isinstance(fs, pafs.LocalFileSystem):
        return fs_path
    parts = urllib.parse.urlsplit(spec)
    userinfo = parts.netloc.rpartition("@")[0]
    prefix = f"{parts.scheme}://" + (f"{userinfo}@" if userinfo else "")
    quoted = urllib.parse.quote(fs_path, safe="/:=+,;~!$&'()*-._")
    return prefix + quoted + (f"?{parts.query}" if parts.query else "")


def extension(path: str) -> str:
    """Lower-cased extension of a path or URI (query string ignored)."""
    path = urllib.parse.urlsplit(path).path if "://" in path else path
    return os.path.splitext(path)[1].lower()


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# --- resolve_files ---------------------------------------------------------------------------

_GLOB_CHARS = re.compile(r"[*?\[]")


def resolve_files(specs: list[str], flag: str = "--train_file") -> list[str]:
    """Expand files, directories and globs into a sorted, de-duplicated list of files.

    Directories are searched recursively for supported files; names starting with ``.`` or
    ``_`` below them (``.ipynb_checkpoints``, ``_SUCCESS``) are skipped, as Spark and Ray Data
    do. A file named explicitly must have a supported extension.
    """
    if isinstance(specs, str):
        specs = [specs]
    found: set[str] = set()
    for spec in specs:
        try:
            found.update(_resolve_one(spec))
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None
        except OSError as e:  # e.g. an object store refusing access
            raise ConfigError(f"{flag}: cannot access {spec}: {_one_line(e)}") from None
    return sorted(found)


def _resolve_one(spec: str) -> list[str]:
    fs, path = filesystem_for(spec)
    if _GLOB_CHARS.search(path):
        files = []
        for info in _glob(fs, path):
            if info.type == pafs.FileType.Directory:
                files.extend(_supported_files_below(fs, info.path))
            elif extension(info.path) in SUPPORTED_EXTENSIONS:
                files.append(info.path)
        if not files:
            raise ConfigError(f"{spec} matches no {_supported_list()} file")
    else:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise ConfigError(f"no such file or directory: {spec}")
        if info.type == pafs.FileType.Directory:
            files = _supported_files_below(fs, path)
            if not files:
                raise ConfigError(f"directory {spec} contains no {_supported_list()} file")
        elif extension(path) not in SUPPORTED_EXTENSIONS:
            raise ConfigError(f"{spec}: unsupported file type '{extension(path) or '(none)'}' "
                              f"(supported: {_supported_list()})")
        else:
            files = [path]
    return [display_path(spec, fs, f) for f in files]


def _supported_list() -> str:
    return ", ".join(SUPPORTED_EXTENSIONS)


def _supported_files_below(fs: pafs.FileSystem, directory: str) -> list[str]:
    directory = directory.rstrip("/")
    out = []
    for info in fs.get_file_info(pafs.FileSelector(directory, recursive=True)):
        if info.type != pafs.FileType.File:
            continue
        relative = info.path[len(directory):].lstrip("/")
        if any(part.startswith((".", "_")) for part in relative.split("/")):
            continue
        if extension(info.path) in SUPPORTED_EXTENSIONS:
            out.append(info.path)
    return out


def _glob(fs: pafs.FileSystem, pattern: str) -> list[pafs.FileInfo]:
    """Files and directories matching a glob.

    pyarrow filesystems have no glob (and Python 3.11's ``glob`` only knows local disks), so
    this lists the deepest directory without wildcards and matches the full paths against
    the pattern: ``*`` and ``?`` stay within one path component, ``**`` spans several, and
    wildcards skip hidden (dot) names as the shell does.
    """
    parts = pattern.split("/")
    first_wild = next(i for i, p in enumerate(parts) if _GLOB_CHARS.search(p))
    base = "/".join(parts[:first_wild]) or "/"
    regex = re.compile(_glob_to_regex(pattern))
    recursive = "**" in pattern or first_wild < len(parts) - 1
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=recursive))
    return [info for info in infos if regex.fullmatch(info.path)]


def _glob_to_regex(pattern: str) -> str:
    """Regex for a glob. As in the shell, a wildcard never matches a name starting with '.'."""
    not_hidden = "(?![.])"
    out, i, n = [], 0, len(pattern)
    while i < n:
        at_component_start = i == 0 or pattern[i - 1] == "/"
        if pattern.startswith("**/", i):
            out.append(f"(?:{not_hidden}[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(f"(?:{not_hidden}[^/]*/)*{not_hidden}[^/]*")
            i += 2
        elif pattern[i] in "*?":
            out.append((not_hidden if at_component_start else "")
                       + ("[^/]*" if pattern[i] == "*" else "[^/]"))
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


# --- reading -------------------------------------------------------------------------------

def _prefix(flag: Optional[str]) -> str:
    return f"{flag}: " if flag else ""


def iter_text_chunks(path: str, chunk_bytes: int = TEXT_CHUNK_BYTES,
                     flag: Optional[str] = None, start: int = 0,
                     end: Optional[int] = None) -> Iterator[str]:
    """Decode a UTF-8 file chunk by chunk; every chunk but the last ends with a newline.

    ``start``/``end``: only the lines that begin at a byte offset in [start, end) (a
    piece of the file, raylm.data.pieces): the pieces of a file then hold each line once,
    found by each reader on its own.

    Raises ConfigError naming the file and the byte offset of the first invalid byte. The
    incremental decoding is hand-written because the offset must be exact across chunk
    boundaries (``codecs``' incremental decoders report offsets into their own buffer).
    """
    fs, fs_path = filesystem_for(path)
    carry_bytes = b""   # an incomplete multi-byte character cut by the chunk boundary
    carry_text = ""     # text after the last newline, completed by the next chunk
    with (fs.open_input_file(fs_path) if start or end is not None
          else fs.open_input_stream(fs_path)) as stream:
        offset = 0  # file offset of data[0]
        remaining = None  # bytes left to read (None: to the end)
        if start or end is not None:
            size = stream.size()
            offset = line_start(stream, start, size)
            stop = size if end is None or end >= size else line_start(stream, end, size)
            remaining = max(0, stop - offset)
            stream.seek(offset)
        while True:
            want = chunk_bytes if remaining is None else min(chunk_bytes, remaining)
            chunk = stream.read(want) if want else b""
            if remaining is not None:
                remaining -= len(chunk)
            eof = not chunk
            data = carry_bytes + chunk
            try:
                text, carry_bytes = data.decode("utf-8"), b""
            except UnicodeDecodeError as e:
                if not eof and e.end == len(data) and e.reason == "unexpected end of data":
                    text, carry_bytes = data[:e.start].decode("utf-8"), data[e.start:]
                else:
                    raise ConfigError(
                        f"{_prefix(flag)}{path} is not valid UTF-8: invalid byte at offset "
                        f"{offset + e.start}") from None
            offset += len(data) - len(carry_bytes)
            text = carry_text + text
            if eof:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1
            if cut:
                yield text[:cut]
            carry_text = text[cut:]


def line_start(f, pos: int, size: int) -> int:
    """The offset of the first line that begins at or after ``pos`` in the random-access
    file ``f`` (0, or just past a newline; ``size`` when none does)."""
    if pos <= 0:
        return 0
    if pos >= size:
        return size
    f.seek(pos - 1)
    at = pos - 1
    while True:
        data = f.read(1 << 16)
        if not data:
            return size
        i = data.find(b"\n")
        if i >= 0:
            return at + i + 1
        at += len(data)


def read_line_range(path: str, start: int, end: Optional[int]) -> bytes:
    """The bytes of the lines that begin in [start, end) (a JSON Lines piece)."""
    fs, fs_path = filesystem_for(path)
    with fs.open_input_file(fs_path) as f:
        size = f.size()
        lo = line_start(f, start, size)
        hi = size if end is None or end >= size else line_start(f, end, size)
        f.seek(lo)
        return f.read(max(0, hi - lo))


def _table_info(path: str) -> tuple[pa.Schema, Optional[int]]:
    """Schema of a .jsonl/.json/.csv/.parquet file, and its row count where that is free
    (the parquet footer; None for the others)."""
    fs, fs_path = filesystem_for(path)
    if extension(path) == ".parquet":
        with fs.open_input_file(fs_path) as f:
            pf = pq.ParquetFile(f)
            return pf.schema_arrow, pf.metadata.num_rows
    with fs.open_input_stream(fs_path) as stream:
        return _stream_reader(path, stream, None).schema, None


def is_token_ids(kind: pa.DataType) -> bool:
    """Whether a column of this type holds token ids (lists of integers)."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)) and pa.types.is_integer(kind.value_type)


def _iter_column(path: str, column: str, piece: Optional[tuple] = None,
                 ids: bool = False) -> Iterator[pa.Array]:
    """One column of a .jsonl/.json/.csv/.parquet file, streamed in batches. ``piece``:
    (first, end) row groups of a parquet file, or the byte range of a JSON Lines one
    whose lines are read (raylm.data.pieces). ``ids``: the column holds token ids (read
    from JSON Lines as lists of integers, not as text)."""
    fs, fs_path = filesystem_for(path)
    if extension(path) == ".parquet":
        with fs.open_input_file(fs_path) as f:
            pf = pq.ParquetFile(f)
            groups = (list(range(piece[0], min(piece[1], pf.num_row_groups)))
                      if piece is not None else None)
            if groups == []:
                return
            for batch in pf.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=[column],
                                         row_groups=groups):
                yield batch.column(0)
        return
    if piece is not None:
        data = read_line_range(path, piece[0], piece[1])
        if not data.strip():
            return
        for batch in _stream_reader(path, pa.BufferReader(data), column, ids):
            yield batch.column(0)
        return
    with fs.open_input_stream(fs_path) as stream:
        for batch in _stream_reader(path, stream, column, ids):
            yield batch.column(0)


def _stream_reader(path: str, stream, column: Optional[str], ids: bool = False):
    """pyarrow's streaming CSV / JSON Lines reader over ``stream``.

    With ``column``, only that column is read, typed as string (``ids``: as lists of
    int64): naming its type stops the readers from guessing one that a later block
    contradicts (a CSV column of digits is still text). Quoted CSV values may span lines
    (documents often do).
    """
    if extension(path) == ".csv":
        convert = pa_csv.ConvertOptions(
            include_columns=[column], column_types={column: pa.string()}) if column else None
        return pa_csv.open_csv(
            stream,
            read_options=pa_csv.ReadOptions(block_size=READER_BLOCK_BYTES),
            parse_options=pa_csv.ParseOptions(newlines_in_values=True),
            convert_options=convert)
    parse = pa_json.ParseOptions(
        explicit_schema=pa.schema([(column, pa.list_(pa.int64()) if ids else pa.string())]),
        unexpected_field_behavior="ignore") if column else None
    return pa_json.open_json(
        stream, read_options=pa_json.ReadOptions(block_size=READER_BLOCK_BYTES),
        parse_options=parse)


def resolve_text_column(schema: pa.Schema, text_column: Optional[str], path: str,
                        flag: Optional[str] = "--train_file") -> str:
    """The column holding the text: ``text_column``, else ``text``, else the only string
    one, else ``input_ids`` where it holds token ids (rows tokenized already:
    is_token_ids)."""
    described = ", ".join(f"{f.name} ({f.type})" for f in schema) or "none"
    if text_column is not None:
        if text_column not in schema.names:
            raise ConfigError(f"{_prefix(flag)}{path} has no column '{text_column}' "
                              f"(columns: {described}); check --text_column")
        column = text_column
    elif DEFAULT_TEXT_COLUMN in schema.names:
        column = DEFAULT_TEXT_COLUMN
    else:
        strings = [f.name for f in schema if f.type in STRING_TYPES]
        if len(strings) == 1:
            column = strings[0]
        elif TOKEN_COLUMN in schema.names and is_token_ids(schema.field(TOKEN_COLUMN).type):
            column = TOKEN_COLUMN
        else:
            raise ConfigError(f"{_prefix(flag)}{path} has no '{DEFAULT_TEXT_COLUMN}' column "
                              f"and no single string column (columns: {described}); pass "
                              f"--text_column (or, for rows tokenized already, give an "
                              f"'{TOKEN_COLUMN}' column of lists of token ids)")
    # CSV and JSON values are read as strings whatever their inferred type; parquet's
    # types are real.
    column_type = schema.field(column).type
    if extension(path) == ".parquet" and column_type not in STRING_TYPES \
            and not is_token_ids(column_type):
        raise ConfigError(f"{_prefix(flag)}{path}: column '{column}' holds {column_type}, "
                          "neither text nor token ids; check --text_column")
    return column


def table_column(path: str, text_column: Optional[str], flag: Optional[str] = "--train_file",
                 piece: Optional[tuple] = None) -> tuple[Optional[str], bool]:
    """(resolve_text_column's column of a table file, whether it holds token ids: rows
    tokenized already, for iter_token_ids); (None, False) for a text file. The schema is
    read once: hand the column to iter_texts as ``resolved``. ``piece``: the piece the
    caller reads (what a read error names)."""
    if extension(path) in TEXT_EXTENSIONS:
        return None, False
    try:
        schema = _table_info(path)[0]
    except (pa.ArrowException, OSError) as e:
        raise _table_failure(path, e, piece, flag) from None
    column = resolve_text_column(schema, text_column, path, flag)
    return column, is_token_ids(schema.field(column).type)


def first_row(path: str, piece: Optional[tuple]) -> Optional[int]:
    """The file's row number of a piece's first row: 0 for a whole file, the rows of the
    row groups before it for a parquet piece (its footer); None for a byte range (not
    known without reading what is before it)."""
    if piece is None:
        return 0
    if extension(path) != ".parquet":
        return None
    fs, fs_path = filesystem_for(path)
    with fs.open_input_file(fs_path) as f:
        meta = pq.ParquetFile(f).metadata
        return sum(meta.row_group(g).num_rows for g in range(min(piece[0], meta.num_row_groups)))


def iter_token_ids(path: str, column: str, *, flag: Optional[str] = None,
                   piece: Optional[tuple] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The rows of a column of token ids (table_column's), in order, in batches: (the
    ids of the batch's rows one after another, int64; each row's count). A missing (null)
    row has none. ``piece``: as iter_texts'."""
    try:
        for array in _iter_column(path, column, piece, ids=True):
            array = array.cast(pa.large_list(pa.int64()))  # (any list of integers)
            if array.null_count:
                array = array.fill_null(pa.scalar([], array.type))
            offsets = array.offsets.to_numpy()
            yield (array.flatten().to_numpy(zero_copy_only=False).astype(np.int64),
                   np.diff(offsets).astype(np.int64))
    except (pa.ArrowException, OSError) as e:
        raise _table_failure(path, e, piece, flag) from None


def _read_error(path: str, e: Exception, flag: Optional[str]) -> ConfigError:
    kind = {".parquet": "parquet", ".csv": "CSV"}.get(extension(path), "JSON Lines")
    return ConfigError(f"{_prefix(flag)}cannot read {path} as {kind}: {_one_line(e)}")


def iter_texts(path: str, text_column: Optional[str] = None, *, flag: Optional[str] = None,
               chunk_bytes: int = TEXT_CHUNK_BYTES, keep_linebreaks: bool = False,
               piece: Optional[tuple] = None, resolved: bool = False) -> Iterator[list[str]]:
    """The texts of one file, in order, in batches (lists of strings).

    Texts are lines for .txt/.text files (ending with their "\\n" with
    ``keep_linebreaks``: the `datasets` text loader's option, which run_clm turns on) and
    rows of the text column otherwise; a missing (null) value is an empty text.
    ``piece``: only a piece of the file (raylm.data.pieces: a byte range of a text or
    JSON Lines file, row groups of a parquet file). ``resolved``: ``text_column`` is the
    table's text column already (table_column's), its schema not read again.
    """
    if extension(path) in TEXT_EXTENSIONS:
        start, end = piece if piece is not None else (0, None)
        for chunk in iter_text_chunks(path, chunk_bytes, flag, start, end):
            if keep_linebreaks:  # universal newlines, as the loader's open() reads them
                chunk = chunk.replace("\r\n", "\n").replace("\r", "\n")
            yield chunk.splitlines(keepends=keep_linebreaks)
        return
    try:
        column, ids = (text_column, False) if resolved else table_column(
            path, text_column, flag, piece)
        if ids:
            raise ConfigError(f"{_prefix(flag)}{path}: column '{column}' holds token ids, "
                              "not text: give the tokenizer they come from "
                              "(--tokenizer_name)")
        for array in _iter_column(path, column, piece):
            yield [t if t is not None else "" for t in array.to_pylist()]
    except (pa.ArrowException, OSError) as e:
        raise _table_failure(path, e, piece, flag) from None


def _table_failure(path: str, e: Exception, piece: Optional[tuple],
                   flag: Optional[str]) -> ConfigError:
    """One line for a table file (or its ``piece``) that failed to read: a JSON Lines
    file's first line that is not JSON, by its byte offset, where that is the cause."""
    bad = None
    if isinstance(e, pa.ArrowInvalid) and extension(path) in (".jsonl", ".json"):
        # The piece's lines, else those the schema is read from (the file's first
        # reader block, which every piece reads): never a scan of the whole file.
        bad = _first_bad_json_line(path, piece) or (
            _first_bad_json_line(path, (0, READER_BLOCK_BYTES))
            if piece is not None else None)
    if bad is not None:
        offset, line, error = bad
        return ConfigError(f"{_prefix(flag)}cannot read {path} as JSON Lines: the line at "
                           f"byte offset {offset} is not JSON ({error}): {line!r}")
    where = (f" (bytes {piece[0]}-{piece[1]})" if piece is not None
             and extension(path) != ".parquet" else
             f" (row groups {piece[0]}-{piece[1] - 1})" if piece is not None else "")
    return _read_error(path + where, e, flag)


def _first_bad_json_line(path: str, piece: Optional[tuple]) -> Optional[tuple]:
    """(byte offset, start of the line, json's message) of the first line of a JSON Lines
    file, or of its piece, that is not a JSON value; None when every line is one.

    pyarrow's reader names a row of its block, not where in the file; on its error the
    lines are read again, one by one, to find it (only then: it is a second pass)."""
    fs, fs_path = filesystem_for(path)
    with fs.open_input_file(fs_path) as f:
        size = f.size()
        at = line_start(f, piece[0], size) if piece is not None else 0
        end = (size if piece is None or piece[1] is None or piece[1] >= size
               else line_start(f, piece[1], size))
        f.seek(at)
        rest = b""
        while at < end:
            data = f.read(min(TEXT_CHUNK_BYTES, end - at - len(rest)))
            lines = (rest + data).split(b"\n")
            rest = lines.pop() if data else b""  # (a line not ended yet, unless at the end)
            for raw in lines:
                text = raw.decode("utf-8", errors="replace").strip()
                if text:
                    try:
                        json.loads(text)
                    except ValueError as e:
                        return at, text[:80], str(e)
                at += len(raw) + 1
            if not data:
                break
    return None


# --- validate_files ------------------------------------------------------------------------

def validate_files(files: list[str], text_column: Optional[str],
                   flag: str = "--train_file", scan: bool = True) -> None:
    """Cheap checks of every file before anything starts; raises ConfigError on the first bad one.

    Text formats are scanned once for UTF-8 validity (streaming); tables are opened to find
    the text column and at least one row (parquet: from its footer, without reading data).
    ``scan=False`` (--streaming, where a pass over the corpus is what is avoided): text
    formats are checked in their first chunk only; a bad byte further on stops the run
    when the stream reaches it, naming the file and offset.
    """
    for path in files:
        try:
            _validate_one(path, text_column, flag, scan)
        except OSError as e:  # e.g. an object store refusing access
            raise ConfigError(f"{flag}: cannot read {path}: {_one_line(e)}") from None


def _validate_one(path: str, text_column: Optional[str], flag: str, scan: bool = True) -> None:
    ext = extension(path)
    if ext not in SUPPORTED_EXTENSIONS:
        raise ConfigError(f"{flag}: {path}: unsupported file type '{ext or '(none)'}' "
                          f"(supported: {_supported_list()})")
    fs, fs_path = filesystem_for(path)
    info = fs.get_file_info(fs_path)
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"{flag}: no such file or directory: {path}")
    if info.size == 0:
        raise ConfigError(f"{flag}: {path} is empty")
    if ext in UTF8_EXTENSIONS:
        has_text = False
        for chunk in iter_text_chunks(path, TEXT_CHUNK_BYTES if scan else 1 << 16, flag):
            has_text = has_text or not chunk.isspace()
            if has_text and not scan:
                break
        if not has_text:
            raise ConfigError(f"{flag}: {path} is empty (only whitespace)")
    if ext in TABLE_EXTENSIONS:
        _validate_table(path, text_column, flag)


def _validate_table(path: str, text_column: Optional[str], flag: str) -> None:
    try:
        schema, num_rows = _table_info(path)
        column = resolve_text_column(schema, text_column, path, flag)
        if num_rows is None:
            # Stops at the first non-empty batch: enough to know the file has rows.
            ids = is_token_ids(schema.field(column).type)
            num_rows = next((len(a) for a in _iter_column(path, column, ids=ids) if len(a)), 0)
    except (pa.ArrowException, OSError) as e:
        raise _read_error(path, e, flag) from None
    if not num_rows:
        raise ConfigError(f"{flag}: {path} is empty (no rows)")


# --- the built-in sample -------------------------------------------------------------------

def builtin_sample_files() -> list[str]:
    """The Shakespeare plays shipped with raylm: the default training data."""
    return sorted(str(p) for p in (_SAMPLE_DIR / "shakespeare").glob("*.txt"))


def builtin_tokenizer_dir() -> str:
    """A 4096-token byte-level BPE tokenizer trained on the built-in sample."""
    return str(_SAMPLE_DIR / "tokenizer")
