"""Images for classification: an image folder decoded once, with Ray Data, into a cache of
fixed-size pixel arrays with global sample ids; read by id on the ranks
(raylm.data.reader.ImageReader).

The layout read is the one ``torchvision.datasets.ImageFolder`` and the Hugging Face
``imagefolder`` loader take: ``DIR/<class name>/<any path>.<png|jpg|...>``. Classes are the
sub-directories holding images, in sorted order (label ids 0..K-1); samples are the
images in (class, path) order, so sample ids depend on the files only, never on how Ray
Data schedules the decoding, and the sampler's seeded order (raylm.data.sampler) is the
same for any layout, as for text.

Decoding (PIL: any mode to RGB, or to L for one channel; resized to the model's
``image_size`` square with bilinear filtering) runs in Ray Data tasks, each tagging its
rows with their sample ids; the driver writes what arrives as shards named by their first
id and checks that the shards cover every id once. A file PIL cannot read is returned by
its task as data (not raised: Ray Data keeps only a traceback's text) and becomes one
``ConfigError`` naming the file. The cache commits atomically, as the token cache does
(raylm.data.tokenized): written under a temporary name, manifest last, renamed; into an
object store (``--data_cache_dir s3://...``) built locally and uploaded, manifest last,
and each node memory-maps its own copy of a shard (read_shard).

Layout of a cache directory (``<cache_root>/images-<key>/``)::

    manifest.json             written last; what ImageDataset.load reads
    shard-<first id>.arrow    Arrow IPC files, uncompressed: columns pixels
                              (fixed_size_binary, H*W*C bytes, HWC uint8) and label (int32)

The shards are Arrow IPC files, not parquet (as the token cache is), so that the ranks
memory-map them (raylm.data.reader.ImageReader): their pixels are read in place from the
page cache, which every rank of a node shares, and only the pages a batch touches are
resident, so a set larger than memory trains. Parquet pages are decoded into each
reader's own memory (pixels do not compress anyway).

Augmentation is not cached: it is drawn per (seed, epoch, sample id) when a rank prepares
a batch (raylm.models.objectives.ImageClassification), so each epoch sees other flips and
a resumed or resized run the same ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raylm import storage
from raylm.errors import ConfigError, first_line

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
FORMAT_VERSION = 2  # (1: parquet shards, read into memory)
CACHE_PREFIX = "images-"
MANIFEST = "manifest.json"
# Images per Ray Data task: decoding is PIL work of a few milliseconds per image.
TASK_IMAGES = 256


@dataclass
class ImageFolder:
    """An image folder, scanned: its classes and its images in sample-id order."""

    root: str
    classes: list[str]
    files: list[str]  # absolute paths or URIs, in (class, path) order
    labels: list[int]
    stamps: list  # per file: [size, mtime ns], what the cache key reads


def scan_image_folder(root: str, flag: str, classes: Optional[list] = None) -> ImageFolder:
    """The images under ``root`` (``class/…/image.ext``), a local directory or an object
    store's (``s3://``, ``gs://``: listed through pyarrow's file systems, as text files
    are); one ConfigError naming ``flag`` for a directory that is missing, holds no class
    directories or no images, or (with ``classes``: the training folder's) a class the
    training folder lacks. Names starting with '.' are skipped at any depth."""
    from raylm.data.sources import display_path, filesystem_for

    try:
        fs, base = filesystem_for(root)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None
    if "://" not in root:
        root = base
    try:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise ConfigError(f"{flag}: no such directory: {root}")
        if info.type != pafs.FileType.Directory:
            raise ConfigError(f"{flag} {root} is a file: give the directory of the class "
                              "directories")
        listed = _local_files(base) if isinstance(fs, pafs.LocalFileSystem) else [
            (i.path, [i.size, i.mtime_ns])
            for i in fs.get_file_info(pafs.FileSelector(base, recursive=True))
            if i.type == pafs.FileType.File]
    except OSError as e:  # an object store refusing access, say
        raise ConfigError(f"{flag}: cannot list {root}: {first_line(e)}") from None
    found: dict[str, list] = {}
    for path, stamp in listed:
        parts = path[len(base):].strip("/").split("/")
        if len(parts) < 2 or any(p.startswith(".") for p in parts) or \
                not parts[-1].lower().endswith(IMAGE_EXTENSIONS):
            continue
        found.setdefault(parts[0], []).append((display_path(root, fs, path), stamp))
    if not found:
        raise ConfigError(f"{flag} {root}: no images in class directories (expected "
                          f"{root}/<class name>/<image>{'|'.join(IMAGE_EXTENSIONS)})")
    names = classes if classes is not None else sorted(found)
    extra = sorted(set(found) - set(names))
    if extra:
        raise ConfigError(f"{flag} {root}: class directories the training data does not "
                          f"have: {', '.join(extra[:5])}")
    index = {c: i for i, c in enumerate(names)}
    files, labels, stamps = [], [], []
    for name in sorted(found, key=index.get):
        images = sorted(found[name])
        files += [f for f, _ in images]
        stamps += [st for _, st in images]
        labels += [index[name]] * len(images)
    return ImageFolder(root, list(names), files, labels, stamps)


def _local_files(base: str) -> list:
    """[(path, [size, mtime ns])] of the files below a local directory, as os.walk finds
    them: symbolic links to files are read, links to directories are not followed (a
    link back up the tree would list the same images again and again)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out.append((path, [st.st_size, st.st_mtime_ns]))
    return out


@dataclass
class ImageDataset:
    """Decoded images on disk: samples 0..num_samples-1, each ``image_size`` square."""

    cache_dir: str
    num_samples: int
    image_size: int
    channels: int
    classes: list[str]
    shard_files: list[str]
    shard_offsets: list[int]
    reused: bool = False
    images = True  # (what raylm.data.reader.make_reader dispatches on)
    line_by_line = False
    streaming = False

    @property
    def block_size(self) -> int:  # (the bytes of one sample's pixels)
        return self.image_size * self.image_size * self.channels

    @classmethod
    def load(cls, cache_dir: str) -> "ImageDataset":
        m = json.loads(storage.read_bytes(storage.join(cache_dir, MANIFEST)))
        if m.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{cache_dir}: image cache format {m.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
        return cls(cache_dir=cache_dir, num_samples=m["num_samples"],
                   image_size=m["image_size"], channels=m["channels"], classes=m["classes"],
                   shard_files=[storage.join(cache_dir, s["file"]) for s in m["shards"]],
                   shard_offsets=[s["offset"] for s in m["shards"]])


def _key(folder: ImageFolder, image_size: int, channels: int) -> str:
    identities = [[path, *stamp]
                  for path, stamp in zip(folder.files, folder.stamps, strict=True)]
    spec = {"format_version": FORMAT_VERSION, "files": identities, "labels": folder.labels,
            "classes": folder.classes, "image_size": image_size, "channels": channels}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def decode_image(path: str, image_size: int, channels: int) -> bytes:
    """One image as HWC uint8 bytes: decoded by PIL, converted to RGB (or L for one
    channel), resized to ``image_size`` square (bilinear)."""
    import io

    from PIL import Image

    if "://" in path:  # an object store's: read whole through its file system
        from raylm.data.sources import filesystem_for

        fs, where = filesystem_for(path)
        with fs.open_input_file(where) as f:
            path = io.BytesIO(f.read())
    with Image.open(path) as img:
        img.load()  # decode now: a truncated file fails here, not later
        return _fit(img, image_size, channels)


def _fit(img, image_size: int, channels: int) -> bytes:
    """A PIL image as HWC uint8 bytes: RGB (or L for one channel), ``image_size`` square
    (bilinear)."""
    from PIL import Image

    img = img.convert("RGB" if channels == 3 else "L")
    if img.size != (image_size, image_size):
        img = img.resize((image_size, image_size), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8).tobytes()


def _decode_task(batch: dict, *, image_size: int, channels: int) -> dict:
    """A Ray Data task: decode a batch of (id, path); a file that fails is an error row."""
    ids, pixels, errors = [], [], []
    for i, path in zip(batch["id"], batch["path"]):
        try:
            data, error = decode_image(str(path), image_size, channels), ""
        except Exception as e:  # PIL raises many types; each means "not an image we read"
            data = b"\0" * (image_size * image_size * channels)
            error = f"{path}: cannot read the image ({type(e).__name__}: {first_line(e)})"
        ids.append(int(i))
        pixels.append(data)
        errors.append(error)
    return {"id": np.asarray(ids, dtype=np.int64), "pixels": np.asarray(pixels, dtype=object),
            "error": np.asarray(errors, dtype=object)}


def _write_shard(tmp: str, first: int, pixels: list, labels, width: int) -> dict:
    """One shard of the cache being built (rows from sample id ``first``); its manifest
    entry."""
    name = f"shard-{first:012d}.arrow"
    table = pa.table({"pixels": pa.array(pixels, type=pa.binary(width)),
                      "label": pa.array(labels, type=pa.int32())})
    with pa.OSFile(os.path.join(tmp, name), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return {"file": name, "offset": first, "samples": len(pixels)}


def read_shard(path: str) -> pa.Table:
    """A shard of the image cache, memory-mapped: its buffers are the file's pages (an
    object store's shard: this node's copy of it)."""
    if storage.is_remote(path):
        path = _node_copy(path)
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _node_copy(uri: str) -> str:
    """An object store's shard on this node's disk, fetched once per node (a cache is
    named by its contents: a shard never changes), whole or not at all."""
    from raylm.data.tokenized import default_cache_root

    name = hashlib.sha256(uri.partition("?")[0].rpartition("@")[2].encode()).hexdigest()
    local = os.path.join(default_cache_root(), "bucket-images", name[:32] + ".arrow")
    if not os.path.isfile(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = f"{local}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            storage.download_file(uri, tmp)
            os.replace(tmp, local)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return local


def _commit(tmp: str, final: str, manifest: dict, replace: bool) -> None:
    """The manifest written last, then the directory renamed into place (an object
    store's: the shards uploaded, then the manifest)."""
    from raylm.data.tokenized import commit_build

    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **manifest}, f, indent=1)
    fs, path = storage.filesystem_for(final)
    commit_build(fs, tmp, path, replace=replace,
                 src_fs=pafs.LocalFileSystem() if storage.is_remote(final) else None)


def _build_dirs(cache_root: str, name: str) -> tuple[str, str]:
    """(the cache's root, a fresh local directory to build ``name`` in): under the root
    on a local disk (renamed into place), a temporary one for an object store's."""
    from raylm.data.tokenized import TMP_PREFIX, remove_stale_tmp

    root = storage.local_path(cache_root)
    local_root = tempfile.mkdtemp(prefix="raylm-images-") if storage.is_remote(root) \
        else root
    os.makedirs(local_root, exist_ok=True)
    if local_root == root:
        remove_stale_tmp(pafs.LocalFileSystem(), root, CACHE_PREFIX + name)  # (a crash's)
    tmp = os.path.join(local_root, f"{TMP_PREFIX}{CACHE_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    return root, tmp


def _remove_build_dir(root: str, tmp: str) -> None:
    with contextlib.suppress(OSError):
        pafs.LocalFileSystem().delete_dir(tmp)
    if storage.is_remote(root):  # (the temporary root too)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(tmp))


def build_image_dataset(folder: ImageFolder, image_size: int, channels: int,
                        cache_root: str, overwrite: bool = False,
                        before_decoding=None) -> ImageDataset:
    """Decode ``folder`` into the cache with Ray Data, or return the cache built earlier
    from the same files and settings. Ray must be initialised."""
    import ray

    from raylm.data.tokenized import TASK_NUM_CPUS, quiet_ray_data

    key = _key(folder, image_size, channels)
    final = storage.join(storage.local_path(cache_root), CACHE_PREFIX + key)
    if storage.isfile(storage.join(final, MANIFEST)) and not overwrite:
        return dataclasses.replace(ImageDataset.load(final), reused=True)
    if before_decoding is not None:
        before_decoding()
    root, tmp = _build_dirs(cache_root, key)
    try:
        quiet_ray_data()
        n = len(folder.files)
        items = [{"id": i, "path": p} for i, p in enumerate(folder.files)]
        ds = ray.data.from_items(items, override_num_blocks=max(1, -(-n // TASK_IMAGES)))
        ds = ds.map_batches(_decode_task, fn_kwargs=dict(image_size=image_size,
                                                         channels=channels),
                            batch_size=TASK_IMAGES, batch_format="numpy",
                            num_cpus=TASK_NUM_CPUS)
        labels = np.asarray(folder.labels, dtype=np.int32)
        width = image_size * image_size * channels
        shards, seen = [], np.zeros(n, dtype=bool)
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            bad = [e for e in batch["error"] if isinstance(e, str) and e]
            if bad:
                raise ConfigError(bad[0])
            order = np.argsort(batch["id"], kind="stable")
            ids = batch["id"][order]
            pixels = batch["pixels"][order]
            # contiguous runs of ids, each a shard named by its first id
            cuts = np.flatnonzero(np.diff(ids) != 1) + 1
            for run in np.split(np.arange(len(ids)), cuts):
                first = int(ids[run[0]])
                seen[ids[run]] = True
                shards.append(_write_shard(tmp, first, list(pixels[run]),
                                           labels[ids[run]], width))
        if not seen.all():  # (each image once: the tags must cover every id)
            raise RuntimeError(f"image cache: {int((~seen).sum())} images never came back "
                               "from Ray Data")
        shards.sort(key=lambda s: s["offset"])
        _commit(tmp, final, dict(key=key, num_samples=n, image_size=image_size,
                                 channels=channels, classes=folder.classes,
                                 root=folder.root, shards=shards), replace=overwrite)
    finally:
        _remove_build_dir(root, tmp)
    return ImageDataset.load(final)


# --- images from a dataset object: train(train_dataset=) ------------------------------
# A Ray Dataset (ray.data.read_images, read_parquet of encoded images, any map; a
# datasets.Dataset goes in as its Arrow table: raylm.data.given.as_ray) of rows with an
# ``image`` (an array HxW or HxWxC, encoded bytes, or datasets' {"bytes", "path"}) and a
# ``label`` (a class name, or an integer). An array is taken as PIL's fromarray reads it
# (HxW grey, HxWx3 RGB, HxWx4 RGBA): read_images(..., mode="RGB") decodes palette and
# CMYK files to RGB first, as the folder path's convert() does. Two passes, both in the
# dataset's order (raylm.data.given): the labels alone, on the driver, for the classes
# (the model's head is sized by them before any image is decoded); then the images,
# resized in Ray Data tasks and written by the driver as the folder's are, into a cache
# named by a digest of what was written.
IMAGE_COLUMN, LABEL_COLUMN = "image", "label"


@dataclass
class GivenImages:
    """A dataset of images given to train(), its classes read: what an ImageFolder is for
    a folder."""

    ds: object  # ray.data.Dataset, its columns IMAGE_COLUMN and LABEL_COLUMN
    arg: str  # train_dataset / eval_dataset
    classes: list[str]
    index: dict  # a label value -> its class id
    name: str = ""  # what errors call it (default: arg)

    @property
    def root(self) -> str:
        return f"({self.said})"

    @property
    def said(self) -> str:
        return self.name or self.arg


def given_images(ds, arg: str, classes: Optional[list] = None,
                 columns: tuple = (IMAGE_COLUMN, LABEL_COLUMN), name: str = ""
                 ) -> GivenImages:
    """``ds``'s classes: the sorted class names (or integers) among its labels; with
    ``classes`` (the training set's), its labels must be among them. ``columns``: its
    (image, label) columns (--image_column_name, --label_column_name), read as
    IMAGE_COLUMN and LABEL_COLUMN from here on; ``name``: what errors call it. One
    ConfigError for missing columns, missing or mixed labels."""
    from raylm.data.given import as_ray, batches, failure

    said = name or arg
    image, label = columns
    hf_names = _class_label_names(ds, label)
    ds = as_ray(ds, said)
    try:
        names = ds.schema(fetch_if_missing=True).names
    except Exception as e:
        raise failure(said, e) from e
    missing = [c for c in columns if c not in names]
    if missing:
        flags = "" if tuple(columns) == (IMAGE_COLUMN, LABEL_COLUMN) else \
            " (--image_column_name, --label_column_name)"
        raise ConfigError(f"{said}: no column {' or '.join(repr(c) for c in missing)} "
                          f"(columns: {', '.join(names)}); images are rows of '{image}' and "
                          f"'{label}'{flags}")
    if tuple(columns) != (IMAGE_COLUMN, LABEL_COLUMN):
        ds = ds.select_columns([image, label]).rename_columns(
            {image: IMAGE_COLUMN, label: LABEL_COLUMN})
    values = []
    for batch in batches(ds.select_columns([LABEL_COLUMN]), said, "pyarrow"):
        values += batch.column(LABEL_COLUMN).to_pylist()
    return GivenImages(ds, arg, *_classes(values, hf_names, classes, said), name)


def dataset_classes(ds, column: str) -> Optional[list]:
    """The classes ``given_images`` finds in a datasets.Dataset's label ``column``, read
    in this process (``raylm plan`` sizes the head by them, with no Ray); None without
    that column. (A row with no label is train's error, where its row is known.)"""
    if column not in (getattr(ds, "column_names", None) or ()):
        return None
    values = [v for v in ds.unique(column) if v is not None]
    return _classes(values, _class_label_names(ds, column), None, f"column '{column}'")[0]


def _classes(values: list, hf_names: Optional[list], classes: Optional[list],
             said: str) -> tuple:
    """(class names, {label value: class id}) of a dataset's label ``values``: a
    ClassLabel's names (``hf_names``) for integer ids, else the sorted labels; with
    ``classes`` (the training set's), the labels must be among them, by name. One
    ConfigError for no, missing or mixed labels."""
    if not values:
        raise ConfigError(f"{said} is empty (no rows)")
    if any(v is None for v in values):
        raise ConfigError(f"{said}: row {values.index(None)} has no label")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    if not ints and not all(isinstance(v, str) for v in values):
        kinds = sorted({type(v).__name__ for v in values})
        raise ConfigError(f"{said}: labels must be class names (str) or class ids (int), "
                          f"not {', '.join(kinds)}")
    found = sorted(set(values))
    if hf_names and ints and not 0 <= found[0] <= found[-1] < len(hf_names):
        odd = found[0] if found[0] < 0 else found[-1]
        raise ConfigError(f"{said}: label {odd} is not one of its ClassLabel's "
                          f"{len(hf_names)} classes (-1: a row with no label)")
    if classes is not None:  # (the training set's, by name)
        names_of = {v: (hf_names[v] if hf_names and ints else str(v)) for v in found}
        extra = [names_of[v] for v in found if names_of[v] not in classes]
        if extra:
            raise ConfigError(f"{said}: labels the training data does not have: "
                              f"{', '.join(extra[:5])}")
        return list(classes), {v: classes.index(names_of[v]) for v in found}
    if hf_names and ints:  # datasets' ClassLabel: the ids are the classes
        return list(hf_names), {v: v for v in found}
    if len(found) < 2:
        raise ConfigError(f"{said}: one class ({found[0]}); a classifier needs at least two")
    return [str(v) for v in found], {v: i for i, v in enumerate(found)}


def _class_label_names(ds, column: str) -> Optional[list]:
    """The class names of a datasets.Dataset's ClassLabel feature ``column``, if it is one."""
    features = getattr(ds, "features", None)
    label = features.get(column) if isinstance(features, dict) else None
    return list(label.names) if hasattr(label, "names") else None


def _pixels_of(value, image_size: int, channels: int) -> bytes:
    """One row's image as HWC uint8 bytes at ``image_size`` square (as decode_image)."""
    import io

    from PIL import Image

    if isinstance(value, dict):  # datasets' Image feature
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, str)):
        img = Image.open(io.BytesIO(value) if not isinstance(value, str) else value)
        img.load()
    else:
        arr = np.asarray(value)
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        if arr.dtype != np.uint8:
            raise ValueError(f"an image array of {arr.dtype}; uint8 pixels expected")
        img = Image.fromarray(arr)
    return _fit(img, image_size, channels)


def _rows_task(batch: dict, *, image_size: int, channels: int, index: dict) -> dict:
    """A Ray Data task: a batch of (image, label) rows resized, labels as class ids; a row
    that fails is an error row (see _decode_task)."""
    pixels, labels, errors = [], [], []
    for value, label in zip(batch[IMAGE_COLUMN], batch[LABEL_COLUMN]):
        label = label.item() if hasattr(label, "item") else label
        try:
            data, error = _pixels_of(value, image_size, channels), ""
            if label not in index:
                error = f"label {label!r} was not there when the labels were read"
        except Exception as e:  # PIL raises many types
            data, error = b"", f"cannot read an image ({type(e).__name__}: {first_line(e)})"
        pixels.append(data or b"\0" * (image_size * image_size * channels))
        labels.append(index.get(label, -1))
        errors.append(error)
    return {"pixels": np.asarray(pixels, dtype=object),
            "label": np.asarray(labels, dtype=np.int32),
            "error": np.asarray(errors, dtype=object)}


def build_given_images(given: GivenImages, image_size: int, channels: int, cache_root: str,
                       overwrite: bool = False, before_decoding=None
                       ) -> tuple[ImageDataset, str]:
    """(the image cache, its digest) of ``given``'s rows: resized in Ray Data tasks, in the
    dataset's order; a cache of the same rows built earlier is reused (the pass runs to
    learn that), or replaced with ``overwrite`` (--overwrite_cache)."""
    from raylm.data.given import batches
    from raylm.data.tokenized import TASK_NUM_CPUS, quiet_ray_data

    if before_decoding is not None:
        before_decoding()
    root, tmp = _build_dirs(cache_root, given.arg)
    width = image_size * image_size * channels
    # The digest: of the settings, the pixels and the labels, each in row order across
    # batches (not of how Ray Data cut the rows into them)
    pixel_digest, label_digest = hashlib.sha256(), hashlib.sha256()
    shards, n = [], 0
    try:
        quiet_ray_data()
        ds = given.ds.map_batches(_rows_task, fn_kwargs=dict(
            image_size=image_size, channels=channels, index=given.index),
            batch_size=TASK_IMAGES, batch_format="numpy", num_cpus=TASK_NUM_CPUS)
        for batch in batches(ds, given.said, "numpy"):
            bad = [e for e in batch["error"] if isinstance(e, str) and e]
            if bad:
                raise ConfigError(f"{given.said}: {bad[0]}")
            if not len(batch["label"]):
                continue
            for p in batch["pixels"]:
                pixel_digest.update(p)
            label_digest.update(np.ascontiguousarray(batch["label"], dtype="<i4").tobytes())
            shards.append(_write_shard(tmp, n, list(batch["pixels"]), batch["label"], width))
            n += len(batch["label"])
        if n == 0:
            raise ConfigError(f"{given.said} is empty (no rows)")
        # The data's digest (in the run's fingerprint: a run resumes only on the same
        # rows) is of what was written, not of how it is stored: 1 is the digest's own
        # version, which the cache format does not change; the directory names both.
        key = hashlib.sha256(json.dumps([1, image_size, channels, given.classes]).encode()
                             + pixel_digest.digest() + label_digest.digest()).hexdigest()[:24]
        final = storage.join(root, f"{CACHE_PREFIX}{key}-v{FORMAT_VERSION}")
        if storage.isfile(storage.join(final, MANIFEST)) and not overwrite:
            return dataclasses.replace(ImageDataset.load(final), reused=True), key
        _commit(tmp, final, dict(key=key, num_samples=n, image_size=image_size,
                                 channels=channels, classes=given.classes, root=given.root,
                                 shards=shards), replace=overwrite)
    finally:
        _remove_build_dir(root, tmp)
    return ImageDataset.load(final), key
