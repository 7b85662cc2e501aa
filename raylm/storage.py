"""Where a run writes: a local directory or an object store (``s3://``, ``gs://``, any
URI ``pyarrow.fs`` opens), behind one set of path functions.

Paths are strings: a local path, or a URI whose ``?query`` (endpoint, region) and
user-info (credentials) travel with it, so any process, a rank on another node included,
reopens the same file system from the path alone (``filesystem_for``; the data paths
take theirs from here too). An object store has no rename: what must appear whole is
written in one request (an object is never seen half-written) or committed by a marker
file written last (raylm.checkpoint.manager).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import posixpath
import tempfile
import urllib.parse
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from raylm.errors import ConfigError


def filesystem_for(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``path`` and the path inside it."""
    if "://" in path:
        try:
            return _filesystem_from_uri(path)
        except (pa.ArrowInvalid, ValueError, OSError) as e:
            raise ConfigError(f"cannot open {path}: "
                              f"{' '.join(str(e).split()) or type(e).__name__}") from None
    return _LOCAL_FS, os.path.abspath(os.path.expanduser(path))


_LOCAL_FS = pafs.LocalFileSystem()


def _filesystem_from_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    parts = urllib.parse.urlsplit(uri)
    fs, base = _cached_filesystem(parts.scheme, parts.netloc, parts.query)
    path = urllib.parse.unquote(parts.path).strip("/")
    return fs, (base + "/" + path).rstrip("/") or "/"


@functools.lru_cache(maxsize=32)
def _cached_filesystem(scheme: str, netloc: str, query: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of a URI's root, and the path of that root inside it.

    Building an object-store filesystem resolves credentials and regions: it is done once
    per bucket (scheme, netloc and options), not once per file. The root's path tells how
    the scheme maps URIs to paths ('s3://bucket/' is 'bucket', 'file:///' is '/').
    """
    fs, base = pafs.FileSystem.from_uri(urllib.parse.urlunsplit((scheme, netloc, "/", query, "")))
    return fs, base.rstrip("/")


def is_remote(path: str) -> bool:
    """Whether ``path`` is an object-store URI (``file://`` is local)."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path: str) -> str:
    """A local path as an absolute path (``file://`` URIs included); a URI unchanged."""
    if is_remote(path):
        return path
    if str(path).startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
    return os.path.abspath(os.path.expanduser(path))


def shown(path):
    """``path`` as written into files and results: a URI without its user-info
    (credentials); None and local paths unchanged."""
    if path is None or not is_remote(path):
        return path
    parts = urllib.parse.urlsplit(path)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def join(base: str, *names: str) -> str:
    """``base``/``names`` for a local path or a URI (a URI's ?query kept at the end)."""
    if not is_remote(base):
        return os.path.join(base, *names)
    base, _, query = base.partition("?")
    return "/".join([base.rstrip("/"), *names]) + (f"?{query}" if query else "")


def basename(path: str) -> str:
    if not is_remote(path):
        return os.path.basename(os.path.abspath(path))
    return posixpath.basename(urllib.parse.urlsplit(path).path.rstrip("/"))


def _fs(path: str) -> tuple[pafs.FileSystem, str]:
    return filesystem_for(local_path(path))


def _type(path: str):
    fs, p = _fs(path)
    return fs.get_file_info(p).type


def isfile(path: str) -> bool:
    return _type(path) == pafs.FileType.File


def isdir(path: str) -> bool:
    """A local directory, or a prefix with anything under it in an object store."""
    if not is_remote(path):
        return os.path.isdir(local_path(path))
    return bool(listdir(path))


def exists(path: str) -> bool:
    return isfile(path) or isdir(path)


def listdir(path: str) -> list[str]:
    """The names directly under ``path`` (files and directories); [] when it is absent."""
    fs, p = _fs(path)
    infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)


def read_bytes(path: str) -> bytes:
    fs, p = _fs(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file, atomically: locally through a temporary name and a rename,
    in an object store in one request."""
    fs, p = _fs(path)
    if not is_remote(path):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        return
    with fs.open_output_stream(p) as f:
        f.write(data)


def delete(path: str) -> None:
    """Remove a file or a directory tree, if there is one."""
    fs, p = _fs(path)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.File:
        fs.delete_file(p)
    elif kind == pafs.FileType.Directory:
        fs.delete_dir(p)


def upload_dir(local_dir: str, dest: str) -> None:
    """Copy the files under ``local_dir`` to ``dest`` (each file one request)."""
    fs, p = _fs(dest)
    pafs.copy_files(local_dir, p, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def upload_file(local_file: str, dest: str) -> None:
    fs, p = _fs(dest)
    pafs.copy_files(local_file, p, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def download_file(src: str, local_file: str) -> None:
    fs, p = _fs(src)
    pafs.copy_files(p, local_file, source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())


def download_dir(src: str, local_dir: str) -> None:
    """Copy the files under ``src`` into ``local_dir`` (made if absent)."""
    fs, p = _fs(src)
    os.makedirs(local_dir, exist_ok=True)
    pafs.copy_files(p, local_dir, source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())


@contextlib.contextmanager
def written_dir(path: str) -> Iterator[str]:
    """A local directory to write ``path``'s files into: ``path`` itself when local,
    else a temporary one uploaded to ``path`` when the block ends without an error."""
    if not is_remote(path):
        os.makedirs(local_path(path), exist_ok=True)
        yield local_path(path)
        return
    with tempfile.TemporaryDirectory(prefix="raylm-upload-") as tmp:
        yield tmp
        upload_dir(tmp, path)


@contextlib.contextmanager
def read_dir(path: str) -> Iterator[str]:
    """``path``'s files in a local directory: ``path`` itself when local, else a
    temporary download, removed when the block ends."""
    if not is_remote(path):
        yield local_path(path)
        return
    with tempfile.TemporaryDirectory(prefix="raylm-download-") as tmp:
        download_dir(path, tmp)
        yield tmp


def dcp_writer(path: str):
    """A storage writer of torch.distributed.checkpoint for ``path``, local or remote."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not is_remote(path):
        return FileSystemWriter(local_path(path))

    class ArrowWriter(FileSystemWriter):
        # torch's FsspecWriter finds the file system from the URI's scheme in fsspec's
        # registry, where S3 needs s3fs (not installed); this is the same writer on
        # pyarrow's file system, the one the data paths use. (Object stores keep what
        # they are sent: no fsync.)
        def __init__(self):
            fs, p = _fs(path)
            super().__init__(p, sync_files=False)
            self.fs, self.path = _arrow_dcp_fs(fs), p

    return ArrowWriter()


def dcp_reader(path: str):
    """The storage reader matching ``dcp_writer``."""
    from torch.distributed.checkpoint import FileSystemReader

    if not is_remote(path):
        return FileSystemReader(local_path(path))

    class ArrowReader(FileSystemReader):
        def __init__(self):
            fs, p = _fs(path)
            super().__init__(p)
            self.fs, self.path = _arrow_dcp_fs(fs), p

    return ArrowReader()


# Reads of a checkpoint from an object store go through a buffer of this size: DCP and
# torch.load read a file in many small pieces, each of which would be a request.
READ_BUFFER_BYTES = 16 << 20


def _arrow_dcp_fs(fs: pafs.FileSystem):
    """DCP's fsspec file system (paths as strings, streams opened by fsspec) on ``fs``,
    its reads buffered."""
    from fsspec.implementations.arrow import ArrowFSWrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    class Buffered(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with fs.open_input_file(str(path)) as f:
                yield io.BufferedReader(_Ranged(f), buffer_size=READ_BUFFER_BYTES)

    dcp_fs = Buffered()
    dcp_fs.fs = ArrowFSWrapper(fs)
    return dcp_fs


class _Ranged(io.RawIOBase):
    """A pyarrow random-access file as a raw stream (each read one ranged request)."""

    def __init__(self, f):
        self.f = f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, buffer) -> int:
        data = self.f.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)
