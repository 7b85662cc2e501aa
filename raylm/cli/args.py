"""Flags from TrainConfig's fields, run files (YAML/JSON), one-line errors.

As Hugging Face's HfArgumentParser: booleans are ``--do_train`` alone or
``--do_train true|false``, and every flag is also spelled with hyphens
(``--per-device-train-batch-size``). A Trainer or run_clm flag raylm has no use for is
one line saying what to use instead (``FOREIGN``), not "unrecognized".
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing

from raylm.config import ALIASES, TrainConfig
from raylm.errors import ConfigError

# The --help groups, in the order shown.
GROUP_TITLES = {
    "run": "what to run: the task, train and/or evaluate, for how long",
    "model": "model (as in run_clm.py)",
    "data": "data (as in run_clm.py)",
    "training": "optimisation (as in run_clm.py / TrainingArguments)",
    "output": "logging, evaluation and checkpoints",
    "layout": "raylm: the cluster, workers and layout",
    "elastic": "raylm: failures, elasticity and health",
    "costmodel": "raylm: the planner's cost model and MFU",
}


_ZERO = "raylm shards data-parallel state itself: use --zero_stage 1, 2 or 3 (3 is FSDP2)"
# Flags of TrainingArguments, run_clm.py and the Habana examples that raylm does not take:
# flag (underscore spelling) -> what to do instead.
FOREIGN = {
    "deepspeed": _ZERO + ", with --cpu_offload for ZeRO-Offload",
    "fsdp": _ZERO, "fsdp_config": _ZERO,
    "push_to_hub": "raylm does not upload: the model in --output_dir loads with "
                   "from_pretrained; push it with huggingface_hub's upload_folder",
    "hub_model_id": "raylm does not upload (see --push_to_hub)",
    "hub_token": "raylm does not upload (see --push_to_hub)",
    "hub_strategy": "raylm does not upload (see --push_to_hub)",
    "local_rank": "raylm starts one Ray actor per rank itself: give --num_workers "
                  "(and --dp/--tp/--pp), not a launcher's rank",
    "ddp_backend": "raylm picks gloo on CPU and NCCL with --use_gpu",
    "ddp_timeout": "use --collective_timeout_s",
    "ddp_find_unused_parameters": "raylm's data parallelism needs no such setting",
    "no_cuda": "raylm runs on CPUs unless --use_gpu is given",
    "use_cpu": "raylm runs on CPUs unless --use_gpu is given",
    "use_habana": "raylm runs on CPUs or NVIDIA GPUs (--use_gpu)",
    "use_lazy_mode": "raylm runs on CPUs or NVIDIA GPUs (--use_gpu)",
    "gaudi_config_name": "raylm runs on CPUs or NVIDIA GPUs (--use_gpu)",
    "use_hpu_graphs_for_inference": "raylm runs on CPUs or NVIDIA GPUs (--use_gpu)",
    "pipelining_fwd_bwd": "raylm runs on CPUs or NVIDIA GPUs (--use_gpu)",
    "throughput_warmup_steps": "raylm logs tokens/s over each logging window (the first "
                               "window holds the warm-up); drop the flag",
    "use_cache": "raylm trains without the KV cache and saves the model with it on",
    "fp16_opt_level": "raylm's --fp16 is torch.autocast with fp32 master weights (apex's "
                      "O2); drop the flag",
    "half_precision_backend": "raylm's --bf16 and --fp16 are torch.autocast; drop the flag",
}


def foreign_flag(word: str):
    """The one line for a flag raylm does not take but the Trainer does, else None."""
    if not word.startswith("--"):
        return None
    name = word[2:].split("=")[0].replace("-", "_")
    if name in FOREIGN:
        return f"--{name}: {FOREIGN[name]}"
    return None


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).lower()
    if v in ("true", "1", "yes", "y", "on"):
        return True
    if v in ("false", "0", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


class CanonicalNameFormatter(argparse.HelpFormatter):
    """--help shows each flag by its first name only (``--eval_strategy``), not every
    spelling it also takes (``--eval-strategy``, ``--evaluation_strategy``)."""

    def _format_action_invocation(self, action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{action.option_strings[0]} {metavar}"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (with a did-you-mean) and exit status 2.

    Abbreviated flags are refused: ``--learning_rat`` must not silently mean
    ``--learning_rate``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", CanonicalNameFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                line = foreign_flag(word)
                if line is not None:
                    sys.stderr.write(f"{self.prog}: error: {line}\n")
                    sys.exit(2)
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hints = []
            for word in message.split(":", 1)[1].split():
                if word.startswith("--"):
                    close = difflib.get_close_matches(word.split("=")[0], known, n=1)
                    if close:
                        hints.append(f"{word} (did you mean {close[0]}?)")
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


@dataclasses.dataclass
class Flag:
    """One TrainConfig field as a flag: what --help and the docs' flags page both show."""

    name: str
    names: tuple  # the field's name, then its aliases
    group: str
    type: type  # bool, int, float, str or list
    default: object
    help: str
    choices: tuple | None
    metavar: str  # of a list flag


def config_flags(only: tuple = ()) -> list:
    """Every TrainConfig field (or those in ``only``) as a Flag: by group, in
    GROUP_TITLES' order, each group in declaration order."""
    hints = typing.get_type_hints(TrainConfig)
    out = []
    for f in dataclasses.fields(TrainConfig):
        if only and f.name not in only:
            continue
        meta = f.metadata
        tp = _base_type(hints[f.name])
        out.append(Flag(
            name=f.name, names=(f.name, *meta.get("aliases", ())),
            group=meta.get("group", "training"),
            type=list if typing.get_origin(tp) is list else tp,
            default=f.default if f.default is not dataclasses.MISSING else f.default_factory(),
            help=meta.get("help", ""), choices=meta.get("choices"),
            metavar=meta.get("metavar", "PATH")))
    order = list(GROUP_TITLES)
    return sorted(out, key=lambda flag: order.index(flag.group))


# The flags `--help` shows, to keep it a page; `--help-all` and the docs' flags reference
# show every one.
BRIEF = (
    "task", "do_train", "do_eval", "num_train_epochs", "max_steps",
    "model_name_or_path", "model_type", "config_overrides", "objective", "use_peft",
    "tokenizer_name", "train_file", "validation_file", "dataset_name", "train_dir",
    "block_size", "line_by_line", "streaming",
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
    "weight_decay", "bf16", "fp16", "lr_scheduler_type", "warmup_steps", "seed",
    "output_dir", "overwrite_output_dir", "logging_steps", "eval_strategy", "eval_steps",
    "save_steps", "resume_from_checkpoint", "report_to", "log_level",
    "address", "num_workers", "use_gpu", "dp", "tp", "pp", "zero_stage",
    "gradient_checkpointing", "torch_compile",
    "min_workers", "max_workers", "max_failures")


class _HelpAll(argparse.Action):
    """--help-all: the help with every flag (``--help`` shows BRIEF's)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show every flag, not only the common ones, and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "full_help"):
                action.help = action.full_help
        parser.epilog = None
        parser.print_help()
        parser.exit()


def add_config_arguments(parser: argparse.ArgumentParser, only: tuple = ()) -> None:
    """TrainConfig's fields as flags, by group; ``--help`` shows BRIEF's, ``--help-all``
    every one."""
    groups = {}
    hidden = 0
    for flag in config_flags(only):
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(
                GROUP_TITLES[flag.group])
        # argparse %-formats help text: a literal % ("15% of the tokens") is written %%.
        kwargs = {"help": flag.help.replace("%", "%%"), "default": argparse.SUPPRESS}
        if flag.type is bool:
            kwargs.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
        elif flag.type is list:
            kwargs.update(nargs="+", action="extend", metavar=flag.metavar)
        else:
            kwargs.update(type=flag.type)
        if flag.choices is not None and flag.type is not bool:
            kwargs["choices"] = flag.choices
        if flag.default not in (None, [], False) and "default:" not in kwargs["help"].lower():
            kwargs["help"] += f" (default: {flag.default})"
        flags = [f"--{n}" for n in flag.names]
        flags += [f"--{n.replace('_', '-')}" for n in flag.names if "_" in n]
        action = groups[flag.group].add_argument(*flags, dest=flag.name, **kwargs)
        if flag.name not in BRIEF and not only:
            action.full_help, action.help = action.help, argparse.SUPPRESS
            hidden += 1
    if hidden:
        parser.add_argument("--help-all", action=_HelpAll)
        parser.epilog = (f"{hidden} more flags: --help-all, or the flags reference in the "
                         "docs (docs/reference/flags.md).")


def load_run_file(path: str) -> dict:
    """A YAML or JSON file whose keys are TrainConfig fields."""
    if not os.path.isfile(path):
        raise ConfigError(f"run file not found: {path}")
    with open(path) as fh:
        text = fh.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
    except Exception as e:
        raise ConfigError(f"cannot parse run file {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"run file {path} must hold a mapping of flag names to values")
    names = set(TrainConfig.field_names())
    values = {ALIASES.get(k.replace("-", "_"), k.replace("-", "_")): v
              for k, v in values.items()}
    for key in values:
        if key not in names:
            if key in FOREIGN:
                raise ConfigError(f"run file {path}: {key}: {FOREIGN[key]}")
            close = difflib.get_close_matches(key, names, n=1)
            raise ConfigError(f"run file {path}: unknown key '{key}'"
                              + (f" (did you mean '{close[0]}'?)" if close else ""))
    return values


def _coerce(name: str, value):
    """Run-file values to the field's type (YAML reads 1e-3 as a string)."""
    tp = _base_type(typing.get_type_hints(TrainConfig)[name])
    if value is None:
        return None
    try:
        if tp is bool:
            return str2bool(value)
        if tp in (int, float):
            return tp(value)
        if tp is list or typing.get_origin(tp) is list:
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
        if tp is str and isinstance(value, dict):  # e.g. lr_scheduler_kwargs
            return json.dumps(value)
        return tp(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise ConfigError(f"run file: '{name}' should be {getattr(tp, '__name__', tp)}, "
                          f"got {value!r}") from None


def config_from_namespace(ns: argparse.Namespace, file_values: dict) -> TrainConfig:
    values = {k: _coerce(k, v) for k, v in file_values.items()}
    values.update({k: v for k, v in vars(ns).items() if k in TrainConfig.field_names()})
    try:
        return TrainConfig(**values)
    except TypeError as e:
        raise ConfigError(str(e)) from None
