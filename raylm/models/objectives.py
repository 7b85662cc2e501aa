"""Training objectives: which tensors a model is fed from a packed block, and its loss.

An objective is chosen by name (``--objective``, ``OBJECTIVES``); unset, the model decides
(``default_objective``: seq2seq for encoder-decoder models, masked LM for encoder-only
models with a masked-LM head (BERT, RoBERTa, DistilBERT, ALBERT, ...), causal otherwise).
Its ``split(batch, epoch)`` sees the batch's tokens and the ids of its samples
(``batch["sample_ids"]``, raylm.data.reader) and the epoch of the step (None when
evaluating), so an objective that draws something per sample (masked LM's dynamic
masking) makes it a deterministic function of (seed, epoch, sample id): the same on every
layout, after every resume and every resize.

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

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from raylm.errors import ConfigError
from raylm.models.auto import head_class, is_head

IGNORE_INDEX = -100


class CausalLM:
    name = "causal"

    def split(self, batch: dict, epoch=None) -> dict:
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    def loss_sum(self, logits, labels):
        """Next-token cross-entropy, IGNORE_INDEX skipped: each position scores the label
        after it. The labels are shifted (the last position then has none), not the
        logits, as transformers' ForCausalLMLoss does: slicing the logits would copy them
        and their gradient, a micro-batch x block x vocabulary tensor each way (measured
        on 16 x 128 x 4096: 20 ms against 13-15 ms for the loss and its backward)."""
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
        return _local(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                      shift_labels, ignore_index=IGNORE_INDEX,
                                      reduction="sum"))

    def count(self, labels) -> int:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())


class _PerPosition:
    """A loss on the labels as they stand (no shift): each label scores the logits at
    its own position."""

    def loss_sum(self, logits, labels):
        return _local(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                      labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                      reduction="sum"))

    def count(self, labels) -> int:
        return int((labels != IGNORE_INDEX).sum())


def shift_right(labels, start: int, pad: int):
    """The decoder's input for ``labels``: shifted right behind the start token, ignored
    positions as pad (HF's ``_shift_right``)."""
    dec = labels.new_full(labels.shape, start)
    dec[:, 1:] = labels[:, :-1]
    return dec.masked_fill_(dec == IGNORE_INDEX, pad)


class Seq2Seq(_PerPosition):
    """Encoder input: the first half of a block; labels: the second half; decoder input:
    the labels shifted right behind the decoder start token (as HF's ``_shift_right``)."""

    name = "seq2seq"

    def __init__(self, pad_token_id: int, decoder_start_token_id: int):
        self.pad = pad_token_id
        self.start = decoder_start_token_id

    def split(self, batch: dict, epoch=None) -> dict:
        ids, labels = batch["input_ids"], batch["labels"]
        half = ids.shape[1] // 2
        target = labels[:, half:].contiguous()
        return {"input_ids": ids[:, :half].contiguous(), "labels": target,
                "decoder_input_ids": shift_right(target, self.start, self.pad)}


@dataclass(frozen=True)
class Masking:
    """What masked LM needs to know, settled on the driver from the flags and the
    tokenizer (resolve_objective): every rank masks with the same facts."""

    seed: int
    probability: float  # --mlm_probability
    mask_token_id: int
    special_ids: tuple  # never masked (the tokenizer's all_special_ids, as HF's collator)
    vocab_size: int  # random replacements are drawn from [0, len(tokenizer))
    # --whole_word_masking: the ids of tokens that continue a word (WordPiece's "##...").
    continuation_ids: Optional[tuple] = None


def _sample_seed(seed: int, epoch: Optional[int], sample_id: int) -> np.ndarray:
    """Two 32-bit words from (seed, epoch, sample id) alone: what a sample's random draws
    start from. Evaluation (epoch None) has a stream of its own, the same at every
    evaluation."""
    key = [seed, 0, epoch, sample_id] if epoch is not None else [seed, 1, sample_id]
    return np.random.SeedSequence(key).generate_state(2)


def _sample_generator(seed: int, epoch: Optional[int], sample_id: int) -> torch.Generator:
    a, b = _sample_seed(seed, epoch, sample_id)
    return torch.Generator().manual_seed((int(a) << 31) ^ int(b))


def mask_tokens(input_ids, labels, sample_ids, masking: Masking, epoch: Optional[int]):
    """Dynamic masking as transformers' DataCollatorForLanguageModeling does it: each
    token that has a label and is not special is selected with probability
    ``masking.probability``; a selected token becomes the mask token 80% of the time, a
    random token 10%, stays itself 10%; labels are the selected tokens' originals
    (IGNORE_INDEX elsewhere). With ``continuation_ids`` a word's tokens are selected
    together (the draw of its first token decides). Unlike the collator, which draws
    from one stream in batch order, each sample's draws come from its own generator
    (``_sample_generator``): which tokens of sample 17 are masked in epoch 2 is the same
    whatever batch, rank or layout the sample lands in. Filler rows (negative ids) get
    no labels. Returns (masked input ids, labels)."""
    ids = input_ids.clone()
    out = torch.full_like(input_ids, IGNORE_INDEX)
    length = ids.shape[1]
    specials = torch.tensor(masking.special_ids, dtype=ids.dtype)
    candidate = (labels != IGNORE_INDEX) & ~torch.isin(input_ids, specials)
    if masking.continuation_ids is not None:
        starts = ~torch.isin(input_ids, torch.tensor(masking.continuation_ids,
                                                     dtype=ids.dtype)) | ~candidate
        positions = torch.arange(length).expand_as(ids)
        # Each token's word start: the last start at or before it.
        first = torch.cummax(torch.where(starts, positions, 0), dim=1).values
    for row, sid in enumerate(sample_ids.tolist()):
        if sid < 0:
            continue
        g = _sample_generator(masking.seed, epoch, sid)
        select, replace, randomize = torch.rand(3, length, generator=g)
        words = torch.randint(masking.vocab_size, (length,), generator=g, dtype=ids.dtype)
        if masking.continuation_ids is not None:
            select = select[first[row]]
        chosen = candidate[row] & (select < masking.probability)
        to_mask = chosen & (replace < 0.8)
        to_random = chosen & ~to_mask & (randomize < 0.5)
        out[row, chosen] = input_ids[row, chosen]
        ids[row, to_mask] = masking.mask_token_id
        ids[row, to_random] = words[to_random]
    return ids, out


class MaskedLM(_PerPosition):
    """BERT's objective (run_mlm): predict the selected tokens of a bidirectionally
    attended sample from their masked context (``mask_tokens``). The loss is over the
    selected tokens only, unshifted."""

    name = "mlm"

    def __init__(self, masking: Masking):
        self.masking = masking

    def split(self, batch: dict, epoch=None) -> dict:
        ids, labels = mask_tokens(batch["input_ids"], batch["labels"], batch["sample_ids"],
                                  self.masking, epoch)
        return {"input_ids": ids, "labels": labels}


# -- T5 span corruption ----------------------------------------------------------------------
# T5's pretraining objective (Raffel et al., and transformers' run_t5_mlm_flax.py, whose
# algorithm this follows draw for draw): ~noise density of a sample's tokens, in spans of
# mean length ``mean_span``, are cut from the encoder's input, each span replaced by one
# sentinel token; the decoder predicts the spans, each behind its sentinel. Written here
# because transformers ships it only inside that example script (and in Flax).


@dataclass(frozen=True)
class Spans:
    """What span corruption needs, settled on the driver (resolve_objective). A sample's
    lengths follow from its raw length (``lengths``), which resolve_block_size sets from
    --max_seq_length (``raw_length``)."""

    seed: int
    density: float  # --mlm_probability (run_t5_mlm_flax's name for it)
    mean_span: float  # --mean_noise_span_length
    sentinel_ids: tuple  # sentinel k (from 1) is sentinel_ids[k - 1]: <extra_id_{k-1}>
    eos_id: int
    pad_id: int
    start_id: int  # the decoder's start token

    def counts(self, length: int) -> tuple:
        """(noise tokens, noise spans) of a sample of ``length`` raw tokens."""
        noise = min(max(int(np.round(length * self.density)), 1), length - 1)
        return noise, max(int(np.round(noise / self.mean_span)), 1)

    def lengths(self, length: int) -> tuple:
        """(encoder input, target) lengths, EOS included, of ``length`` raw tokens."""
        noise, spans = self.counts(length)
        return length - noise + spans + 1, noise + spans + 1


def span_lengths(input_length: int, density: float, mean_span: float) -> tuple:
    """(raw tokens per sample, target length) that make an encoder input of exactly
    ``input_length`` tokens: the longest raw sample whose corrupted input still fits
    (run_t5_mlm_flax's compute_input_and_target_lengths)."""
    def lengths(tokens):
        noise = int(round(tokens * density))
        spans = int(round(noise / mean_span))
        return tokens - noise + spans + 1, noise + spans + 1

    tokens = input_length
    while lengths(tokens + 1)[0] <= input_length:
        tokens += 1
    inputs, targets = lengths(tokens)
    if density == 0.5 and targets > inputs:  # (theirs: keep targets at the round number)
        tokens, targets = tokens - 1, targets - 1
    return tokens, targets


def noise_mask(length: int, spans: Spans, rng: np.random.RandomState) -> np.ndarray:
    """Which of ``length`` tokens are noise: alternating non-noise and noise spans,
    non-noise first, every split into that many non-empty spans equally likely. Draws
    from ``rng`` exactly as T5's random_spans_noise_mask draws from numpy's global
    generator: one shuffle for the noise spans' lengths, then one for the others'."""
    noise, n_spans = spans.counts(length)

    def segment_lengths(items: int) -> np.ndarray:
        # n_spans - 1 cut points among the items - 1 gaps, chosen by a shuffle.
        cuts = np.arange(items - 1) < (n_spans - 1)
        rng.shuffle(cuts)
        return np.bincount(np.cumsum(np.concatenate([[False], cuts])))

    noise_lengths = segment_lengths(noise)  # (first: the order of the draws)
    interleaved = np.stack([segment_lengths(length - noise), noise_lengths], axis=1).reshape(-1)
    starts = np.zeros(length, dtype=np.int8)
    starts[np.cumsum(interleaved)[:-1]] = 1
    return np.cumsum(starts) % 2 == 1


def _fuse(tokens: np.ndarray, mask: np.ndarray, sentinel_ids: tuple, eos: int) -> np.ndarray:
    """``tokens`` with each run of masked positions replaced by the next sentinel, then
    EOS."""
    first = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each run
    out = tokens.copy()
    out[first] = np.asarray(sentinel_ids)[np.cumsum(first)[first] - 1]
    return np.concatenate([out[~mask | first], [eos]])


def corrupt_spans(input_ids, sample_ids, spans: Spans, epoch: Optional[int]) -> tuple:
    """(encoder input ids, labels) of a [B, T] batch of raw samples: each row's noise
    mask drawn from (seed, epoch, sample id) alone (``_sample_seed``), so a sample is
    corrupted the same way in every layout, resume and resize. Filler rows (negative
    ids) get pad inputs and no labels."""
    ids = input_ids.numpy()
    length = ids.shape[1]
    n_in, n_out = spans.lengths(length)
    inputs = np.full((len(ids), n_in), spans.pad_id, dtype=np.int64)
    labels = np.full((len(ids), n_out), IGNORE_INDEX, dtype=np.int64)
    for row, sid in enumerate(sample_ids.tolist()):
        if sid < 0:
            continue
        rng = np.random.RandomState(int(_sample_seed(spans.seed, epoch, sid)[0]))
        mask = noise_mask(length, spans, rng)
        inputs[row] = _fuse(ids[row], mask, spans.sentinel_ids, spans.eos_id)
        labels[row] = _fuse(ids[row], ~mask, spans.sentinel_ids, spans.eos_id)
    return torch.from_numpy(inputs), torch.from_numpy(labels)


class SpanCorruption(_PerPosition):
    """T5's span corruption on raylm's packed blocks (each block one raw sample, of the
    length ``raw_length`` gave the data): encoder input and labels from ``corrupt_spans``, decoder
    input the labels shifted right behind the start token (as T5's ``_shift_right``)."""

    name = "span_corruption"

    def __init__(self, spans: Spans):
        self.spans = spans

    def split(self, batch: dict, epoch=None) -> dict:
        inputs, labels = corrupt_spans(batch["input_ids"], batch["sample_ids"], self.spans,
                                       epoch)
        return {"input_ids": inputs, "labels": labels,
                "decoder_input_ids": shift_right(labels, self.spans.start_id,
                                                 self.spans.pad_id)}


def _local(loss):
    """Under tensor parallelism the logits are vocabulary-sharded DTensors and
    loss_parallel's cross-entropy is a replicated DTensor: every rank holds the whole
    value, so its local tensor is the loss (and stays differentiable)."""
    from torch.distributed.tensor import DTensor

    return loss.to_local() if isinstance(loss, DTensor) else loss


def is_seq2seq(config) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def has_masked_lm_head(config) -> bool:
    """An encoder with a masked-LM head in transformers (BERT, RoBERTa, DistilBERT,
    ALBERT, ...); encoder-decoders (BART) train as seq2seq, and a config built as a
    decoder (``is_decoder=True``, BERT's causal-LM use) attends causally."""
    return head_class(config, "mlm") is not None and not is_seq2seq(config)


def _seq2seq(config, masking=None) -> Seq2Seq:
    start = config.decoder_start_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return Seq2Seq(pad, start if start is not None else pad)


# -- image classification -------------------------------------------------------------------
@dataclass(frozen=True)
class Augment:
    """What image classification draws per sample, settled on the driver: the seed, and
    whether to flip images left-right at random in training (half of them, drawn per
    (seed, epoch, sample id), as ``torchvision.transforms.RandomHorizontalFlip``); the
    normalisation (``(x / 255 - mean) / std`` per channel, the image processor's)."""

    seed: int
    flip: bool = True
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)


def flips(sample_ids, augment: Augment, epoch) -> np.ndarray:
    """Which samples are flipped at ``epoch`` (None: evaluating, none): a function of
    (seed, epoch, sample id) only, so the same on every layout, resume and resize."""
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    if epoch is None or not augment.flip:
        return np.zeros(len(ids), dtype=bool)
    return np.array([i >= 0 and np.random.default_rng([augment.seed, epoch, int(i)]).random()
                     < 0.5 for i in ids], dtype=bool)


class ImageClassification:
    """One label per image (HF's run_image_classification): cross-entropy of the
    logits [B, K] against the labels, summed (a step divides by the global batch's
    images); a filler row's label is IGNORE_INDEX."""

    name = "image_classification"

    def __init__(self, augment: Augment):
        self.augment = augment

    def split(self, batch: dict, epoch=None) -> dict:
        pixels = batch["pixel_values"]
        flip = flips(batch["sample_ids"], self.augment, epoch)
        if flip.any():
            pixels = pixels.clone()
            rows = torch.from_numpy(flip)
            pixels[rows] = pixels[rows].flip(-1)
        c = pixels.shape[1]
        mean = torch.tensor(self.augment.mean[:c]).view(1, c, 1, 1)
        std = torch.tensor(self.augment.std[:c]).view(1, c, 1, 1)
        return {"pixel_values": (pixels.float() / 255.0 - mean) / std,
                "labels": batch["labels"]}

    def loss_sum(self, logits, labels):
        return _local(F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX,
                                      reduction="sum"))

    def count(self, labels) -> int:
        return int((labels != IGNORE_INDEX).sum())

    def correct(self, logits, labels) -> int:
        """Top-1 hits among the labelled rows."""
        return int(((logits.argmax(-1) == labels.to(logits.device))
                    & (labels.to(logits.device) != IGNORE_INDEX)).sum())


class Outputs(dict):
    """What ``compute_loss_func`` is given as the model's outputs (as the HF Trainer
    gives a ModelOutput): ``outputs.logits`` and ``outputs["logits"]`` both work."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class UserLoss:
    """An objective whose loss is the user's (``train(..., compute_loss_func=fn)``, the HF
    Trainer's name and signature): ``fn(outputs, labels, num_items_in_batch)`` returns the
    loss of a micro-batch divided by ``num_items_in_batch``, as the Trainer passes it
    (``outputs.logits``: the model's logits). The inputs,
    labels and label count stay the objective's (``base``). raylm asks for a micro-batch's
    sum, ``fn(outputs, labels, n) * n`` with n its own label count: exact for a loss of
    the Trainer's form (a sum over labels divided by n) and for a mean over the n labels
    alike, so a step's loss is the global batch's mean as for raylm's own losses."""

    def __init__(self, base, fn):
        self.base, self.fn = base, fn
        self.name = base.name

    def split(self, batch: dict, epoch=None) -> dict:
        return self.base.split(batch, epoch)

    def count(self, labels) -> int:
        return self.base.count(labels)

    def loss_sum(self, logits, labels):
        n = self.count(labels)
        if n == 0:  # a filler micro-batch: nothing to learn (a mean would be 0/0)
            return (logits.float() * 0).sum()
        return self.fn(Outputs(logits=logits), labels, n) * n

    def __getattr__(self, name):  # (e.g. image classification's ``correct``)
        if name in ("base", "fn"):
            raise AttributeError(name)
        return getattr(self.base, name)


def is_image_classifier(config) -> bool:
    if getattr(config, "is_image_classifier", False):  # a model of the user's own
        return True
    return is_head(config, "image_classification")


def _drawn(cls, kind):
    """The builder of an objective that draws per sample from ``kind`` facts."""
    def build(config, masking=None):
        if not isinstance(masking, kind):
            raise ValueError(f"the {cls.name} objective needs its {kind.__name__} "
                             "(raylm.models.objectives.resolve_objective)")
        return cls(masking)
    return build


# T5's own family: span corruption is its pretraining objective.
T5_TYPES = ("t5", "mt5", "umt5")

# name -> (builds the objective for a model config, which models it trains)
OBJECTIVES = {
    "causal": (lambda config, masking=None: CausalLM(), lambda config: not is_seq2seq(config)),
    "seq2seq": (_seq2seq, is_seq2seq),
    "mlm": (_drawn(MaskedLM, Masking), lambda config: has_masked_lm_head(config)
            and not getattr(config, "is_decoder", False)),
    "span_corruption": (_drawn(SpanCorruption, Spans), is_seq2seq),
    "image_classification": (_drawn(ImageClassification, Augment), is_image_classifier),
}

# Objectives whose labels are a sample of what the model reads: throughput counts the
# tokens read.
PREDICTS_A_SAMPLE = ("mlm", "span_corruption")


def default_objective(config) -> str:
    if is_image_classifier(config):
        return "image_classification"
    if is_seq2seq(config):
        return "span_corruption" if config.model_type in T5_TYPES else "seq2seq"
    if has_masked_lm_head(config) and not getattr(config, "is_decoder", False):
        return "mlm"
    return "causal"


def check_objective(config, name=None) -> str:
    """The objective a run uses: ``name`` (--objective), else the model's default. A
    one-line ConfigError for a name raylm does not know or a model it cannot train."""
    name = name or default_objective(config)
    text = [o for o in OBJECTIVES if o != "image_classification"]  # (--task's, not a flag's)
    if name not in OBJECTIVES or (name == "image_classification"
                                  and not is_image_classifier(config)):
        raise ConfigError(f"--objective {name}: choose one of {', '.join(text)}"
                          + (" (image classification is --task image-classification)"
                             if name == "image_classification" else ""))
    if not OBJECTIVES[name][1](config):
        if name == "mlm" and has_masked_lm_head(config):
            raise ConfigError(f"--mlm: the '{config.model_type}' config is built as a decoder "
                              "(is_decoder=True: causal attention); masked LM attends both "
                              "ways: drop is_decoder=True, or train it with --objective causal")
        if name == "mlm":
            raise ConfigError(f"--mlm: model type '{config.model_type}' has no masked-LM head "
                              "in transformers (masked LM trains encoders: bert, roberta, "
                              f"distilbert, albert, ...); its objective is "
                              f"{default_objective(config)} (drop --mlm)")
        kind = "an encoder-decoder" if is_seq2seq(config) else "a decoder-only"
        raise ConfigError(f"--objective {name} does not train {kind} model "
                          f"('{config.model_type}'); its objective is "
                          f"{default_objective(config)} (leave --objective unset)")
    return name


def objective_for(config, name=None, masking=None):
    """The objective object for ``config`` (``name``: --objective; None: the model's;
    ``masking``: what a drawing objective needs: masked LM's Masking, span corruption's
    Spans)."""
    return OBJECTIVES[check_objective(config, name)][0](config, masking)


def with_loss(objective, fn):
    """``objective`` with the user's loss (``UserLoss``), or as it is (``fn`` None)."""
    return objective if fn is None else UserLoss(objective, fn)


def resolve_objective(cfg, config, tokenizer, tokenizer_dir: str) -> tuple:
    """(objective name, Masking, Spans or None) of a run (a TrainConfig) on the driver:
    --mlm or --objective, else the model's; a drawing objective's facts from the flags and
    the tokenizer. One clear error for flags that disagree, a tokenizer with no mask token
    (run_mlm's collator refuses it too), with --whole_word_masking no marked word
    continuations, or for span corruption no sentinel tokens."""
    if cfg.mlm and cfg.objective not in (None, "mlm"):
        raise ConfigError(f"--mlm and --objective {cfg.objective} name two objectives: "
                          "give one")
    name = check_objective(config, "mlm" if cfg.mlm else cfg.objective)
    if cfg.whole_word_masking and name != "mlm":
        raise ConfigError(f"--whole_word_masking applies to masked LM, not to the "
                          f"{name} objective")
    if name not in PREDICTS_A_SAMPLE:
        return name, None
    if not 0.0 < cfg.mlm_probability < 1.0:
        raise ConfigError(f"--mlm_probability must be between 0 and 1 (got "
                          f"{cfg.mlm_probability})")
    if name == "span_corruption":
        return name, _spans(cfg, config, tokenizer, tokenizer_dir)
    if tokenizer.mask_token_id is None:
        raise ConfigError(f"masked LM needs a tokenizer with a mask token, and {tokenizer_dir} "
                          "has none: train one with `raylm tokenizer train --type wordpiece` "
                          "and give it with --tokenizer_name")
    continuation = None
    if cfg.whole_word_masking:
        continuation = tuple(sorted(i for t, i in tokenizer.get_vocab().items()
                                    if t.startswith("##")))
        if not continuation:
            raise ConfigError(f"--whole_word_masking: the tokenizer {tokenizer_dir} marks no "
                              "word continuations ('##' WordPiece tokens): use a WordPiece "
                              "tokenizer, or drop --whole_word_masking")
    return name, Masking(seed=cfg.seed, probability=float(cfg.mlm_probability),
                         mask_token_id=int(tokenizer.mask_token_id),
                         special_ids=tuple(sorted(set(tokenizer.all_special_ids))),
                         vocab_size=len(tokenizer), continuation_ids=continuation)


def _spans(cfg, config, tokenizer, tokenizer_dir: str) -> Spans:
    if cfg.line_by_line:
        raise ConfigError("span corruption cuts spans out of packed blocks: drop "
                          "--line_by_line (or train with --objective seq2seq)")
    if cfg.mean_noise_span_length < 1:
        raise ConfigError(f"--mean_noise_span_length must be >= 1 (got "
                          f"{cfg.mean_noise_span_length})")
    vocab = tokenizer.get_vocab()
    sentinels = []
    while f"<extra_id_{len(sentinels)}>" in vocab:
        sentinels.append(vocab[f"<extra_id_{len(sentinels)}>"])
    if not sentinels:
        raise ConfigError(f"span corruption needs T5's sentinel tokens (<extra_id_0>, ...), "
                          f"and the tokenizer {tokenizer_dir} has none: use a T5 tokenizer, "
                          "or train one with `raylm tokenizer train --extra_ids 100`")
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"span corruption ends inputs and targets with EOS, and the "
                          f"tokenizer {tokenizer_dir} has no eos token")
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    start = config.decoder_start_token_id
    return Spans(seed=cfg.seed, density=float(cfg.mlm_probability),
                 mean_span=float(cfg.mean_noise_span_length), sentinel_ids=tuple(sentinels),
                 eos_id=int(tokenizer.eos_token_id), pad_id=int(pad),
                 start_id=int(start if start is not None else pad))


def raw_length(spans: Spans, input_length: int) -> int:
    """The raw tokens of a sample that corrupts to an encoder input of ``input_length``
    tokens (--max_seq_length): the data's block size. A one-line error when that is too
    short to corrupt or the tokenizer has fewer sentinels than a sample has spans."""
    tokens, _ = span_lengths(input_length, spans.density, spans.mean_span)
    if tokens < 2 or spans.lengths(tokens)[0] != input_length:
        raise ConfigError(f"--max_seq_length {input_length} is too short for span corruption "
                          f"at noise density {spans.density} and mean span "
                          f"{spans.mean_span}: give a longer one")
    needed = spans.counts(tokens)[1]
    if needed > len(spans.sentinel_ids):
        raise ConfigError(f"span corruption of {tokens}-token samples cuts {needed} spans, "
                          f"but the tokenizer has {len(spans.sentinel_ids)} sentinel tokens: "
                          "use a shorter --max_seq_length or a tokenizer with more "
                          "(raylm tokenizer train --extra_ids N)")
    return tokens
