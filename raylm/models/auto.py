"""The transformers Auto class raylm builds a model config with."""

from __future__ import annotations


def model_class(config):
    """Causal LMs, and encoder-decoder models (T5) for the seq2seq objective
    (raylm.models.objectives)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


def from_config(config, trust_remote_code: bool = False, **kwargs):
    """A freshly initialised model of ``config`` (a --trust_remote_code model's class comes
    from its repository's code)."""
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    return model_class(config).from_config(config, **kwargs)
