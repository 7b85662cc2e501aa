"""The learning-rate schedule of a run: --lr_scheduler_type, its warm-up (--warmup_steps
or --warmup_ratio) and --lr_scheduler_kwargs, as transformers' get_scheduler builds it.

One module for what those flags mean: the ranks' engines build the schedule from it, and
the driver checks the flags with it before any actor starts (it imports nothing of the
engine, so that check costs the driver's start-up no engine import).
"""

from __future__ import annotations

import json
import math

from transformers import get_scheduler


def warmup_for(settings: dict, total_steps: int) -> int:
    """Warm-up steps of a run of ``total_steps`` (``settings``: TrainConfig.to_dict(), as
    the ranks get it): --warmup_steps, else ceil(--warmup_ratio x total_steps), as
    TrainingArguments.get_warmup_steps."""
    if settings["warmup_steps"] > 0:
        return settings["warmup_steps"]
    return math.ceil(total_steps * settings.get("warmup_ratio", 0.0))


def scheduler_kwargs(settings: dict) -> dict:
    """--lr_scheduler_kwargs as a dict ({} when unset); ValueError when it is no JSON
    object."""
    value = settings.get("lr_scheduler_kwargs")
    if value is None or value == "":
        return {}
    out = dict(value) if isinstance(value, dict) else json.loads(value)
    if not isinstance(out, dict):
        raise ValueError("not a JSON object")
    return out


def make_scheduler(optimizer, settings: dict, total_steps: int):
    """The LR schedule of a run of ``total_steps`` for ``optimizer``."""
    return get_scheduler(settings["lr_scheduler_type"], optimizer,
                         num_warmup_steps=warmup_for(settings, max(1, total_steps)),
                         num_training_steps=max(1, total_steps),
                         scheduler_specific_kwargs=scheduler_kwargs(settings))
