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
(raylm.data.tokenized): written under a temporary name, manifest last, renamed.

Layout of a cache directory (``<cache_root>/images-<key>/``)::

    manifest.json             written last; what ImageDataset.load reads
    shard-<first id>.parquet  columns pixels (fixed_size_binary, H*W*C bytes, HWC uint8)
                              and label (int32)

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
import uuid
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raylm.errors import ConfigError, first_line

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
FORMAT_VERSION = 1
CACHE_PREFIX = "images-"
MANIFEST = "manifest.json"
# Images per Ray Data task: decoding is PIL work of a few milliseconds per image.
TASK_IMAGES = 256


@dataclass
class ImageFolder:
    """An image folder, scanned: its classes and its images in sample-id order."""

    root: str
    classes: list[str]
    files: list[str]  # absolute paths, in (class, path) order
    labels: list[int]


def scan_image_folder(root: str, flag: str, classes: Optional[list] = None) -> ImageFolder:
    """The images under ``root`` (``class/…/image.ext``); one ConfigError naming ``flag``
    for a directory that is missing, holds no class directories or no images, or (with
    ``classes``: the training folder's) a class the training folder lacks."""
    if "://" in root:
        raise ConfigError(f"{flag} {root}: image folders are read from a local or shared "
                          "file system (not yet from an object store)")
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise ConfigError(f"{flag}: no such directory: {root}")
    found: dict[str, list[str]] = {}
    for name in sorted(os.listdir(root)):
        sub = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(sub):
            continue
        images = []
        for dirpath, dirnames, filenames in os.walk(sub):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            images += [os.path.join(dirpath, f) for f in sorted(filenames)
                       if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")]
        if images:
            found[name] = sorted(images)
    if not found:
        raise ConfigError(f"{flag} {root}: no images in class directories (expected "
                          f"{root}/<class name>/<image>{'|'.join(IMAGE_EXTENSIONS)})")
    names = classes if classes is not None else sorted(found)
    extra = sorted(set(found) - set(names))
    if extra:
        raise ConfigError(f"{flag} {root}: class directories the training data does not "
                          f"have: {', '.join(extra[:5])}")
    index = {c: i for i, c in enumerate(names)}
    files, labels = [], []
    for name in sorted(found, key=index.get):
        files += found[name]
        labels += [index[name]] * len(found[name])
    return ImageFolder(root, list(names), files, labels)


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
        with open(os.path.join(cache_dir, MANIFEST)) as f:
            m = json.load(f)
        if m.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{cache_dir}: image cache format {m.get('format_version')} "
                              f"is not {FORMAT_VERSION}")
        return cls(cache_dir=cache_dir, num_samples=m["num_samples"],
                   image_size=m["image_size"], channels=m["channels"], classes=m["classes"],
                   shard_files=[os.path.join(cache_dir, s["file"]) for s in m["shards"]],
                   shard_offsets=[s["offset"] for s in m["shards"]])


def _key(folder: ImageFolder, image_size: int, channels: int) -> str:
    identities = []
    for path in folder.files:
        st = os.stat(path)
        identities.append([path, st.st_size, st.st_mtime_ns])
    spec = {"format_version": FORMAT_VERSION, "files": identities, "labels": folder.labels,
            "classes": folder.classes, "image_size": image_size, "channels": channels}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:24]


def decode_image(path: str, image_size: int, channels: int) -> bytes:
    """One image as HWC uint8 bytes: decoded by PIL, converted to RGB (or L for one
    channel), resized to ``image_size`` square (bilinear)."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()  # decode now: a truncated file fails here, not later
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


def build_image_dataset(folder: ImageFolder, image_size: int, channels: int,
                        cache_root: str, overwrite: bool = False,
                        before_decoding=None) -> ImageDataset:
    """Decode ``folder`` into the cache with Ray Data, or return the cache built earlier
    from the same files and settings. Ray must be initialised."""
    import ray

    from raylm.data.tokenized import (TASK_NUM_CPUS, TMP_PREFIX, commit_build,
                                      quiet_ray_data, remove_stale_tmp)

    if "://" in cache_root:
        raise ConfigError(f"--data_cache_dir {cache_root}: the image cache is written to a "
                          "local or shared file system (not yet to an object store)")
    key = _key(folder, image_size, channels)
    root = os.path.abspath(os.path.expanduser(cache_root))
    final = os.path.join(root, CACHE_PREFIX + key)
    if os.path.isfile(os.path.join(final, MANIFEST)) and not overwrite:
        return dataclasses.replace(ImageDataset.load(final), reused=True)
    if before_decoding is not None:
        before_decoding()
    os.makedirs(root, exist_ok=True)
    remove_stale_tmp(pafs.LocalFileSystem(), root, CACHE_PREFIX + key)  # (a crash's)
    tmp = os.path.join(root, f"{TMP_PREFIX}{CACHE_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
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
                table = pa.table({
                    "pixels": pa.array(list(pixels[run]), type=pa.binary(width)),
                    "label": pa.array(labels[ids[run]], type=pa.int32())})
                name = f"shard-{first:012d}.parquet"
                pq.write_table(table, os.path.join(tmp, name))
                shards.append({"file": name, "offset": first, "samples": len(run)})
        if not seen.all():  # (each image once: the tags must cover every id)
            raise RuntimeError(f"image cache: {int((~seen).sum())} images never came back "
                               "from Ray Data")
        shards.sort(key=lambda s: s["offset"])
        manifest = {"format_version": FORMAT_VERSION, "key": key, "num_samples": n,
                    "image_size": image_size, "channels": channels,
                    "classes": folder.classes, "root": folder.root, "shards": shards}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        commit_build(pafs.LocalFileSystem(), tmp, final, replace=overwrite)
    finally:
        with contextlib.suppress(OSError):
            pafs.LocalFileSystem().delete_dir(tmp)
    return ImageDataset.load(final)
