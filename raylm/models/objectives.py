"""Training objectives: which tensors a model is fed from a packed block, and its loss.

raylm's data is packed token blocks (raylm.data). A decoder-only model learns the next
token of each block (run_clm). An encoder-decoder model (T5) learns the continuation: the
encoder reads the first half of a block and the decoder predicts the second half, which
uses the same packed data with no separate corpus format.

Losses are summed over tokens, not averaged: a step divides by the label-token count of
the whole global batch, so that every layout computes the same loss as one process.

Under tensor parallelism the logits are a DTensor sharded on the vocabulary; inside
``loss_parallel()`` the same ``F.cross_entropy`` call is torch's parallel cross-entropy,
whose (replicated) result is returned as a plain, differentiable tensor.
"""

from __future__ import annotations

import torch.nn.functional as F

IGNORE_INDEX = -100


class CausalLM:
    name = "causal"

    def split(self, batch: dict) -> dict:
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    def loss_sum(self, logits, labels):
        """Next-token cross-entropy: labels shifted by one, IGNORE_INDEX skipped."""
        shift_logits = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()
        shift_labels = labels[:, 1:].reshape(-1)
        return _local(F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX,
                                      reduction="sum"))

    def count(self, labels) -> int:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())


class Seq2Seq:
    """Encoder input: the first half of a block; labels: the second half; decoder input:
    the labels shifted right behind the decoder start token (as HF's ``_shift_right``)."""

    name = "seq2seq"

    def __init__(self, pad_token_id: int, decoder_start_token_id: int):
        self.pad = pad_token_id
        self.start = decoder_start_token_id

    def split(self, batch: dict) -> dict:
        ids, labels = batch["input_ids"], batch["labels"]
        half = ids.shape[1] // 2
        target = labels[:, half:].contiguous()
        dec = target.new_full(target.shape, self.start)
        dec[:, 1:] = target[:, :-1]
        dec.masked_fill_(dec == IGNORE_INDEX, self.pad)
        return {"input_ids": ids[:, :half].contiguous(), "labels": target,
                "decoder_input_ids": dec}

    def loss_sum(self, logits, labels):
        return _local(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                      labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                      reduction="sum"))

    def count(self, labels) -> int:
        return int((labels != IGNORE_INDEX).sum())


def _local(loss):
    """Under tensor parallelism the logits are vocabulary-sharded DTensors and
    loss_parallel's cross-entropy is a replicated DTensor: every rank holds the whole
    value, so its local tensor is the loss (and stays differentiable)."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


def objective_for(config):
    if getattr(config, "is_encoder_decoder", False):
        start = config.decoder_start_token_id
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        return Seq2Seq(pad, start if start is not None else pad)
    return CausalLM()


def is_seq2seq(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


