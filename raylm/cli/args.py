"""Flags from TrainConfig's fields, run files (YAML/JSON), one-line errors.

Booleans follow Hugging Face's HfArgumentParser: ``--do_train`` alone or
``--do_train true|false``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing

from raylm.config import TrainConfig
from raylm.errors import ConfigError

GROUP_TITLES = {
    "model": "model (as in run_clm.py)",
    "data": "data (as in run_clm.py)",
    "training": "optimisation (as in run_clm.py / TrainingArguments)",
    "output": "logging, evaluation and checkpoints",
    "cluster": "raylm: cluster and layout",
}


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).lower()
    if v in ("true", "1", "yes", "y", "on"):
        return True
    if v in ("false", "0", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (with a did-you-mean) and exit status 2.

    Abbreviated flags are refused: ``--learning_rat`` must not silently mean
    ``--learning_rate``.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
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


def add_config_arguments(parser: argparse.ArgumentParser, only: tuple = ()) -> None:
    hints = typing.get_type_hints(TrainConfig)
    groups = {}
    for f in dataclasses.fields(TrainConfig):
        if only and f.name not in only:
            continue
        meta = f.metadata
        gname = meta.get("group", "training")
        if gname not in groups:
            groups[gname] = parser.add_argument_group(GROUP_TITLES.get(gname, gname))
        group = groups[gname]
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs = {"help": meta.get("help", ""), "default": argparse.SUPPRESS}
        if tp is bool:
            kwargs.update(type=str2bool, nargs="?", const=True, metavar="BOOL")
        elif tp is list or typing.get_origin(tp) is list:
            kwargs.update(nargs="+", action="extend", metavar="PATH")
        else:
            kwargs.update(type=tp)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        if default not in (None, [], False) and "default:" not in kwargs["help"].lower():
            kwargs["help"] += f" (default: {default})"
        group.add_argument(f"--{f.name}", **kwargs)


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
    for key in values:
        if key not in names:
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
