"""--task image-classification before any actor starts: the images checked and the
classifier resolved (check_image_inputs), then decoded into the image cache (image_data)."""

from __future__ import annotations

import logging

import numpy as np

from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.runtime.inputs import Data, Inputs, room_for_tasks

log = logging.getLogger("raylm")


def check_image_inputs(cfg: TrainConfig, model_init, tp_plan=None, compute_loss_func=None,
                       datasets=None) -> Inputs:
    """check_inputs for --task image-classification: the image folders scanned (classes,
    files), or the datasets given read (classes; then their images resized into the
    cache, raylm.data.images.build_given_images), the classifier resolved with their
    classes. (The output dir's check and the last ones follow in check_inputs.)"""
    from raylm.data.images import given_images, scan_image_folder
    from raylm.models.loading import resolve_block_size, resolve_model

    from raylm.models.vision import check_image_flags

    check_image_flags(cfg)
    if not 0.0 <= cfg.train_val_split < 1.0:
        raise ConfigError(f"--train_val_split must be in [0, 1) (got {cfg.train_val_split})")
    datasets = datasets or {}
    for arg, flag in (("train_dataset", "train_dir"), ("eval_dataset", "validation_dir")):
        if arg in datasets and getattr(cfg, flag):
            raise ConfigError(f"{arg} and --{flag} both given: give the images one way")
    names = {arg: arg for arg in datasets}  # (what the errors call each)
    if cfg.dataset_name:
        datasets, names = _image_splits(cfg, datasets)
    elif not datasets:
        for flag in ("image_column_name", "label_column_name"):
            if cfg.is_set(flag):
                raise ConfigError(f"--{flag} names a column of --dataset_name (or of a "
                                  "dataset given to train()); an image folder has none")
    columns = (cfg.image_column_name, cfg.label_column_name)
    if datasets:
        room_for_tasks()
    if "train_dataset" in datasets:
        train = given_images(datasets["train_dataset"], "train_dataset", columns=columns,
                             name=names["train_dataset"])
    elif not cfg.train_dir:
        raise ConfigError("--task image-classification needs --train_dir: an image folder "
                          "(DIR/<class name>/<image>.png|jpg|...), or from Python "
                          "train(..., train_dataset=) of image and label rows")
    else:
        train = scan_image_folder(cfg.train_dir, "--train_dir")
        if len(train.classes) < 2:
            raise ConfigError(f"--train_dir {train.root}: one class ({train.classes[0]}); "
                              "a classifier needs at least two class directories")
    val = (given_images(datasets["eval_dataset"], "eval_dataset", train.classes,
                        columns=columns, name=names["eval_dataset"])
           if "eval_dataset" in datasets else
           scan_image_folder(cfg.validation_dir, "--validation_dir", train.classes)
           if cfg.validation_dir else None)
    spec = resolve_model(cfg, model_init, classes=train.classes, tp_plan=tp_plan)
    spec.loss_fn = compute_loss_func  # (before the output dir's check: the run's code)
    inputs = Inputs(spec=spec, block_size=resolve_block_size(cfg, spec), train_files=[],
                    eval_files=[], images=(train, val))
    if datasets:
        _build_given_images(cfg, inputs)
    return inputs


def _image_splits(cfg: TrainConfig, datasets: dict) -> tuple[dict, dict]:
    """--dataset_name's images: its train split, and its validation split where it has
    one (else --train_val_split of train is held out, as run_image_classification does),
    as the datasets given to train() are read; and what the errors call each."""
    from raylm.data.hf_datasets import BUILDERS, load_splits

    name = cfg.dataset_name
    given = [f"--{f}" for f in ("train_dir", "validation_dir") if getattr(cfg, f)] + list(datasets)
    if given:
        raise ConfigError(f"--dataset_name with {' and '.join(given)}: give the images one way")
    if name in BUILDERS:
        raise ConfigError(f"--dataset_name {name} reads --train_file, which images do not "
                          "take: give a dataset id or directory, or an image folder as "
                          "--train_dir")
    splits = load_splits(cfg)
    if "train" not in splits:
        raise ConfigError(f"--dataset_name {name} has no 'train' split (it has "
                          f"{', '.join(splits)})")
    out = {"train_dataset": splits["train"]}
    if "validation" in splits:
        out["eval_dataset"] = splits["validation"]
    return out, {"train_dataset": f"--dataset_name {name} (train)",
                 "eval_dataset": f"--dataset_name {name} (validation)"}


def _build_given_images(cfg: TrainConfig, inputs: Inputs) -> None:
    """The datasets of images given to train(), resized into the image cache now: the
    cache's digest names the data in the run's fingerprint (as a text export's does)."""
    from raylm.data.images import GivenImages, build_given_images
    from raylm.data.tokenized import default_cache_root
    from raylm.models.vision import channels, image_size

    size, c = image_size(inputs.spec.config), channels(inputs.spec.config)
    built = []
    for item in inputs.images:
        if isinstance(item, GivenImages):
            dataset, key = build_given_images(item, size, c,
                                              cfg.data_cache_dir or default_cache_root(),
                                              overwrite=cfg.overwrite_cache,
                                              before_decoding=room_for_tasks)
            inputs.given[item.arg] = f"images:{key}"
            item = dataset
        built.append(item)
    inputs.images = tuple(built)


def image_data(cfg: TrainConfig, inputs: Inputs) -> Data:
    """--task image-classification: the folders decoded into the image cache (Ray Data
    tasks; reused when built before), the validation images --validation_dir's or a
    seeded --train_val_split share of --train_dir's."""
    from raylm.data.images import ImageDataset, build_image_dataset
    from raylm.data.sampler import split_train_eval
    from raylm.data.tokenized import default_cache_root
    from raylm.models.vision import channels, image_size

    train_folder, val_folder = inputs.images
    size, c = image_size(inputs.spec.config), channels(inputs.spec.config)

    def build(folder):
        if isinstance(folder, ImageDataset):  # (a dataset given: built by check_inputs)
            return folder
        return build_image_dataset(folder, size, c, cfg.data_cache_dir or default_cache_root(),
                                   overwrite=cfg.overwrite_cache,
                                   before_decoding=room_for_tasks)

    train = build(train_folder)
    log.info("training data: %d images of %d classes, %dx%d (%s)", train.num_samples,
             len(train.classes), size, size, "cached" if train.reused else "decoded now")
    if val_folder is not None:
        eval_ds = build(val_folder)
        eval_ids = np.arange(eval_ds.num_samples, dtype=np.int64)
        train_ids = np.arange(train.num_samples, dtype=np.int64)
    else:
        train_ids, eval_ids = split_train_eval(train.num_samples, cfg.train_val_split * 100,
                                               seed=0)
        eval_ds = train if len(eval_ids) else None
    # --max_train_samples / --max_eval_samples: a seeded choice (ids run class by class,
    # so the first N would be the first classes only; run_image_classification shuffles)
    rng = np.random.default_rng(0)
    if cfg.max_train_samples is not None:
        train_ids = np.sort(rng.permutation(train_ids)[:cfg.max_train_samples])
    if cfg.max_eval_samples is not None:
        eval_ids = np.sort(rng.permutation(eval_ids)[:cfg.max_eval_samples])
    if cfg.should_train and len(train_ids) == 0:
        raise ConfigError("no training images left after the validation split")
    return Data(train=train, eval=eval_ds, train_ids=train_ids, eval_ids=eval_ids)
