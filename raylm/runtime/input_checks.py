"""check_inputs: everything that needs no cluster (flags, files, model, output_dir),
checked first, so that most bad input fails in a second."""

from __future__ import annotations

import logging
import os
import re
from typing import Optional

from raylm.config import TrainConfig
from raylm.errors import ConfigError
from raylm.plan.dims import check_layout_flags
from raylm.runtime.image_classification import check_image_inputs
from raylm.runtime.inputs import Inputs, room_for_tasks
from raylm.runtime.metrics import reporting_to
from raylm.runtime.output_dir import decide_output_dir
from raylm.runtime.precision import check_precision

log = logging.getLogger("raylm")


def check_inputs(cfg: TrainConfig, check_output_dir: bool = True, model_init=None,
                 compute_loss_func=None, tp_plan=None, datasets: Optional[dict] = None,
                 on_checked=None) -> Inputs:
    """``datasets``: {"train_dataset": ..., "eval_dataset": ...} given to train() (None
    entries absent); a Ray Dataset among them needs Ray connected. ``on_checked()``,
    when given, is called before the last check, the schedule's (_last_check): the
    driver starts Ray's cluster there (raylm.runtime.cluster.EarlyStart)."""
    _check_numbers(cfg)
    _check_local_dirs(cfg)
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
        inputs = check_image_inputs(cfg, model_init, tp_plan, compute_loss_func, datasets)
    else:
        inputs = _check_text_inputs(cfg, model_init, tp_plan, compute_loss_func, datasets)
    if cfg.should_train and check_output_dir:
        decide_output_dir(cfg, inputs)
    _last_check(cfg, on_checked)
    return inputs


def _check_text_inputs(cfg: TrainConfig, model_init, tp_plan, compute_loss_func,
                       datasets: dict) -> Inputs:
    """check_inputs for text: the data files (or the datasets given, exported to files)
    checked, the model resolved with its objective."""
    from raylm.models.loading import resolve_block_size, resolve_model

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
    return Inputs(spec=spec, block_size=block_size, train_files=train_files,
                  eval_files=eval_files, eval_names=eval_names, given=given,
                  streaming=bool(train_files) and cfg.should_train
                  and streams(cfg, train_files, say=True))


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

    # (exports go to the cache, an object store's too: the tokenizing tasks of every node
    # read them)
    root = cfg.data_cache_dir or default_cache_root()
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
    room_for_tasks()

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
    # (a layout the flags cannot hold: told before Ray starts)
    check_layout_flags(cfg.num_workers, cfg.dp, cfg.tp, cfg.pp)
    _check_watch(cfg)
    check_nccl(cfg)


# Recovering in memory on GPUs aborts each rank's NCCL communicators together (NCCL's
# group abort, 2.22: NVIDIA/nccl#1013); one by one, the aborts can deadlock.
NCCL_GROUP_ABORT = (2, 22)


def check_nccl(cfg: TrainConfig, version: Optional[tuple] = None) -> None:
    """--use_gpu with an NCCL whose communicators cannot all be aborted at once (the
    version of this torch's NCCL, or ``version``; none known on a CPU-only driver)."""
    if not cfg.use_gpu:
        return
    if version is None:
        try:
            import torch

            version = torch.cuda.nccl.version()
        except Exception:  # a CPU-only torch here: the ranks' NCCL is not known
            return
    if tuple(version[:2]) < NCCL_GROUP_ABORT:
        raise ConfigError(
            f"--use_gpu: this torch's NCCL is {'.'.join(map(str, version))}; recovering in "
            "memory aborts each rank's NCCL communicators together, which needs NCCL 2.22 "
            "or later (before it the aborts can deadlock): install a torch built with a "
            "newer NCCL")


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


def _check_local_dirs(cfg: TrainConfig) -> None:
    """Directories that must be local: a URI there is an error, never a local directory
    named after its scheme."""
    for name, why in (("cache_dir", "Hugging Face's download cache is a local directory"),
                      ("logging_dir", "TensorBoard writes a local directory; with an "
                       "object-store --output_dir its events go to output_dir/runs there")):
        value = getattr(cfg, name)
        if value and "://" in str(value) and not str(value).startswith("file://"):
            raise ConfigError(f"--{name} {value}: {why}: give a local path")


def _check_watch(cfg: TrainConfig) -> None:
    """Heartbeats and step deadlines that can work."""
    for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "step_deadline_floor_s"):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"--{name} must be > 0 (got {getattr(cfg, name):g})")
    if cfg.heartbeat_interval_s >= cfg.heartbeat_timeout_s:
        raise ConfigError(f"--heartbeat_interval_s {cfg.heartbeat_interval_s:g} must be "
                          f"below --heartbeat_timeout_s {cfg.heartbeat_timeout_s:g}: a rank "
                          "would be lost between two heartbeats")
    if not cfg.straggler_factor > 1:
        raise ConfigError(f"--straggler_factor must be > 1 (got {cfg.straggler_factor:g})")
    if cfg.straggler_steps < 1:
        raise ConfigError(f"--straggler_steps must be >= 1 (got {cfg.straggler_steps})")
    if not cfg.step_deadline_factor > 1:
        raise ConfigError(f"--step_deadline_factor must be > 1 (got "
                          f"{cfg.step_deadline_factor:g}): a step may take longer than "
                          "the median")


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
