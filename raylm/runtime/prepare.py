"""prepare_data: once Ray is up, the data tokenized with Ray Data (or the cache reused),
or streamed while training runs; and the run's length in steps (total_steps)."""

from __future__ import annotations

import logging
import math
from typing import Optional

import numpy as np

from raylm.config import TrainConfig
from raylm.data.sampler import GlobalBatchSampler, rank_share, split_train_eval
from raylm.errors import ConfigError
from raylm.runtime.image_classification import image_data
from raylm.runtime.inputs import Data, Inputs, room_for_tasks

log = logging.getLogger("raylm")


def prepare_data(cfg: TrainConfig, inputs: Inputs) -> Data:
    """Tokenize (or reuse the cache) and choose the train and eval sample ids. Rank
    processes kept between runs (raylm.keep_ranks) are stopped before any tokenizing if
    they leave Ray Data's tasks no CPU."""
    from raylm.data.tokenized import build_tokenized_dataset

    def build(files):
        try:
            return build_tokenized_dataset(
                files, inputs.spec.tokenizer_dir, inputs.block_size,
                line_by_line=cfg.line_by_line, text_column=cfg.text_column,
                cache_root=cfg.data_cache_dir, num_workers=cfg.preprocessing_num_workers,
                keep_linebreaks=cfg.keep_linebreaks, overwrite=cfg.overwrite_cache,
                before_tokenizing=room_for_tasks, piece_mb=cfg.piece_size_mb)
        except ConfigError as e:
            raise _naming_the_argument(e, files, inputs) from None

    if inputs.images is not None:
        return image_data(cfg, inputs)
    if inputs.streaming:
        return _streaming_data(cfg, inputs, build)
    train = build(inputs.train_files) if inputs.train_files else None
    if train is not None:
        log.info("training data: %d samples of %d tokens (%s)", train.num_samples,
                 inputs.block_size, _made(train))
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
    if cfg.should_eval and len(eval_ids):
        log.info("evaluation data: %d samples of %d tokens (%s)", len(eval_ids),
                 inputs.block_size, _eval_source(cfg, inputs, eval_ds, train))
    if cfg.should_train and len(train_ids) == 0:
        raise ConfigError("no training samples left after the validation split; give more "
                          "data, a smaller --block_size or --validation_split_percentage")
    return Data(train=train, eval=eval_ds, train_ids=train_ids, eval_ids=eval_ids,
                eval_sets=eval_sets)


def _made(ds) -> str:
    return "cached" if ds.reused else "tokenized now"


def _eval_source(cfg: TrainConfig, inputs: Inputs, eval_ds, train) -> str:
    if eval_ds is not train:
        files = len(inputs.eval_files)
        return (f"{files} file(s), " if files > 1 else "") + _made(eval_ds)
    if not cfg.should_train and cfg.validation_split_percentage == 0:
        return "all of --train_file"
    return f"{cfg.validation_split_percentage:g}% of the training data, held out"


FEW_BATCHES = 3  # training data under this many global batches is warned of
FEW_EVAL = 10  # an evaluation on fewer samples is warned of


def degenerate(cfg: TrainConfig, data: Data, global_batch: int, dp: int) -> list[str]:
    """Warnings for a run on too little data to mean much, with the numbers and the flag
    to change (the run goes on)."""
    out = []
    train, n = data.train, len(data.train_ids)
    if cfg.should_train and data.stream is None and n:
        if n < FEW_BATCHES * global_batch:
            out.append(f"training data: {n} sample(s), under {FEW_BATCHES} global batches "
                       f"of {global_batch}: give more data, or lower --block_size or "
                       "--per_device_train_batch_size")
        least = n % global_batch or global_batch  # an epoch's last, shortest step
        idle = sum(not len(rank_share(np.arange(least), r, dp)) for r in range(dp))
        per_epoch = GlobalBatchSampler(data.train_ids, global_batch,
                                       cfg.order_seed).steps_per_epoch  # (the driver's)
        if idle and total_steps(cfg, per_epoch) >= per_epoch:  # (a run that reaches it)
            out.append(f"a step of {least} sample(s) leaves {idle} of the {dp} "
                       "data-parallel rank(s) with none: lower --num_workers or --dp")
    files = getattr(train, "samples_per_file", None)
    if files and not train.line_by_line and 0 in files:
        out.append(f"{files.count(0)} of {len(files)} training file(s) gave no sample: "
                   f"each holds fewer than --block_size {train.block_size} tokens, and a "
                   "file's tokens short of a block are dropped (as run_clm's group_texts "
                   "does); lower --block_size")
    short = _mostly_padding(train) if cfg.should_train and data.stream is None else None
    if short is not None:
        out.append(f"--line_by_line: half the training samples hold {short} token(s) or "
                   f"fewer of --block_size {train.block_size}; the rest of each block is "
                   "padding, computed and thrown away: lower --block_size")
    if cfg.should_eval and 0 < len(data.eval_ids) < FEW_EVAL:
        out.append(f"evaluation on {len(data.eval_ids)} sample(s): its loss says little; "
                   "give a --validation_file or a larger --validation_split_percentage")
    return out


MOSTLY_PADDING = 4  # line by line: a median sample under 1/this of the block is warned of
PADDING_PROBE = 1024  # samples read to tell (from the first shard: one file read)


def _mostly_padding(train) -> Optional[int]:
    """Line by line: the median sample's tokens when it is under 1/MOSTLY_PADDING of the
    block size (None otherwise, or for blocks of concatenated text)."""
    if not getattr(train, "line_by_line", False) or not train.num_samples:
        return None
    from raylm.data.reader import BlockReader  # (imports torch: only line by line needs it)

    offsets = list(train.shard_offsets) + [train.num_samples]
    first = next((b for b in offsets[1:] if b > 0), train.num_samples)
    ids = np.unique(np.linspace(0, first - 1, min(first, PADDING_PROBE)).astype(np.int64))
    median = int(np.median(BlockReader(train).read(ids)["attention_mask"].sum(1).numpy()))
    return median if median * MOSTLY_PADDING < train.block_size else None


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


def _naming_the_argument(e: ConfigError, files: list, inputs) -> ConfigError:
    """An error in a dataset given to train() (its rows, as raylm exported them to a file)
    named by the argument the user gave it as, not by the export file."""
    text = str(e)
    for arg, given in (("train_dataset", inputs.train_files),
                       ("eval_dataset", inputs.eval_files)):
        if arg in inputs.given and files == given and text.startswith(f"{files[0]}: "):
            return ConfigError(f"{arg}: {text[len(files[0]) + 2:]}")
    return e


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * steps_per_epoch))
