"""LoRA fine-tuning (--use_peft): peft's adapters on the model every rank builds.

peft does the adapters: ``inject_adapter_in_model`` wraps each target layer in its LoRA
layer (the original as ``base_layer``, the adapters as ``lora_A`` / ``lora_B``) and freezes
everything else, so the rest of raylm sees an ordinary model whose frozen parameters have
``requires_grad=False``: AdamW, the gradient buckets, ZeRO's partitions and clipping take
the trainable ones only (no gradient and no optimizer state for the base), and the
planner counts them so (raylm.models.units, raylm.plan.cost).

What raylm adds, and why it is not peft's:

* **The adapters' initial values are a function of (seed, parameter name)**: peft draws
  ``lora_A`` (Kaiming-uniform, as its default init) from torch's global generator, whose
  state depends on what ran before on the rank. Drawn per name, every rank, the ZeRO-3
  materialisation (which fills one tensor at a time, raylm.models.materialize) and the
  tests' single-process reference get the same adapters. ``lora_B`` starts at zero, as
  peft's does, so the model starts as the base.
* **Tensor parallelism shards an adapter with the layer it wraps**
  (raylm.models.tensor_plans.lora_styles): under a column-parallel layer ``lora_B`` is
  column-parallel and ``lora_A`` whole; under a row-parallel layer ``lora_A`` is
  row-parallel and ``lora_B`` whole. Each rank then adds its shard of the adapter's
  output to its shard of the layer's, with no extra communication in the column case
  and one all-reduce of the r-wide activation in the row case.
* **The output**: the adapter as ``PeftModel.save_pretrained`` writes it
  (``adapter_config.json``, ``adapter_model.safetensors``) in output_dir; the base it
  applies to (the --model_name_or_path directory, or for a model trained from scratch
  the initial model, saved in output_dir/base_model); with --merge_lora, the merged model
  in output_dir/merged (peft's ``merge_and_unload``), which plain ``transformers`` loads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from dataclasses import dataclass
from typing import Optional

from raylm import storage
from raylm.errors import ConfigError, first_line
from raylm.models.auto import from_config
from raylm.models.tensor_plans import LORA_SP

# run_lora_clm's defaults.
DEFAULT_RANK, DEFAULT_ALPHA, DEFAULT_DROPOUT = 8, 16.0, 0.05
ADAPTER = "default"  # peft's adapter name
MERGED_DIR, BASE_DIR = "merged", "base_model"
_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora")


@dataclass(frozen=True)
class Lora:
    """The run's LoRA settings, resolved on the driver (``resolve_lora``)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple
    merge: bool = False

    def peft_config(self, config):
        from peft import LoraConfig

        # GPT-2's Conv1D keeps its weight as [in, out] (peft's fan_in_fan_out).
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none",
                          fan_in_fan_out=getattr(config, "model_type", None) == "gpt2")


def without_lora(spec):
    """The spec of the base model (no adapters)."""
    return dataclasses.replace(spec, lora=None) if spec.lora is not None else spec


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (the wrapped layer's own)."""
    return name.replace(".base_layer.", ".")


def adapter_value(name: str, shape, seed: int):
    """The initial value of adapter parameter ``name``: ``lora_A`` Kaiming-uniform
    (a=sqrt(5), peft's default init) from a generator seeded by (seed, name); ``lora_B``
    zeros."""
    import torch

    t = torch.zeros(tuple(shape), dtype=torch.float32)
    if ".lora_A." in name:
        g = torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode()))
                                          % 2**63)
        torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    return t


def add_lora(model, lora: Lora, seed: int):
    """Wrap ``model``'s target layers in peft's LoRA layers (in place; the base frozen),
    the adapters at their initial values (``adapter_value``); on the meta device when the
    model is (their values then come from raylm.models.materialize)."""
    import torch
    from peft import inject_adapter_in_model

    on_meta = any(p.is_meta for p in model.parameters())
    model = inject_adapter_in_model(lora.peft_config(model.config), model,
                                    adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    if not on_meta:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_adapter(name):
                    p.copy_(adapter_value(name, p.shape, seed))
    return model


def meta_base(config, trust_remote_code: bool = False):
    """The model's structure on the meta device, without adapters (no weights)."""
    import torch

    with torch.device("meta"):
        return from_config(config, trust_remote_code)


def resolve_lora(cfg, config) -> Optional[Lora]:
    """The run's Lora (None without --use_peft), checked on the driver: a LoRA flag
    without --use_peft, a value out of range, or target modules that match no layer of
    the model (built on the meta device) is one error line."""
    if not cfg.use_peft:
        given = [f for f in _FLAGS if getattr(cfg, f) not in (None, [], False)]
        if given:
            raise ConfigError(f"--{given[0]} is a LoRA setting: add --use_peft to fine-tune "
                              "with LoRA")
        return None
    rank = DEFAULT_RANK if cfg.lora_rank is None else cfg.lora_rank
    alpha = DEFAULT_ALPHA if cfg.lora_alpha is None else float(cfg.lora_alpha)
    dropout = DEFAULT_DROPOUT if cfg.lora_dropout is None else float(cfg.lora_dropout)
    if rank < 1:
        raise ConfigError(f"--lora_rank must be at least 1 (got {rank})")
    if alpha <= 0:
        raise ConfigError(f"--lora_alpha must be positive (got {alpha:g})")
    if not 0 <= dropout < 1:
        raise ConfigError(f"--lora_dropout must be in [0, 1) (got {dropout:g})")
    if cfg.sequence_parallel and cfg.tp and cfg.tp > 1:  # (refused before Ray starts;
        # the planner does not choose it for LoRA)
        raise ConfigError(f"--sequence_parallel: {LORA_SP}")
    model_type = getattr(config, "model_type", None)
    targets = tuple(cfg.lora_target_modules)
    if not targets:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        targets = tuple(DEFAULTS.get(model_type) or ())
    model = meta_base(config, cfg.trust_remote_code)
    if not targets:
        raise ConfigError(f"--use_peft: peft has no default LoRA target modules for model "
                          f"type '{model_type}'; name them with --lora_target_modules (its "
                          f"linear layers: {', '.join(linear_layer_names(model))})")
    lora = Lora(rank, alpha, dropout, targets, bool(cfg.merge_lora))
    try:
        add_lora(model, lora, 0)
    except ValueError as e:  # peft's NoMatchingPeftModuleError is one
        raise ConfigError(
            f"--lora_target_modules {' '.join(targets)}: {first_line(e)} (this {model_type} "
            f"model's linear layers: {', '.join(linear_layer_names(model))})") from None
    return lora


def linear_layer_names(model) -> list:
    """The distinct last names of a model's linear layers (what --lora_target_modules
    takes), in model order."""
    out = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("Linear", "Conv1D") and not hasattr(module, "base_layer"):
            last = name.rpartition(".")[2]
            if last not in out and not is_adapter(name + "."):
                out.append(last)
    return out


def lora_line(spec) -> str:
    """The run log's line: the adapters and how much of the model trains (on the meta
    device: no weights)."""
    model = add_lora(meta_base(spec.config, spec.trust_remote_code), spec.lora, 0)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora = spec.lora
    return (f"LoRA (peft): rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g} "
            f"on {', '.join(lora.target_modules)}: {trained:,} of {total:,} parameters "
            f"train ({100.0 * trained / max(total, 1):.2f}%), the rest frozen")


# -- the output -------------------------------------------------------------------------------
def save_lora(model, spec, output_dir: str, dtype, save_model,
              named_dir: str | None = None) -> None:
    """Write the adapter of ``model`` (the whole model with its adapters, CPU) into
    ``output_dir`` as ``PeftModel.save_pretrained`` does, in ``dtype``; the base it
    applies to (from scratch: output_dir/base_model); with --merge_lora the merged model
    in output_dir/merged. ``save_model(model, directory)`` writes a whole model. Each
    directory is written under a temporary name and renamed (a reader never sees half
    of one). ``named_dir``: where output_dir's files will be (an object store's URI,
    when they are written locally to be uploaded), for the adapter's name of its base."""
    import torch
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

    lora = spec.lora
    adapters = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    base = _without_adapters(model)
    revision = None
    if spec.hub is not None:  # a Hub model: its id, at the snapshot trained from
        base_path, revision = spec.hub.repo_id, spec.hub.commit
    elif spec.pretrained_path:
        base_path = spec.pretrained_path
    else:
        _atomic(os.path.join(output_dir, BASE_DIR), lambda d: save_model(base, d))
        base_path = storage.shown(storage.join(storage.local_path(named_dir or output_dir),
                                               BASE_DIR))
    base.config.use_cache = True
    peft_model = PeftModel(base, lora.peft_config(base.config), adapter_name=ADAPTER)
    # (get_peft_model_state_dict of the plain model names its layers without the
    # PeftModel's own prefix)
    loaded = set_peft_model_state_dict(
        peft_model, {f"base_model.model.{k}": v for k, v in adapters.items()},
        adapter_name=ADAPTER)
    if loaded.unexpected_keys or len(adapters) == 0:
        raise RuntimeError(f"save_lora: the adapter's {len(adapters)} tensors did not load "
                           f"into a PeftModel (unexpected: {loaded.unexpected_keys[:3]})")
    peft_model.peft_config[ADAPTER].base_model_name_or_path = base_path
    peft_model.peft_config[ADAPTER].revision = revision
    if dtype != torch.float32:
        peft_model.to(dtype)
    staging = os.path.join(output_dir, ".adapter.tmp")
    peft_model.save_pretrained(staging, safe_serialization=True)
    for name in os.listdir(staging):
        if name != "README.md":  # (peft's model card template: nothing filled in)
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        else:
            os.remove(os.path.join(staging, name))
    os.rmdir(staging)
    if lora.merge:
        merged = peft_model.merge_and_unload()
        _atomic(os.path.join(output_dir, MERGED_DIR),
                lambda d: save_model(merged, d))


def lora_model_dirs(spec, output_dir: str) -> list:
    """The whole models a LoRA run saves beside its adapter (each wants the tokenizer
    too): the base from scratch, the merged model."""
    if spec.lora is None:
        return []
    dirs = [] if spec.pretrained_path else [BASE_DIR]
    dirs += [MERGED_DIR] if spec.lora.merge else []
    return [storage.join(output_dir, d) for d in dirs
            if storage.isdir(storage.join(output_dir, d))]


def point_adapter_at_own_base(output_dir: str, named_dir: str | None = None) -> None:
    """An adapter copied with its base_model/ (a model-only checkpoint's, copied to
    output_dir as the best model) names the copy as its base. ``named_dir``: where
    output_dir's files will be (a bucket's URI, when they are uploaded from here)."""
    import json

    config = os.path.join(output_dir, "adapter_config.json")
    if not (os.path.isfile(config) and os.path.isdir(os.path.join(output_dir, BASE_DIR))):
        return
    base = storage.shown(storage.join(storage.local_path(named_dir or output_dir), BASE_DIR))
    with open(config) as f:
        data = json.load(f)
    data["base_model_name_or_path"] = base
    with open(config + ".tmp", "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(config + ".tmp", config)


def _without_adapters(model):
    """A copy of ``model`` as the base model class, its layers unwrapped (the base
    weights, trainable flags reset)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    base = copy.deepcopy(model)
    for name, module in list(base.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, attr = name.rpartition(".")
            setattr(base.get_submodule(parent) if parent else base, attr,
                    module.get_base_layer())
    for p in base.parameters():
        p.requires_grad_(True)
    return base


def _atomic(path: str, write) -> None:
    """``write(directory)`` into a temporary sibling, then renamed to ``path``."""
    import shutil

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
