"""Cut the input files into pieces that tokenize independently, so that one large file
tokenizes on many cores and nodes.

A piece is a byte range of a text or JSON Lines file (the lines that *begin* in it:
each reader finds its first and last line itself, as Hadoop's line splits do, so no pass
over the file is needed to plan), a run of row groups of a parquet file, or a whole CSV
file (quoted values may span lines: a byte range cannot be cut safely). Pieces depend
only on the files and ``piece_bytes``, never on the cluster, so the samples they yield
(and their ids: piece, then position in the piece) are the same on any layout.

Each piece is packed on its own: run_clm's ``group_texts`` over the piece's texts, the
remainder shorter than a block dropped. For a file under ``piece_bytes`` that is one
piece, exactly run_clm's per-file grouping; a larger file loses under a block per piece.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pyarrow.parquet as pq

from raylm.data.sources import TABLE_EXTENSIONS, TEXT_EXTENSIONS, extension, filesystem_for
from raylm.errors import ConfigError

DEFAULT_PIECE_MB = 64

# Formats split at line boundaries by byte offsets (.json is read as JSON Lines).
_LINE_SPLIT = TEXT_EXTENSIONS + (".jsonl", ".json")


@dataclass(frozen=True)
class Piece:
    index: int        # global: files in the order given, then position in the file
    file_index: int
    path: str
    start: int        # first byte (text, JSON Lines) or first row group (parquet)
    end: int          # end byte or row group (exclusive); -1: the whole file
    unit: str         # "bytes", "row_groups" or "file"

    @property
    def range(self):
        """What iter_texts' ``piece`` takes: None for a whole file."""
        return None if self.unit == "file" else (self.start, self.end)

    def describe(self) -> str:
        if self.unit == "bytes":
            return f"{self.path} (bytes {self.start}-{self.end})"
        if self.unit == "row_groups":
            return f"{self.path} (row groups {self.start}-{self.end - 1})"
        return self.path

    def to_item(self) -> dict:
        return asdict(self)

    @classmethod
    def from_item(cls, item: dict) -> "Piece":
        return cls(**{k: item[k] for k in ("index", "file_index", "path", "start", "end",
                                           "unit")})


def plan_pieces(files: list[str], piece_mb: float = DEFAULT_PIECE_MB) -> list[Piece]:
    """The pieces of ``files``, in order: a text or JSON Lines file of more than
    ``piece_mb`` MiB in byte ranges of that size, a parquet file in runs of row groups of
    about that size (its footer is read), anything else whole."""
    if piece_mb <= 0:
        raise ConfigError(f"--piece_size_mb: must be > 0, got {piece_mb}")
    piece_bytes = max(1, int(piece_mb * (1 << 20)))
    pieces: list[Piece] = []

    def add(file_index, path, start, end, unit):
        pieces.append(Piece(len(pieces), file_index, path, start, end, unit))

    for i, path in enumerate(files):
        ext = extension(path)
        fs, fs_path = filesystem_for(path)
        if ext in _LINE_SPLIT:
            size = fs.get_file_info(fs_path).size or 0
            if size <= piece_bytes:
                add(i, path, 0, -1, "file")
                continue
            for start in range(0, size, piece_bytes):
                add(i, path, start, min(size, start + piece_bytes), "bytes")
        elif ext == ".parquet" and ext in TABLE_EXTENSIONS:
            with fs.open_input_file(fs_path) as f:
                meta = pq.ParquetFile(f).metadata
            first, acc = 0, 0
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                if acc >= piece_bytes and g + 1 < meta.num_row_groups:
                    add(i, path, first, g + 1, "row_groups")
                    first, acc = g + 1, 0
            if first == 0:
                add(i, path, 0, -1, "file")
            else:
                add(i, path, first, meta.num_row_groups, "row_groups")
        else:
            add(i, path, 0, -1, "file")
    return pieces
