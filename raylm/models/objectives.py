"""Training objectives: which tensors a model is fed from a packed block, and its loss.

An objective is chosen by name (``--objective``, ``OBJECTIVES``); unset, the model decides
(``default_objective``: seq2seq for encoder-decoder models, causal otherwise). Its
``split(batch, step)`` sees the batch's tokens and the ids of its samples
(``batch["sample_ids"]``, raylm.data.reader) and the optimizer step (None when
evaluating), so an objective that draws something per sample (dynamic masking) can make it
a deterministic function of (seed, step, sample id), the same on every layout.

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

from raylm.errors import ConfigError

IGNORE_INDEX = -100


class CausalLM:
    name = "causal"

    def split(self, batch: dict, step=None) -> dict:
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

    def split(self, batch: dict, step=None) -> dict:
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


def is_seq2seq(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def _seq2seq(config) -> Seq2Seq:
    start = config.decoder_start_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return Seq2Seq(pad, start if start is not None else pad)


# name -> (builds the objective for a model config, which models it trains)
OBJECTIVES = {
    "causal": (lambda config: CausalLM(), lambda config: not is_seq2seq(config)),
    "seq2seq": (_seq2seq, is_seq2seq),
}


def default_objective(config) -> str:
    return "seq2seq" if is_seq2seq(config) else "causal"


def check_objective(config, name=None) -> str:
    """The objective a run uses: ``name`` (--objective), else the model's default. A
    one-line ConfigError for a name raylm does not know or a model it cannot train."""
    name = name or default_objective(config)
    if name not in OBJECTIVES:
        raise ConfigError(f"--objective {name}: choose one of {', '.join(OBJECTIVES)}")
    if not OBJECTIVES[name][1](config):
        kind = "an encoder-decoder" if is_seq2seq(config) else "a decoder-only"
        raise ConfigError(f"--objective {name} does not train {kind} model "
                          f"('{config.model_type}'); its objective is "
                          f"{default_objective(config)} (leave --objective unset)")
    return name


def objective_for(config, name=None):
    """The objective object for ``config`` (``name``: --objective; None: the model's)."""
    return OBJECTIVES[check_objective(config, name)][0](config)
