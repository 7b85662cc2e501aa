"""Train a tokenizer from scratch on raylm's data sources.

The result is saved by ``transformers`` (``save_pretrained``), so ``AutoTokenizer`` and
``--tokenizer_name`` load it like any Hugging Face tokenizer. Texts are read exactly as
training reads them (``sources.iter_texts``): lines of .txt files, rows of the text column.
"""

from __future__ import annotations

from typing import Iterator, Optional

from raylm.data.sources import iter_texts
from raylm.errors import ConfigError

TOKENIZER_TYPES = ("bpe", "wordpiece")

# GPT-2's single special token, used as bos, eos, unk and pad.
BPE_SPECIAL = "<|endoftext|>"
WORDPIECE_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                      "sep_token": "[SEP]", "mask_token": "[MASK]"}


def train_tokenizer(files: list[str], output_dir: str, *, type: str = "bpe",
                    vocab_size: int = 8192, min_frequency: int = 2,
                    text_column: Optional[str] = None, lowercase: bool = False,
                    extra_ids: int = 0) -> str:
    """Train a ``bpe`` (byte-level, GPT-2 style) or ``wordpiece`` (BERT style; cased, or
    with ``lowercase`` uncased as bert-base-uncased: lowercased, accents stripped)
    tokenizer. ``extra_ids``: T5's sentinel tokens ``<extra_id_0>`` ... for span
    corruption, appended as T5's tokenizer has them (``<extra_id_0>`` the highest id).
    Returns ``output_dir``.
    """
    from transformers import PreTrainedTokenizerFast  # imported late: only this command needs it

    if type not in TOKENIZER_TYPES:
        raise ConfigError(f"--type: unknown tokenizer type '{type}' "
                          f"(choose from: {', '.join(TOKENIZER_TYPES)})")
    # A byte-level BPE starts from the 256 byte symbols plus its special token.
    minimum = 257 if type == "bpe" else len(WORDPIECE_SPECIALS) + 1
    if not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ConfigError(f"--vocab_size: must be an integer >= {minimum} for a {type} "
                          f"tokenizer, got {vocab_size!r}")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ConfigError(f"--min_frequency: must be an integer >= 1, got {min_frequency!r}")
    if not files:
        raise ConfigError("no training files for the tokenizer")
    if not isinstance(extra_ids, int) or extra_ids < 0:
        raise ConfigError(f"--extra_ids: must be an integer >= 0, got {extra_ids!r}")
    if lowercase and type != "wordpiece":
        raise ConfigError("--lowercase applies to --type wordpiece (a byte-level BPE keeps "
                          "every byte as it is)")

    seen = {"texts": 0}  # counted while the trainer consumes the texts (one pass over the files)
    if type == "bpe":
        tokenizer, trainer, wrapper_kwargs = _bpe(vocab_size, min_frequency)
        tokenizer.train_from_iterator(_texts(files, text_column, seen), trainer=trainer)
    else:
        tokenizer, wrapper_kwargs = _wordpiece(files, text_column, seen, vocab_size,
                                               min_frequency, lowercase)
    if not seen["texts"]:
        raise ConfigError(f"the tokenizer training files contain no text: {', '.join(files)}")

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **wrapper_kwargs)
    if extra_ids:
        wrapped.add_special_tokens({"additional_special_tokens": [
            f"<extra_id_{i}>" for i in reversed(range(extra_ids))]})
    wrapped.save_pretrained(output_dir)
    return output_dir


def _texts(files: list[str], text_column: Optional[str], seen: dict) -> Iterator[list[str]]:
    # Batches of texts: the trainer accepts an iterator of lists and counts words in Rust.
    for path in files:
        for texts in iter_texts(path, text_column, flag="--train_file"):
            texts = [t for t in texts if t and not t.isspace()]
            seen["texts"] += len(texts)
            if texts:
                yield texts


def _bpe(vocab_size: int, min_frequency: int):
    """GPT-2's recipe: byte-level pre-tokenization (no unknown characters), BPE merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Keeps offsets right; adds no tokens (GPT-2 appends no bos/eos when encoding).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BPE_SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    specials = {"bos_token": BPE_SPECIAL, "eos_token": BPE_SPECIAL,
                "unk_token": BPE_SPECIAL, "pad_token": BPE_SPECIAL}
    return tokenizer, trainer, specials


def _wordpiece(files: list[str], text_column: Optional[str], seen: dict, vocab_size: int,
               min_frequency: int, lowercase: bool = False):
    """BERT's recipe: BERT normalizer (uncased: lowercase, accents stripped, as
    BertTokenizerFast's defaults) and pre-tokenizer, WordPiece with ``##`` continuations,
    and ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` added on encoding. The same files give
    the same vocabulary, id for id, on every run (see ``_continuations``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    specials = list(WORDPIECE_SPECIALS.values())

    def pipeline(model):
        tokenizer = Tokenizer(model)
        # strip_accents unset follows lowercase, as in BERT's own tokenizers.
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return tokenizer

    unk = WORDPIECE_SPECIALS["unk_token"]
    tokenizer = pipeline(models.WordPiece(unk_token=unk))
    continuations = _continuations(files, text_column, tokenizer)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency,
        special_tokens=specials + continuations, continuing_subword_prefix="##",
        show_progress=False)
    tokenizer.train_from_iterator(_texts(files, text_column, seen), trainer=trainer)

    # Rebuilt from the learnt vocabulary with only BERT's specials special, and in BERT's
    # order: the specials, the characters, their continuations, then the merges as learnt.
    learnt = tokenizer.get_vocab()
    order = sorted(learnt, key=learnt.get)
    given = set(specials) | set(continuations)
    ranked = (specials + sorted(t for t in order if len(t) == 1 and t not in given)
              + [t for t in continuations if t in learnt]
              + [t for t in order if t not in given and len(t) > 1])
    tokenizer = pipeline(models.WordPiece({t: i for i, t in enumerate(ranked)}, unk_token=unk,
                                          continuing_subword_prefix="##"))
    tokenizer.add_special_tokens(specials)
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    # The special tokens come first in the vocabulary, in this order: their ids are known
    # before training, which the post-processor needs.
    cls_id, sep_id = specials.index("[CLS]"), specials.index("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    # As BERT's tokenizer, it returns token_type_ids (0 for A, 1 for B).
    return tokenizer, dict(
        WORDPIECE_SPECIALS, model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        do_lower_case=lowercase)


def _continuations(files: list[str], text_column: Optional[str], tokenizer) -> list[str]:
    """``##c`` for every character c that can continue a word after normalization, sorted.

    Written here because tokenizers' WordPieceTrainer (0.23) numbers the ``##c`` tokens in
    the iteration order of a randomly seeded hash map, and breaks ties between merges of
    equal count by those numbers: the same corpus gave another vocabulary on about every
    other run (huggingface/tokenizers#1794, fix proposed in #2066). Handed to the trainer
    first, as special tokens, they have fixed numbers, so its ties, and the vocabulary, are
    the same on every run. One extra pass over the files collects the characters: a set of
    the raw characters, each then normalized on its own and after a letter (lowercasing's
    one context rule, a final sigma), and those the pre-tokenizer keeps inside a word."""
    raw: set = set()
    for path in files:
        for texts in iter_texts(path, text_column, flag="--train_file"):
            for text in texts:
                raw.update(text)
    normalize = tokenizer.normalizer.normalize_str
    chars = set()
    for c in raw:
        chars.update(normalize(c))
        chars.update(normalize("a" + c)[1:])
    # A character the pre-tokenizer splits off (whitespace, punctuation) never continues one.
    split = tokenizer.pre_tokenizer.pre_tokenize_str
    inside = (c for c in chars if [w for w, _ in split("a" + c)] == ["a" + c])
    return ["##" + c for c in sorted(inside)]
