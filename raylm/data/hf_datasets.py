"""--dataset_name: data through Hugging Face ``datasets.load_dataset``, as run_clm reads it.

A Hub dataset id (``org/name``, with --dataset_config_name), a local dataset directory, or
one of the builders ``json`` / ``csv`` / ``text`` / ``parquet`` reading --train_file and
--validation_file as its ``data_files``. Its splits are exported once, on the driver, to
parquet files under the data cache (keyed by the dataset's own fingerprint, written
atomically), and from there on they are files like any --train_file: tokenized into the
block cache by Ray Data, each sample once per epoch in the seeded, layout-independent
order. That keeps one data path for every source; ``datasets`` does what it does well
(the Hub, its builders and their parsing, its own download cache under --cache_dir).

Offline (HF_HUB_OFFLINE=1, or no network), ``load_dataset`` of a Hub id answers only from
its own prepared-data cache; raylm then loads the repository's files from the Hub's file
cache instead (what ``snapshot_download`` put there), so a dataset downloaded once with
``hf download --repo-type dataset`` trains without a network.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Optional

from raylm import storage
from raylm.errors import ConfigError, first_line

log = logging.getLogger("raylm")

BUILDERS = ("json", "csv", "text", "parquet")
EXPORT_DIR = "hf-datasets"


def load_splits(cfg):
    """The DatasetDict --dataset_name names (a ConfigError line when it cannot be had)."""
    import datasets

    from raylm.data.sources import resolve_files

    name, config = cfg.dataset_name, cfg.dataset_config_name
    common = dict(token=cfg.token, cache_dir=cfg.cache_dir)
    if name in BUILDERS:
        train_files, eval_files = [
            resolve_files(specs, flag) if specs else []
            for specs, flag in ((cfg.train_file, "--train_file"),
                                (cfg.validation_file, "--validation_file"))]
        if not train_files and not eval_files:
            raise ConfigError(f"--dataset_name {name} reads --train_file (and "
                              "--validation_file) with the datasets builder of that name: "
                              "give the files")
        data_files = {k: v for k, v in (("train", train_files), ("validation", eval_files))
                      if v}
        extra = {"keep_linebreaks": cfg.keep_linebreaks} if name == "text" else {}
        try:
            return datasets.load_dataset(name, data_files=data_files, **extra, **common)
        except Exception as e:
            raise ConfigError(f"--dataset_name {name}: cannot read {data_files}: "
                              f"{first_line(e)}") from None
    if cfg.train_file or cfg.validation_file:
        raise ConfigError(f"--dataset_name {name} brings its own splits: drop --train_file "
                          "and --validation_file (or give --dataset_name json|csv|text|"
                          "parquet to read those files through datasets)")
    try:
        return datasets.load_dataset(name, config, **common)
    except ConnectionError as e:
        local = _cached_snapshot(name, cfg)
        if local is None:
            raise ConfigError(f"--dataset_name {name}: the Hub cannot be reached ("
                              f"{first_line(e)}) and the dataset is not in the cache "
                              f"{cfg.cache_dir or '(Hugging Face default)'}") from None
        log.info("offline: %s from the Hub cache, %s", name, local)
        try:
            return datasets.load_dataset(local, config, **common)
        except Exception as e2:
            raise ConfigError(f"--dataset_name {name} (cached at {local}): "
                              f"{first_line(e2)}") from None
    except Exception as e:
        raise ConfigError(f"--dataset_name {name}"
                          + (f" --dataset_config_name {config}" if config else "")
                          + f": {first_line(e)}") from None


def _cached_snapshot(name: str, cfg) -> Optional[str]:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", cache_dir=cfg.cache_dir,
                                 token=cfg.token, local_files_only=True)
    except Exception:
        return None


def dataset_files(cfg, cache_root: str) -> tuple[list[str], list[str]]:
    """(train files, validation files): the dataset's ``train`` and ``validation`` splits
    as parquet files (none for a split the dataset lacks: raylm then holds out
    --validation_split_percentage of the training blocks, as run_clm splits ``train``)."""
    splits = load_splits(cfg)
    if "train" not in splits:
        raise ConfigError(f"--dataset_name {cfg.dataset_name} has no 'train' split (it has "
                          f"{', '.join(splits)})")
    out = []
    for split in ("train", "validation"):
        if split not in splits:
            out.append([])
            continue
        out.append([_export(splits[split], split, cache_root)])
    return out[0], out[1]


def _export(ds, split: str, cache_root: str) -> str:
    """The split as one parquet file, written once per dataset fingerprint: to a
    temporary name, then renamed, or to an object store in one upload (a crash leaves
    nothing that is read)."""
    path = storage.join(storage.local_path(cache_root), EXPORT_DIR, ds._fingerprint,
                        f"{split}.parquet")
    if storage.isfile(path):
        return path
    with storage.written_dir(storage.join(storage.local_path(cache_root), EXPORT_DIR,
                                          ds._fingerprint)) as directory:
        tmp = os.path.join(directory, f".tmp-{split}-{uuid.uuid4().hex[:8]}.parquet")
        try:
            ds.to_parquet(tmp)
            os.replace(tmp, os.path.join(directory, f"{split}.parquet"))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    log.info("dataset split %s: %d rows exported to %s", split, len(ds), path)
    return path
