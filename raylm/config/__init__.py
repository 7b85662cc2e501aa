"""TrainConfig: every setting of a raylm run, in one dataclass.

Field names are the flag names of Hugging Face's ``run_clm.py`` where one exists (same
meaning), so ``raylm train --help`` reads like that script's. The CLI, YAML/JSON run files
and the Python API all fill this one object; ``--help`` text comes from each field's
``help`` metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from raylm.config.flags import (ClusterFlags, DataFlags, ModelFlags, OptimisationFlags,
                                OutputFlags, PlannerCostFlags)

# Older names of flags (TrainingArguments' deprecated spellings): old -> new.
ALIASES = {"evaluation_strategy": "eval_strategy", "max_seq_length": "block_size"}


# The groups last to first: a dataclass takes its bases' fields in reverse MRO order, so
# the model's flags come first, as --help lists them.
@dataclass
class TrainConfig(PlannerCostFlags, ClusterFlags, OutputFlags, OptimisationFlags, DataFlags,
                  ModelFlags):
    """Every setting of a run: the groups' flags, flat (``cfg.learning_rate``), and what
    they mean together."""

    def __post_init__(self) -> None:
        for name in ("train_file", "validation_file", "report_to"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
            elif value is None:
                setattr(self, name, [])

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def is_set(self, name: str) -> bool:
        """Whether a setting differs from its default (a flag given for nothing to use
        it on is an error)."""
        return getattr(self, name) != _DEFAULTS[name]

    @property
    def should_train(self) -> bool:
        # No flag: train (and evaluate). --do_eval alone: evaluate the given model only.
        return self.do_train if self.do_train is not None else self.do_eval is not True

    @property
    def should_eval(self) -> bool:
        return True if self.do_eval is None else self.do_eval

    # Settings that change what is trained: a run in an existing output_dir with a
    # different value of any of these is a different run (error unless
    # --overwrite_output_dir). Logging, saving and cluster settings are free to change;
    # the layout in particular may change on resume.
    RUN_DEFINING = (
        "model_name_or_path", "config_name", "model_type", "config_overrides", "objective",
        "tokenizer_name", "train_file", "validation_file", "validation_split_percentage",
        "text_column", "block_size", "line_by_line", "learning_rate", "weight_decay",
        "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type",
        "warmup_steps", "num_train_epochs", "max_steps", "seed",
    )

    # Run-defining settings added later: in the fingerprint only when set (not their
    # default), so a run started before they existed resumes as the same run.
    RUN_DEFINING_IF_SET = ("warmup_ratio", "lr_scheduler_kwargs", "data_seed",
                           "keep_linebreaks", "max_train_samples", "model_revision",
                           "dataset_name", "dataset_config_name", "bf16", "fp16", "mlm",
                           "mlm_probability", "whole_word_masking",
                           "mean_noise_span_length", "use_peft", "lora_rank", "lora_alpha",
                           "lora_dropout", "lora_target_modules", "streaming",
                           "shuffle_buffer_size", "piece_size_mb", "task", "train_dir",
                           "validation_dir", "train_val_split", "image_flip", "image_size",
                           "num_channels", "image_column_name", "label_column_name",
                           "ignore_mismatched_sizes")

    def run_fingerprint(self, code: Optional[dict] = None) -> dict:
        """The settings that define the run, and their digest (an output dir holds one
        run). ``code``: what the Python API was given besides the config (the factory's
        and the loss's names: train(..., model_init=, compute_loss_func=))."""
        d = {k: getattr(self, k) for k in self.RUN_DEFINING}
        d.update({k: getattr(self, k) for k in self.RUN_DEFINING_IF_SET if self.is_set(k)})
        d.update({k: v for k, v in (code or {}).items() if v is not None})
        d["digest"] = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return d

    # -- what the flags mean, once -----------------------------------------------------------
    @property
    def order_seed(self) -> int:
        """The seed of the data order: --data_seed, else --seed."""
        return self.seed if self.data_seed is None else self.data_seed

    def eval_strategy_now(self) -> str:
        return self.eval_strategy or ("steps" if self.eval_steps else "no")

    @staticmethod
    def at(strategy: str, every: int, step: int, steps_per_epoch: int,
           last: Optional[int] = None) -> bool:
        """Whether a --*_strategy of ``strategy`` acts after ``step`` (1-based): every
        ``every`` steps, at epoch ends, or never; unless it is "no", also after the run's
        ``last`` step when given (logging and saving do, evaluation's last is its own)."""
        if strategy == "no":
            return False
        if step == last:
            return True
        if strategy == "steps":
            return bool(every) and step % every == 0
        return step % steps_per_epoch == 0


# Each setting's default, for TrainConfig.is_set.
_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(TrainConfig)}
