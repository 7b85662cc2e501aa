"""Everything the driver checks and builds before any actor starts.

Split in two: ``check_inputs`` needs no cluster (flags, files, model, output_dir) and
runs first, so most bad input fails in a second; ``prepare_data`` tokenizes with Ray
Data (or reuses the cache) once Ray is up.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from raylm.checkpoint.manager import CheckpointManager, read_trainer_state
from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.runtime.metrics import reporting_to
from raylm.runtime.precision import check_precision

log = logging.getLogger("raylm")
RUN_RECORD = "raylm_run.json"


@dataclass
class Inputs:
    spec: object  # ModelSpec
    block_size: int
    train_files: list
    eval_files: list
    # With several --validation_file: each eval file's set name (eval_<name>_loss)
    eval_names: list = field(default_factory=list)
    resume_from: Optional[str] = None  # checkpoint directory
    streaming: bool = False  # the training data is streamed (streams())
    run_record: Optional[dict] = None  # of the run being resumed
    # --task image-classification: (training ImageFolder, validation ImageFolder or None)
    images: Optional[tuple] = None
    # train(train_dataset=, eval_dataset=): each one's digest (raylm.data.given), part of
    # the run's fingerprint
    given: dict = field(default_factory=dict)


@dataclass
class Data:
    train: object  # TokenizedDataset (None when not training)
    eval: object  # TokenizedDataset the eval ids index into (None: no eval)
    train_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    eval_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # Several validation sets: [(name, ids)], reported each and together (eval_ids)
    eval_sets: list = field(default_factory=list)
    stream: object = None  # --streaming: the TokenStream (train is then its StreamSpec)


def check_inputs(cfg: TrainConfig, check_output_dir: bool = True, model_init=None,
                 compute_loss_func=None, tp_plan=None, datasets: Optional[dict] = None,
                 on_checked=None) -> Inputs:
    """``datasets``: {"train_dataset": ..., "eval_dataset": ...} given to train() (None
    entries absent); a Ray Dataset among them needs Ray connected. ``on_checked()``,
    when given, is called before the last check, the schedule's (_last_check): the
    driver starts Ray's cluster there (raylm.runtime.cluster.EarlyStart)."""
    from raylm.models.loading import resolve_block_size, resolve_model

    _check_numbers(cfg)
    check_precision(cfg)
    if not cfg.should_train and not cfg.should_eval:
        raise ConfigError("--do_train false and --do_eval false: nothing to do")
    if compute_loss_func is not None:
        if not callable(compute_loss_func):
            raise ConfigError("compute_loss_func must be a callable (outputs, labels, "
                              f"num_items_in_batch) -> loss, not "
                              f"{type(compute_loss_func).__name__}")
        # (a plan of the user's own leaves the logits whole: their loss takes them)
        if cfg.tp and cfg.tp > 1 and tp_plan is None:
            raise ConfigError(f"compute_loss_func with --tp {cfg.tp}: the logits are sharded "
                              "on the vocabulary there; not available yet")
        if not cfg.tp and tp_plan is None:  # (nor may the planner choose it)
            cfg.tp = 1
    if not cfg.should_train and not cfg.model_name_or_path and model_init is None:
        raise ConfigError("--do_eval without --do_train evaluates a trained model: give "
                          "--model_name_or_path")
    datasets = {k: v for k, v in (datasets or {}).items() if v is not None}
    if cfg.task == "image-classification":
        return _check_image_inputs(cfg, check_output_dir, model_init, tp_plan,
                                   compute_loss_func, datasets, on_checked)
    for flag in ("train_dir", "validation_dir", "image_size", "num_channels",
                 "image_column_name", "label_column_name", "ignore_mismatched_sizes"):
        if cfg.is_set(flag):
            raise ConfigError(f"--{flag} is for image data: give --task image-classification "
                              "with it (text data is --train_file, its column --text_column)")
    given: dict = {}
    train_files, eval_files, eval_names = _data_files(cfg, datasets, given)
    spec = resolve_model(cfg, model_init, tp_plan=tp_plan)  # (and its objective)
    spec.loss_fn = compute_loss_func
    block_size = resolve_block_size(cfg, spec)
    inputs = Inputs(spec=spec, block_size=block_size, train_files=train_files,
                    eval_files=eval_files, eval_names=eval_names, given=given,
                    streaming=bool(train_files) and cfg.should_train
                    and streams(cfg, train_files, say=True))
    if cfg.should_train and check_output_dir:
        _check_output_dir(cfg, inputs)
    _last_check(cfg, on_checked)
    return inputs


def _check_image_inputs(cfg: TrainConfig, check_output_dir: bool, model_init,
                        tp_plan=None, compute_loss_func=None, datasets=None,
                        on_checked=None) -> Inputs:
    """check_inputs for --task image-classification: the image folders scanned (classes,
    files), or the datasets given read (classes; then their images resized into the
    cache, raylm.data.images.build_given_images), the classifier resolved with their
    classes."""
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
        _room_for_tasks()
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
    if cfg.should_train and check_output_dir:
        _check_output_dir(cfg, inputs)
    _last_check(cfg, on_checked)
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
                                              before_decoding=_room_for_tasks)
            inputs.given[item.arg] = f"images:{key}"
            item = dataset
        built.append(item)
    inputs.images = tuple(built)


def _data_files(cfg: TrainConfig, datasets: dict, given: dict
                ) -> tuple[list[str], list[str], list[str]]:
    """(training files, validation files, the validation files' set names), checked:
    the datasets given to train() (exported to files; their digests into ``given``),
    --dataset_name's splits, or --train_file / --validation_file (default: the built-in
    sample). Evaluating alone without validation files evaluates on the held-out part of
    the training files. Each --validation_file given (a file, directory or glob) is a
    set of its own when there are several (names: ``eval_set_names``)."""
    from raylm.data.sources import validate_files
    from raylm.data.tokenized import default_cache_root

    root = cfg.data_cache_dir if cfg.data_cache_dir and "://" not in cfg.data_cache_dir \
        else default_cache_root()  # (exports are written where the driver writes)
    if datasets:
        return _given_files(cfg, datasets, given, root)
    if cfg.dataset_name:
        from raylm.data.hf_datasets import dataset_files

        train, evals = dataset_files(cfg, root)
        validate_files(train + evals, cfg.text_column, "--dataset_name")
        return ([] if evals and not cfg.should_train else train), evals, []

    evals, names = _validation_files(cfg)
    if cfg.should_train or not evals:
        return _training_files(cfg), evals, names
    return [], evals, names


def _training_files(cfg: TrainConfig) -> list[str]:
    """--train_file's files (default: the built-in sample), checked."""
    from raylm.data.sources import builtin_sample_files, resolve_files, validate_files

    files = (resolve_files(cfg.train_file, "--train_file") if cfg.train_file
             else builtin_sample_files())
    # (streamed data is not read whole up front: its first chunk is checked)
    validate_files(files, cfg.text_column, "--train_file",
                   scan=not (cfg.should_train and streams(cfg, files)))
    return files


def _validation_files(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(--validation_file's files, their set names: with several, each one's)."""
    from raylm.data.sources import resolve_files, validate_files

    evals, names = [], []
    if len(cfg.validation_file) > 1:
        for spec, name in zip(cfg.validation_file, eval_set_names(cfg.validation_file)):
            files = resolve_files([spec], "--validation_file")
            evals += files
            names += [name] * len(files)
    elif cfg.validation_file:
        evals = resolve_files(cfg.validation_file, "--validation_file")
    validate_files(evals, cfg.text_column, "--validation_file")
    return evals, names


def _given_files(cfg: TrainConfig, datasets: dict, given: dict, root: str
                 ) -> tuple[list[str], list[str], list[str]]:
    """_data_files for train(train_dataset=, eval_dataset=): each exported to a parquet
    file (raylm.data.given); the other set, if not given, is --train_file's (or the
    sample) / --validation_file's. Evaluating alone with a validation set reads no
    training set."""
    from raylm.data.given import export, kind_of
    from raylm.data.sources import validate_files

    for arg, ds in datasets.items():
        kind_of(ds, arg)  # (its type checked before anything is read)
    if cfg.dataset_name:
        raise ConfigError(f"--dataset_name with {' and '.join(datasets)}: give the data one "
                          "way")
    for arg, flag in (("train_dataset", "train_file"), ("eval_dataset", "validation_file")):
        if arg in datasets and getattr(cfg, flag):
            raise ConfigError(f"{arg} and --{flag} both given: give the data one way")
    _room_for_tasks()

    def exported(arg: str) -> list[str]:
        path, given[arg] = export(datasets[arg], arg, cfg.text_column, root)
        # (a streamed export is not read whole up front: as --train_file)
        validate_files([path], cfg.text_column, arg,
                       scan=not (arg == "train_dataset" and cfg.should_train
                                 and streams(cfg, [path])))
        return [path]

    evals, names = (exported("eval_dataset"), []) if "eval_dataset" in datasets \
        else _validation_files(cfg)
    if not cfg.should_train and evals:
        return [], evals, names  # (evaluating alone: the training set is not read)
    train = exported("train_dataset") if "train_dataset" in datasets \
        else _training_files(cfg)
    return train, evals, names


def _naming_the_argument(e: ConfigError, files: list, inputs) -> ConfigError:
    """An error in a dataset given to train() (its rows, as raylm exported them to a file)
    named by the argument the user gave it as, not by the export file."""
    text = str(e)
    for arg, given in (("train_dataset", inputs.train_files),
                       ("eval_dataset", inputs.eval_files)):
        if arg in inputs.given and files == given and text.startswith(f"{files[0]}: "):
            return ConfigError(f"{arg}: {text[len(files[0]) + 2:]}")
    return e


def eval_set_names(specs: list[str]) -> list[str]:
    """A metric name for each --validation_file: its file or directory name without the
    extension, in letters, digits and underscores (a glob's fixed part); made unique
    with a number where two would clash."""
    names = []
    for spec in specs:
        base = os.path.basename(spec.rstrip("/")) or "eval"
        base = re.sub(r"[^A-Za-z0-9_]+", "_", base.split(".")[0]).strip("_") or "eval"
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


STREAM_AUTO_BYTES = 1 << 30


def streams(cfg: TrainConfig, files: list[str], say: bool = False) -> bool:
    """Whether the training data is streamed: --streaming true or false decides. Unset,
    a corpus over STREAM_AUTO_BYTES streams when the run allows it, since tokenizing it
    up front would keep the cluster waiting for minutes; a smaller one goes through the
    cache, which gives a global shuffle, exact epochs and reuse across runs for the cost
    of a short pass."""
    if cfg.streaming is not None:
        return bool(cfg.streaming)
    # (and evaluation, where it runs, on a --validation_file: a stream has no split)
    if _streaming_obstacle(cfg) is not None or not (cfg.validation_file
                                                    or cfg.do_eval is False):
        return False
    from raylm.data.sources import filesystem_for

    total = 0
    for path in files:
        fs, fs_path = filesystem_for(path)
        total += fs.get_file_info(fs_path).size or 0
        if total > STREAM_AUTO_BYTES:
            if say:
                log.info("training data over %d GiB: streamed (--streaming false to "
                         "tokenize it into the cache first)", STREAM_AUTO_BYTES >> 30)
            return True
    return False


def _check_streaming(cfg: TrainConfig) -> None:
    """--streaming's constraints, as HF's: the length of a stream is not known ahead."""
    if cfg.piece_size_mb <= 0:
        raise ConfigError(f"--piece_size_mb must be > 0 (got {cfg.piece_size_mb})")
    if cfg.shuffle_buffer_size < 1:
        raise ConfigError(f"--shuffle_buffer_size must be >= 1 (got "
                          f"{cfg.shuffle_buffer_size})")
    if cfg.streaming_buffer_mb <= 0:
        raise ConfigError(f"--streaming_buffer_mb must be > 0 (got {cfg.streaming_buffer_mb})")
    obstacle = _streaming_obstacle(cfg)
    if cfg.streaming and obstacle is not None:  # (unset: streams() does not stream then)
        raise ConfigError(obstacle)


def _streaming_obstacle(cfg: TrainConfig) -> Optional[str]:
    """Why this run cannot stream (as HF's streaming: a stream's length is not known
    ahead), or None."""
    if cfg.max_steps <= 0:
        return ("--streaming needs --max_steps: the number of samples in a stream is not "
                "known before it is read (as with datasets' streaming)")
    for flag in ("save_strategy", "eval_strategy", "logging_strategy"):
        if getattr(cfg, flag) == "epoch":
            return (f"--{flag} epoch: a stream has no known epoch length; use steps with "
                    "--streaming")
    if cfg.max_train_samples is not None:
        return ("--max_train_samples is not taken with --streaming: give --max_steps (or "
                "build the cache without --streaming)")
    if cfg.do_eval and not (cfg.validation_file or cfg.dataset_name):
        return "--do_eval with --streaming needs --validation_file: a stream has no held-out split"
    return None


def _check_numbers(cfg: TrainConfig) -> None:
    _check_streaming(cfg)
    positive = ("per_device_train_batch_size", "per_device_eval_batch_size",
                "gradient_accumulation_steps", "logging_steps", "save_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1 (got {getattr(cfg, name)})")
    for name in ("max_train_samples", "max_eval_samples"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be >= 1 (got {getattr(cfg, name)})")
    if cfg.eval_steps is not None and cfg.eval_steps < 1:
        raise ConfigError(f"--eval_steps must be >= 1 (got {cfg.eval_steps})")
    if cfg.learning_rate <= 0:
        raise ConfigError(f"--learning_rate must be > 0 (got {cfg.learning_rate})")
    if not 0 <= cfg.validation_split_percentage < 100:
        raise ConfigError("--validation_split_percentage must be in [0, 100)")
    if cfg.peak_tflops < 0:
        raise ConfigError(f"--peak_tflops must be >= 0 (got {cfg.peak_tflops})")
    reporting_to(cfg.report_to)  # a sink named whose package is missing
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise ConfigError("give --max_steps > 0 or --num_train_epochs > 0")
    if cfg.cpus_per_worker < 0:
        raise ConfigError("--cpus_per_worker must be >= 0")
    if cfg.max_failures < 0:
        raise ConfigError("--max_failures must be >= 0")
    if cfg.profile_steps < 1:
        raise ConfigError(f"--profile_steps must be >= 1 (got {cfg.profile_steps})")
    if cfg.snapshot_steps < 0:
        raise ConfigError("--snapshot_steps must be >= 0 (0: no snapshots)")
    if not 0 <= cfg.warmup_ratio <= 1:
        raise ConfigError(f"--warmup_ratio must be in [0, 1] (got {cfg.warmup_ratio})")
    if cfg.eval_strategy == "steps" and not cfg.eval_steps:
        raise ConfigError("--eval_strategy steps needs --eval_steps N")
    _check_best_model(cfg)
    _check_elastic_bounds(cfg)


def _last_check(cfg: TrainConfig, on_checked) -> None:
    """The caller's ``on_checked``, then the schedule's check: the slowest (it imports
    transformers' training code, which imports peft, which imports a model: about 1.2 s
    here) and the least likely to fail."""
    if on_checked is not None:
        on_checked()
    _check_schedule(cfg)


def _check_best_model(cfg: TrainConfig) -> None:
    """--load_best_model_at_end and --early_stopping_patience need evaluations during
    training (and the first, checkpoints at them: the Trainer's rule)."""
    evals = cfg.eval_strategy_now()
    for flag in ("load_best_model_at_end", "early_stopping_patience"):
        if getattr(cfg, flag) and (evals == "no" or not cfg.should_eval):
            raise ConfigError(f"--{flag} needs evaluations during training: give "
                              "--eval_strategy steps with --eval_steps N, or epoch")
    if cfg.early_stopping_patience is not None and cfg.early_stopping_patience < 1:
        raise ConfigError(f"--early_stopping_patience must be >= 1 (got "
                          f"{cfg.early_stopping_patience})")
    if cfg.early_stopping_threshold < 0:
        raise ConfigError("--early_stopping_threshold must be >= 0")
    if cfg.metric_for_best_model:
        from raylm.runtime.best import metric_key

        sets = eval_set_names(cfg.validation_file) if len(cfg.validation_file) > 1 else []
        second = "eval_accuracy" if cfg.task == "image-classification" else "perplexity"
        known = ["eval_loss", second] + [f"eval_{n}_{m}" for n in sets
                                         for m in ("loss", "perplexity")]
        if metric_key(cfg.metric_for_best_model) not in known:
            names = ["loss", second.removeprefix("eval_")] + [k[len("eval_"):]
                                                             for k in known[2:]]
            raise ConfigError(f"--metric_for_best_model {cfg.metric_for_best_model}: the "
                              f"evaluation reports {', '.join(names)}")
    if not cfg.load_best_model_at_end:
        return
    if cfg.save_strategy != evals:
        raise ConfigError(f"--load_best_model_at_end needs --save_strategy equal to "
                          f"--eval_strategy (they are {cfg.save_strategy} and {evals}): "
                          "a checkpoint is kept at each evaluation")
    if evals == "steps" and cfg.save_steps % cfg.eval_steps:
        raise ConfigError(f"--load_best_model_at_end needs --save_steps ({cfg.save_steps}) "
                          f"to be a multiple of --eval_steps ({cfg.eval_steps})")


def _check_schedule(cfg: TrainConfig) -> None:
    """--lr_scheduler_kwargs: a JSON object the schedule accepts (built once here on a
    throwaway optimizer, so a wrong name fails before any actor)."""
    import torch

    from raylm.runtime.schedule import make_scheduler, scheduler_kwargs

    settings = cfg.to_dict()
    try:
        scheduler_kwargs(settings)
    except ValueError as e:
        raise ConfigError(f"--lr_scheduler_kwargs must be a JSON object, e.g. "
                          f"'{{\"num_cycles\": 2}}' ({e})") from None
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        make_scheduler(probe, settings, 10)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--lr_scheduler_kwargs {cfg.lr_scheduler_kwargs} does not suit "
                          f"--lr_scheduler_type {cfg.lr_scheduler_type}: "
                          f"{str(e).splitlines()[0]}") from None


def _check_elastic_bounds(cfg: TrainConfig) -> None:
    """--min_workers <= --num_workers <= --max_workers, in whole pp x tp replicas."""
    for name in ("min_workers", "max_workers"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name} must be >= 0 (0: unset)")
    lo, hi, start = cfg.min_workers, cfg.max_workers, cfg.num_workers
    if lo and hi and lo > hi:
        raise ConfigError(f"--min_workers {lo} is more than --max_workers {hi}")
    if start and lo and start < lo:
        raise ConfigError(f"--num_workers {start} is below --min_workers {lo}")
    if start and hi and start > hi:
        raise ConfigError(f"--num_workers {start} is above --max_workers {hi}")
    replica = max(cfg.tp, 1) * max(cfg.pp, 1)
    for name, value in (("min_workers", lo), ("max_workers", hi)):
        if value and value % replica:
            raise ConfigError(f"--{name} {value} is not a whole number of pp x tp = {replica}-"
                              f"rank replicas (--pp {max(cfg.pp, 1)}, --tp {max(cfg.tp, 1)}); "
                              f"use a multiple of {replica}")
    if cfg.dp and (lo or hi):
        raise ConfigError("--dp fixes the data-parallel degree, so the run cannot resize "
                          "within --min_workers / --max_workers: drop --dp (or the bounds)")


def _check_output_dir(cfg: TrainConfig, inputs: Inputs) -> None:
    """Fresh, resumable (same run), or an error: decided before anything starts."""
    out = cfg.output_dir
    record_path = os.path.join(out, RUN_RECORD)
    if cfg.resume_from_checkpoint:
        if not os.path.isfile(os.path.join(cfg.resume_from_checkpoint, "trainer_state.json")):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} is not "
                              "a raylm checkpoint (no trainer_state.json)")
        if read_trainer_state(cfg.resume_from_checkpoint).get("model_only"):
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} holds "
                              "the model only (--save_only_model): no optimizer state to "
                              "resume; fine-tune from it with --model_name_or_path instead")
        inputs.resume_from = os.path.abspath(cfg.resume_from_checkpoint)
        inputs.run_record = read_trainer_state(inputs.resume_from).get("run")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if cfg.overwrite_output_dir:
        return  # cleared in start_output_dir, once the run really starts
    if not os.path.isfile(record_path):
        raise ConfigError(f"--output_dir {out} already exists and is not empty; use "
                          "--overwrite_output_dir to train over it")
    with open(record_path) as f:
        record = json.load(f)
    code = code_of(inputs)
    # (only the code's names may be missing from an older record: a dataset's digest
    # missing from the record is data the recorded run did not have)
    unrecorded = [k for k in ("model_init", "compute_loss_func")
                  if code.get(k) is not None and k not in record]
    if unrecorded and "model_init" not in record and "compute_loss_func" not in record:
        # A record written before raylm recorded the run's code: its settings still decide.
        log.warning("%s: the run record does not name the run's %s (written by an earlier "
                    "raylm): not checked", out, " or ".join(unrecorded))
        code = {k: v for k, v in code.items() if k not in unrecorded}
    mine = cfg.run_fingerprint(code)
    if record.get("digest") != mine["digest"]:
        differs = sorted(k for k in set(mine) | set(record)
                         if k not in ("digest", "global_batch_size")
                         and record.get(k) != mine.get(k))
        raise ConfigError(f"--output_dir {out} holds a different run (differs in: "
                          f"{', '.join(differs) or 'settings'}); use --overwrite_output_dir "
                          "or another --output_dir")
    if inputs.resume_from is None:
        ckpt = CheckpointManager(out)
        latest = ckpt.latest()
        if latest:
            inputs.resume_from = latest
            inputs.run_record = record
        elif ckpt.list(model_only=True):
            log.warning("the checkpoints in %s hold the model only (--save_only_model): "
                        "the run starts from the beginning", out)


def code_of(inputs: Inputs) -> dict:
    """What the Python API gave besides the config, for the run's fingerprint: the names
    of a model of the user's own (its factory) and of their loss, and the digests of the
    datasets given."""
    from raylm.models.custom import factory_name

    spec = inputs.spec
    return {"model_init": spec.config.name if spec.model_init is not None else None,
            "compute_loss_func": factory_name(spec.loss_fn) if spec.loss_fn else None,
            **inputs.given}


def start_output_dir(cfg: TrainConfig, global_batch_size: int,
                     inputs: Optional[Inputs] = None) -> dict:
    """Create (or clear, with --overwrite_output_dir) output_dir and write the run record
    (``inputs``: the run's model and datasets, part of it: code_of)."""
    out = cfg.output_dir
    if cfg.overwrite_output_dir and os.path.isdir(out):
        for name in ("checkpoints", "metrics.jsonl", "samples.jsonl", RUN_RECORD,
                     "all_results.json", "eval_results.json", "runs", "metrics.png"):
            p = os.path.join(out, name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
    os.makedirs(out, exist_ok=True)
    record = cfg.run_fingerprint(code_of(inputs) if inputs is not None else None)
    record["global_batch_size"] = global_batch_size
    tmp = os.path.join(out, RUN_RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out, RUN_RECORD))
    return record


def prepare_data(cfg: TrainConfig, inputs: Inputs) -> Data:
    """Tokenize (or reuse the cache) and choose the train and eval sample ids. Rank
    processes kept between runs (raylm.keep_ranks) are stopped before any tokenizing:
    Ray Data's tasks may need their CPUs."""
    from raylm.data.sampler import split_train_eval
    from raylm.data.tokenized import build_tokenized_dataset

    def build(files):
        try:
            return build_tokenized_dataset(
                files, inputs.spec.tokenizer_dir, inputs.block_size,
                line_by_line=cfg.line_by_line, text_column=cfg.text_column,
                cache_root=cfg.data_cache_dir, num_workers=cfg.preprocessing_num_workers,
                keep_linebreaks=cfg.keep_linebreaks, overwrite=cfg.overwrite_cache,
                before_tokenizing=_release_kept_ranks, piece_mb=cfg.piece_size_mb)
        except ConfigError as e:
            raise _naming_the_argument(e, files, inputs) from None

    if inputs.images is not None:
        return _image_data(cfg, inputs)
    if inputs.streaming:
        return _streaming_data(cfg, inputs, build)
    train = build(inputs.train_files) if inputs.train_files else None
    if train is not None:
        log.info("training data: %d samples of %d tokens (%s)", train.num_samples,
                 inputs.block_size, "cached" if train.reused else "tokenized now")
    if inputs.eval_files:
        eval_ds = build(inputs.eval_files)
        eval_ids = np.arange(eval_ds.num_samples, dtype=np.int64)
        train_ids = np.arange(train.num_samples, dtype=np.int64) if train else eval_ids[:0]
    else:
        # Held out whether or not this run evaluates (as run_clm does), so that the
        # training samples do not depend on --do_eval.
        pct = cfg.validation_split_percentage
        train_ids, eval_ids = split_train_eval(train.num_samples, pct, seed=0)
        if not cfg.should_train and pct == 0:  # evaluate a model on all of --train_file
            train_ids, eval_ids = train_ids[:0], train_ids
        eval_ds = train if len(eval_ids) else None
    # run_clm's --max_train_samples / --max_eval_samples: the first N samples.
    if cfg.max_train_samples is not None:
        train_ids = train_ids[:cfg.max_train_samples]
    eval_ids, eval_sets = _eval_sets(cfg, inputs, eval_ds, eval_ids)
    if cfg.should_train and len(train_ids) == 0:
        raise ConfigError("no training samples left after the validation split; give more "
                          "data, a smaller --block_size or --validation_split_percentage")
    return Data(train=train, eval=eval_ds, train_ids=train_ids, eval_ids=eval_ids,
                eval_sets=eval_sets)


def _image_data(cfg: TrainConfig, inputs: Inputs) -> Data:
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
                                   before_decoding=_release_kept_ranks)

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


def _eval_sets(cfg: TrainConfig, inputs: Inputs, eval_ds, eval_ids: np.ndarray):
    """(eval ids, [(set name, ids)]): with several --validation_file, each file's samples
    in its set; --max_eval_samples (run_clm's): the first N of each."""
    if inputs.eval_names:
        per_set = {}
        for name, ids in zip(inputs.eval_names, eval_ds.file_ids()):
            per_set.setdefault(name, []).append(ids)
        eval_sets = [(name, np.concatenate(parts)[:cfg.max_eval_samples])
                     for name, parts in per_set.items()]
        return np.concatenate([ids for _, ids in eval_sets]), eval_sets
    if cfg.max_eval_samples is not None:
        eval_ids = eval_ids[:cfg.max_eval_samples]
    return eval_ids, []


def _streaming_data(cfg: TrainConfig, inputs: Inputs, build) -> Data:
    """--streaming: nothing is tokenized up front. The training files become pieces that
    Ray Data tokenizes while training runs (raylm.data.stream); validation files, small
    by nature, go through the cache as without the flag."""
    from raylm.data.pieces import plan_pieces
    from raylm.data.stream import StreamSpec, TokenStream
    from raylm.data.tokenized import (TASK_NUM_CPUS, absolute_inputs, cache_key,
                                      load_tokenizer, pad_token_id_for)

    files, tokenizer_dir = absolute_inputs(inputs.train_files, inputs.spec.tokenizer_dir)
    pad = pad_token_id_for(load_tokenizer(tokenizer_dir), cfg.line_by_line, tokenizer_dir)
    pieces = plan_pieces(files, cfg.piece_size_mb)
    keep_linebreaks = cfg.keep_linebreaks and not cfg.line_by_line
    # What the samples depend on (files by path, size and time; tokenizer; settings): a
    # checkpoint's stream position is valid only for the same.
    identity = cache_key(files, tokenizer_dir, inputs.block_size, cfg.line_by_line,
                         cfg.text_column, keep_linebreaks, cfg.piece_size_mb)
    stream = TokenStream(
        pieces, dict(tokenizer_dir=tokenizer_dir, block_size=inputs.block_size,
                     line_by_line=cfg.line_by_line, text_column=cfg.text_column,
                     pad_token_id=pad, keep_linebreaks=keep_linebreaks),
        global_batch_size=0, seed=cfg.order_seed, window=cfg.shuffle_buffer_size,
        num_workers=cfg.preprocessing_num_workers, task_cpus=TASK_NUM_CPUS,
        buffer_mb=cfg.streaming_buffer_mb, identity=identity)
    log.info("training data: streamed from %d file(s) in %d piece(s), tokenized while "
             "training runs", len(files), len(pieces))
    eval_ds, eval_ids, eval_sets = None, np.empty(0, np.int64), []
    if inputs.eval_files and cfg.should_eval:
        eval_ds = build(inputs.eval_files)
        eval_ids, eval_sets = _eval_sets(cfg, inputs, eval_ds,
                                         np.arange(eval_ds.num_samples, dtype=np.int64))
    spec = StreamSpec(block_size=inputs.block_size, line_by_line=cfg.line_by_line,
                      pad_token_id=pad)
    return Data(train=spec, eval=eval_ds, eval_ids=eval_ids, eval_sets=eval_sets,
                stream=stream)


def _release_kept_ranks() -> None:
    from raylm.runtime import kept  # (Ray: only once there is something to tokenize)

    kept.release()


def _room_for_tasks() -> None:
    """Before a dataset given to train() is read: rank processes kept from an earlier
    run (raylm.keep_ranks) are stopped if they leave no CPU for Ray Data's tasks."""
    import ray

    from raylm.data.tokenized import TASK_NUM_CPUS

    if ray.is_initialized() and ray.available_resources().get("CPU", 0.0) < 2 * TASK_NUM_CPUS:
        _release_kept_ranks()


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))
