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

    if type == "bpe":
        tokenizer, trainer, wrapper_kwargs = _bpe(vocab_size, min_frequency)
    else:
        tokenizer, trainer, wrapper_kwargs = _wordpiece(vocab_size, min_frequency, lowercase)
    seen = {"texts": 0}  # counted while the trainer consumes the texts (one pass over the files)
    tokenizer.train_from_iterator(_texts(files, text_column, seen), trainer=trainer)
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


def _wordpiece(vocab_size: int, min_frequency: int, lowercase: bool = False):
    """BERT's recipe: BERT normalizer (uncased: lowercase, accents stripped, as
    BertTokenizerFast's defaults) and pre-tokenizer, WordPiece with ``##`` continuations,
    and ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` added on encoding."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    specials = list(WORDPIECE_SPECIALS.values())
    tokenizer = Tokenizer(models.WordPiece(unk_token=WORDPIECE_SPECIALS["unk_token"]))
    # strip_accents unset follows lowercase, as in BERT's own tokenizers.
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
        continuing_subword_prefix="##", show_progress=False)
    # The special tokens come first in the vocabulary, in this order: their ids are known
    # before training, which the post-processor needs.
    cls_id, sep_id = specials.index("[CLS]"), specials.index("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    # As BERT's tokenizer, it returns token_type_ids (0 for A, 1 for B).
    return tokenizer, trainer, dict(
        WORDPIECE_SPECIALS, model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        do_lower_case=lowercase)
