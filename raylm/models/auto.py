"""The transformers Auto class raylm builds a model config with."""

from __future__ import annotations


def model_class(config):
    """Causal LMs, and encoder-decoder models (T5) for the seq2seq objective
    (raylm.models.objectives)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False):
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM
