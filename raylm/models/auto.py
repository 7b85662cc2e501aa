"""The transformers Auto class raylm builds a model config with.

Which head a model gets follows its objective (raylm.models.objectives): causal LMs, T5-style
encoder-decoders (seq2seq) and masked-LM encoders. The choice is kept where transformers
keeps it, in ``config.architectures`` (``set_head``, on the driver), so every place that
builds the model from its config (each rank, the meta-device skeleton, the planner) builds
the same class, and the saved config.json names it for ``AutoModel*`` loaders.
"""

from __future__ import annotations

from raylm.errors import ConfigError


def _mappings():
    from transformers.models.auto import modeling_auto as m

    return {"causal": m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "seq2seq": m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            "span_corruption": m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
            "mlm": m.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
            "image_classification": m.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}


def heads_of(config) -> list:
    """The objectives transformers has a head class for, for ``config``'s model type."""
    return [o for o, m in _mappings().items() if config.model_type in m]


def head_class(config, objective: str):
    """The class name transformers trains ``objective`` with for ``config``'s model type
    (None: it has none)."""
    return _mappings()[objective].get(getattr(config, "model_type", None))


def is_head(config, objective: str) -> bool:
    """Whether ``config.architectures`` names ``objective``'s head class."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    return arch is not None and arch == head_class(config, objective)


def types_with_head(objective: str) -> list:
    """The model types transformers has ``objective``'s head for, sorted."""
    return sorted(_mappings()[objective])


def set_head(config, objective: str) -> None:
    """Name in ``config.architectures`` the class that trains ``objective``; a one-line
    ConfigError when transformers has none for the model type. (A model whose code comes
    with it, --trust_remote_code, keeps its own.)"""
    if getattr(config, "auto_map", None):
        return
    name = head_class(config, objective)
    if name is None:
        raise ConfigError(f"model type '{config.model_type}' has no {objective} head in "
                          f"transformers (it has: {', '.join(heads_of(config)) or 'none'}); "
                          "raylm trains causal LMs, masked-LM encoders and T5-style "
                          "encoder-decoders")
    config.architectures = [name]


def model_class(config):
    """The Auto class of the head ``config.architectures`` names: masked LM for a
    masked-LM class of a non-encoder-decoder, image classification for an
    image-classification class, seq2seq for an encoder-decoder, else causal LM."""
    from transformers import (AutoModelForCausalLM, AutoModelForImageClassification,
                              AutoModelForMaskedLM, AutoModelForSeq2SeqLM)

    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    if is_head(config, "image_classification"):
        return AutoModelForImageClassification
    if is_head(config, "mlm"):
        return AutoModelForMaskedLM
    return AutoModelForCausalLM


def from_config(config, trust_remote_code: bool = False, **kwargs):
    """A freshly initialised model of ``config`` (a --trust_remote_code model's class comes
    from its repository's code)."""
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    return model_class(config).from_config(config, **kwargs)


def from_pretrained(spec, seed: int):
    """``spec``'s saved model (raylm.models.loading.ModelSpec) in float32, ``spec.config``
    its config; weights the directory lacks are initialised as from_config's are, after
    ``torch.manual_seed(seed)``. With ``spec.new_head`` (an image classifier on other
    classes, --ignore_mismatched_sizes, or a checkpoint of the body alone) the head, every
    parameter outside the base model (``base_model_prefix``), is the one from_config
    draws after ``torch.manual_seed(seed)``, whatever the checkpoint holds there (of
    another size, or of the same size for other classes or another order): the same on
    every rank. (The caller's generator is left seeded, as build_model's from-scratch
    path leaves it.)"""
    import torch

    new_head = getattr(spec, "new_head", False)
    if new_head:
        torch.manual_seed(seed)
        fresh = from_config(spec.config, spec.trust_remote_code,
                            dtype=torch.float32).state_dict()
    torch.manual_seed(seed)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (each rank's "Loading weights" bar: log noise)
    try:
        model = model_class(spec.config).from_pretrained(
            spec.weights_dir, config=spec.config, dtype=torch.float32,
            trust_remote_code=spec.trust_remote_code, ignore_mismatched_sizes=new_head)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    if new_head:
        body = model.base_model_prefix + "."
        unexpected = model.load_state_dict(
            {k: v for k, v in fresh.items() if not k.startswith(body)}, strict=False
        ).unexpected_keys
        assert not unexpected, unexpected  # (the same class, built from the same config)
    return model


def apply_overrides(config, overrides) -> None:
    """--config_overrides ("a=1,b=x") applied to ``config``; one ConfigError for an item
    that is not key=value or a key the config lacks."""
    if not overrides:
        return
    # PretrainedConfig.update_from_string parses "a=1,b=x" with the types of the current
    # values, and refuses keys the config lacks; turn its error into ours.
    for item in overrides.split(","):
        if "=" not in item:
            raise ConfigError(f"--config_overrides: '{item}' is not of the form key=value")
        key = item.split("=", 1)[0].strip()
        if not hasattr(config, key):
            raise ConfigError(
                f"--config_overrides: {type(config).__name__} has no key '{key}'")
    try:
        config.update_from_string(overrides)
    except ValueError as e:
        raise ConfigError(f"--config_overrides: {e}") from None


def config_of_type(model_type, default_type: str, defaults: dict, overrides):
    """A fresh config of ``model_type`` (--model_type; None: ``default_type`` with
    ``defaults`` set, raylm's built-in model), with --config_overrides applied."""
    from transformers import CONFIG_MAPPING

    name = model_type or default_type
    if name not in CONFIG_MAPPING:
        raise ConfigError(f"--model_type: unknown model type '{name}'")
    config = CONFIG_MAPPING[name]()
    if model_type is None:
        for k, v in defaults.items():
            setattr(config, k, v)
    apply_overrides(config, overrides)
    return config
