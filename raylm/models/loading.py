"""Hugging Face models in: resolve what to build (on the driver), build it (on each rank).

The driver resolves and validates the model source without building weights, so a bad
name, a bad override or a block size past the model's positions is one clear error before
any actor starts. Each rank actor then builds the same model from the resolved spec.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from raylm.errors import ConfigError, first_line
from raylm.models.auto import (apply_overrides, config_of_type, from_config, from_pretrained,
                               heads_of, set_head)
from raylm.models.hub import HubRef, ensure_local, fetch, is_hub_name
from raylm.models.lora import Lora, add_lora, resolve_lora, without_lora
from raylm.models.objectives import raw_length, resolve_objective

log = logging.getLogger("raylm")

# The built-in default model: a tiny GPT-2 that trains in minutes on two CPU cores.
DEFAULT_MODEL_TYPE = "gpt2"
DEFAULT_MODEL_CONFIG = dict(n_positions=128, n_embd=128, n_layer=4, n_head=4)


@dataclass
class ModelSpec:
    """Everything a rank needs to build the model: picklable, no weights."""

    config: object  # transformers.PretrainedConfig
    pretrained_path: Optional[str]  # load weights from here, else init from config
    tokenizer_dir: str
    vocab_size: int  # len(tokenizer)
    hub: Optional[HubRef] = None  # where pretrained_path came from, for a Hub name
    trust_remote_code: bool = False
    objective: Optional[str] = None  # the run's (raylm.models.objectives.resolve_objective)
    # What a drawing objective needs: masked LM's Masking, span corruption's Spans.
    masking: Optional[object] = None
    lora: Optional[Lora] = None  # --use_peft: the adapters every rank adds (raylm.models.lora)
    # A model of the user's own (train(..., model_init=)): config is then a CustomConfig
    # (raylm.models.custom).
    model_init: Optional[Callable] = None
    # The user's loss (train(..., compute_loss_func=)): raylm.models.objectives.UserLoss.
    loss_fn: Optional[Callable] = None
    # An image classifier's head is not pretrained_path's (other classes with
    # --ignore_mismatched_sizes, or a checkpoint with no classification head): built as
    # from_config would build it (raylm.models.auto.from_pretrained).
    new_head: bool = False

    @property
    def weights_dir(self) -> Optional[str]:
        """pretrained_path on this node (a Hub snapshot fetched here if it is not)."""
        return ensure_local(self.pretrained_path, self.hub) if self.pretrained_path else None

    @property
    def max_positions(self) -> Optional[int]:
        return max_positions(self.config)


OBJECTIVE_NAMES = {"causal": "causal LM", "mlm": "masked LM",
                   "seq2seq": "seq2seq (the second half of each block from the first)",
                   "span_corruption": "span corruption",
                   "image_classification": "image classification"}


def model_line(cfg, spec: ModelSpec) -> str:
    """The run log's line naming the model, its objective and its tokenizer."""
    from raylm.data.sources import builtin_tokenizer_dir

    if spec.model_init is not None:
        model = "a model of your own (model_init)"
    elif spec.pretrained_path:
        model = f"{cfg.model_name_or_path} (pretrained weights)"
    else:
        model = (f"{spec.config.model_type} from " + (cfg.config_name or "its default config")
                 + (f" with {cfg.config_overrides}" if cfg.config_overrides else "")
                 + ", fresh weights")
    line = f"model: {model}; objective: {OBJECTIVE_NAMES.get(spec.objective, spec.objective)}"
    if spec.tokenizer_dir:
        if spec.tokenizer_dir == builtin_tokenizer_dir():
            tokenizer = "raylm's built-in BPE"
        else:
            tokenizer = cfg.tokenizer_name or cfg.model_name_or_path or spec.tokenizer_dir
        line += f"; tokenizer: {tokenizer} ({spec.vocab_size:,} tokens)"
    return line


def max_positions(config) -> Optional[int]:
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_model(cfg, model_init: Optional[Callable] = None,
                  classes: Optional[list] = None, tp_plan: Optional[dict] = None) -> ModelSpec:
    """Validate the model flags of a TrainConfig and return a ModelSpec (driver side);
    ``model_init``: a model of the user's own (raylm.models.custom), ``tp_plan`` its
    tensor-parallel plan; ``classes``: an image classifier's (--task
    image-classification: raylm.models.vision)."""
    from raylm.data.sources import builtin_tokenizer_dir
    from raylm.data.tokenized import load_tokenizer

    images = getattr(cfg, "task", None) == "image-classification"
    if images:
        from raylm.models.torchvision_models import is_torchvision_type
    torchvision = images and model_init is None and is_torchvision_type(cfg.model_type)
    if tp_plan is not None and model_init is None and not torchvision:
        raise ConfigError("tp_plan is a model of your own's tensor-parallel plan: give "
                          "model_init with it, or a torchvision --model_type (a "
                          "transformers model brings its own)")
    if images:
        from raylm.models import vision

        if cfg.ignore_mismatched_sizes and (torchvision or model_init is not None):
            raise ConfigError("--ignore_mismatched_sizes replaces the head of a transformers "
                              "classifier loaded with --model_name_or_path; "
                              + ("torchvision's" if torchvision else "a model_init")
                              + " model is built with the data's classes already")
        if torchvision:
            # torchvision's classifier of that name: a model of your own that raylm names
            import dataclasses

            from raylm.models.torchvision_models import torchvision_classifier

            model_init, size = torchvision_classifier(cfg, classes or [])
            cfg = dataclasses.replace(cfg, model_type=None, config_overrides=None,
                                      image_size=size, num_channels=3)
        if model_init is not None:  # a model of the user's own, on images
            from raylm.models.custom import check_custom_images
            from raylm.models.objectives import Augment
            from raylm.models.units import transformer_blocks

            config = check_custom_images(cfg, model_init, classes or [], transformer_blocks,
                                         tp_plan)
            return ModelSpec(config=config, pretrained_path=None, tokenizer_dir="",
                             vocab_size=0, objective="image_classification",
                             masking=Augment(seed=cfg.seed, flip=cfg.image_flip),
                             model_init=model_init)
        vision.check_model_flags(cfg)
        config, pretrained, hub = model_config(cfg, vision.DEFAULT_MODEL_TYPE,
                                               vision.DEFAULT_VIT)
        config, augment, new_head = vision.image_classifier(cfg, config, pretrained,
                                                            classes or [])
        return ModelSpec(config=config, pretrained_path=pretrained, tokenizer_dir="",
                         vocab_size=0, hub=hub, objective="image_classification",
                         masking=augment, new_head=new_head)
    if model_init is not None:
        from raylm.models.custom import check_custom
        from raylm.models.units import transformer_blocks

        tokenizer_dir = cfg.tokenizer_name or builtin_tokenizer_dir()
        if not os.path.isdir(tokenizer_dir):
            raise ConfigError(f"--tokenizer_name: no such directory: {tokenizer_dir}")
        tokenizer_dir = os.path.abspath(tokenizer_dir)
        vocab = len(load_tokenizer(tokenizer_dir))
        config = check_custom(cfg, model_init, tokenizer_dir, vocab, transformer_blocks,
                              tp_plan)
        return ModelSpec(config=config, pretrained_path=None, tokenizer_dir=tokenizer_dir,
                         vocab_size=vocab, objective="causal", model_init=model_init)

    config, pretrained, hub = model_config(cfg, DEFAULT_MODEL_TYPE, DEFAULT_MODEL_CONFIG)
    remote = cfg.trust_remote_code and "AutoModelForCausalLM" in \
        (getattr(config, "auto_map", None) or {})
    if not remote and not heads_of(config):
        raise ConfigError(f"model type '{config.model_type}' has no causal-LM, masked-LM or "
                          "seq2seq-LM head; raylm trains language models (run_clm, run_mlm, "
                          "and T5-style encoder-decoders)")

    if cfg.tokenizer_name:
        tokenizer_dir = _local(cfg, cfg.tokenizer_name, "--tokenizer_name")[0]
    elif pretrained and any(os.path.exists(os.path.join(pretrained, f)) for f in
                            ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tokenizer_dir = pretrained
    elif pretrained:
        raise ConfigError(f"--model_name_or_path {pretrained} has no tokenizer files; "
                          "give one with --tokenizer_name")
    else:
        tokenizer_dir = builtin_tokenizer_dir()
    if not os.path.isdir(tokenizer_dir):
        raise ConfigError(f"--tokenizer_name: no such directory: {tokenizer_dir}")
    tokenizer = load_tokenizer(os.path.abspath(tokenizer_dir))
    vocab = len(tokenizer)
    if vocab > config.vocab_size:
        if pretrained:
            raise ConfigError(f"the tokenizer in {tokenizer_dir} has {vocab} tokens but the "
                              f"model's embedding has {config.vocab_size}")
        # Like run_clm resizing embeddings: a model from scratch is sized to its tokenizer.
        config.vocab_size = vocab
    overridden = "vocab_size=" in (cfg.config_overrides or "")
    if not pretrained and cfg.config_name is None and not overridden:
        # A model type's default config carries its reference tokenizer's vocabulary
        # (GPT-2: 50257); from scratch, the embedding is sized to the tokenizer in use.
        config.vocab_size = vocab
    if not pretrained:
        _set_special_tokens(config, tokenizer)
    if getattr(config, "is_encoder_decoder", False):
        # The decoder starts from this token; T5 uses the pad token (HF's T5 docs).
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
        if getattr(config, "decoder_start_token_id", None) is None:
            config.decoder_start_token_id = config.pad_token_id
    # The objective decides the head (config.architectures) every rank builds.
    objective, masking = resolve_objective(cfg, config, tokenizer, tokenizer_dir)
    set_head(config, objective)
    spec = ModelSpec(config=config, pretrained_path=pretrained,
                     tokenizer_dir=os.path.abspath(tokenizer_dir), vocab_size=vocab, hub=hub,
                     trust_remote_code=cfg.trust_remote_code, objective=objective,
                     masking=masking)
    spec.lora = resolve_lora(cfg, config)
    return spec


def _local(cfg, name: str, flag: str) -> tuple:
    """(local path, HubRef or None): a Hub name is fetched (raylm.models.hub)."""
    if is_hub_name(name):
        return fetch(name, flag, cfg.model_revision, cfg.token, cfg.cache_dir)
    return name, None


def model_config(cfg, default_type: str, defaults: dict) -> tuple:
    """(config, pretrained directory or None, HubRef or None) the model flags name:
    --model_name_or_path (a saved model's directory or a Hub id), --config_name, or
    --model_type (None: ``default_type`` with ``defaults``) with --config_overrides; one
    ConfigError naming the flag for what cannot be read."""
    from transformers import AutoConfig

    def read_config(path: str, flag: str):
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            if "trust_remote_code" in str(e):
                raise ConfigError(f"{flag} {path}: the model's code comes with it, not with "
                                  "transformers: read it, then give --trust_remote_code "
                                  "to run it") from None
            raise ConfigError(f"{flag}: cannot read a model config from {path}: "
                              f"{first_line(e)}") from None

    pretrained, hub = None, None
    if cfg.model_name_or_path:
        path, hub = _local(cfg, cfg.model_name_or_path, "--model_name_or_path")
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"--model_name_or_path: {path} is not a model directory (no config.json): "
                "give a directory saved with save_pretrained, or a Hub model id")
        config = read_config(path, "--model_name_or_path")
        pretrained = os.path.abspath(path)
        if cfg.config_overrides:
            raise ConfigError("--config_overrides applies to models trained from scratch, "
                              "not to --model_name_or_path")
    elif cfg.config_name:
        name = _local(cfg, cfg.config_name, "--config_name")[0]
        if not os.path.exists(name):
            raise ConfigError(f"--config_name: no such file or directory: {cfg.config_name}")
        config = read_config(name, "--config_name")
        apply_overrides(config, cfg.config_overrides)
    else:
        config = config_of_type(cfg.model_type, default_type, defaults, cfg.config_overrides)
    return config, pretrained, hub


def _set_special_tokens(config, tokenizer) -> None:
    # A model from scratch takes its special tokens from its tokenizer (GPT2Config's
    # defaults name token 50256, which a small vocabulary does not have).
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None or getattr(config, name, None) is not None:
            setattr(config, name, value)


def resolve_block_size(cfg, spec: ModelSpec) -> int:
    """The tokens of a sample in the data: --block_size (--max_seq_length), checked
    against the model's positions. Under span corruption that flag is the encoder's
    input length, and a sample is the longer raw span that corrupts to it."""
    if spec.objective == "image_classification":
        from raylm.models.vision import sequence_length

        return sequence_length(spec.config)
    limit = spec.max_positions
    if cfg.block_size is None:
        size = min(limit or 1024, 1024)
    elif cfg.block_size < 2:
        raise ConfigError(f"--block_size must be at least 2 (got {cfg.block_size})")
    elif limit is not None and cfg.block_size > limit:
        raise ConfigError(f"--block_size {cfg.block_size} is larger than the model's maximum "
                          f"positions ({limit})")
    else:
        size = cfg.block_size
    if spec.objective == "span_corruption":
        return raw_length(spec.masking, size)
    return size


def build_model(spec: ModelSpec, seed: int, device=None):
    """Build the model on this rank: identical on every rank (same seed, same weights).

    ``device=None`` (or ``"cpu"``): the model with its weights: from scratch,
    ``torch.manual_seed(seed)`` then Hugging Face's ``from_config`` (torch's default init at
    construction, then the model's own ``_init_weights``, tied weights tied), which leaves
    the global CPU generator seeded and advanced past those draws; or the weights of
    ``spec.pretrained_path``.

    ``device="meta"`` (ZeRO stage 3): the same model's skeleton, without its weights: every
    parameter is on the meta device, every buffer (persistent or not, e.g. a rotary
    embedding's ``inv_freq``) is a real CPU tensor equal to the one ``device=None`` gives,
    and tied weights are the same Parameter object. Nothing the size of the model is ever
    allocated: the construction runs with its tensors on the meta device and only the ops
    the buffers depend on are replayed (raylm.models.materialize). It neither reads nor
    changes any random generator (callers seed their own training RNG afterwards). Fill
    the parameters with ``raylm.models.materialize.initial_state(spec, seed)``, which
    yields build_model's values a module at a time.
    """
    import torch

    if device is not None and torch.device(device).type == "meta":
        from raylm.models.materialize import meta_skeleton

        model = meta_skeleton(without_lora(spec), seed)
        model.config.use_cache = False
        return add_lora(model, spec.lora, seed) if spec.lora is not None else model
    if spec.model_init is not None:  # a model of the user's own (raylm.models.custom)
        from raylm.models.custom import build_custom

        return build_custom(spec.model_init, spec.config, seed)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"build_model: device must be None, 'cpu' or 'meta' (got {device!r})")
    if spec.pretrained_path:
        model = from_pretrained(spec, seed)
    else:
        torch.manual_seed(seed)
        model = from_config(spec.config, spec.trust_remote_code, dtype=torch.float32)
    # HF models default to the KV cache for generation; training never uses it.
    model.config.use_cache = False
    return add_lora(model, spec.lora, seed) if spec.lora is not None else model

