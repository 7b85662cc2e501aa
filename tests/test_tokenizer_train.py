"""Training tokenizers (raylm.data.tokenizer_train) and loading them back with AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from raylm.data.sources import builtin_sample_files
from raylm.data.tokenizer_train import train_tokenizer
from raylm.errors import ConfigError

TEXT = "Double, double toil and trouble; Fire burn, and cauldron bubble."


@pytest.fixture(scope="module")
def play():
    """One play of the built-in sample: enough text to learn a few hundred merges."""
    return [f for f in builtin_sample_files() if f.endswith("macbeth.txt")]


def test_bpe_round_trips_through_auto_tokenizer(tmp_path, play):
    out = train_tokenizer(play, str(tmp_path / "bpe"), type="bpe", vocab_size=600)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast and len(tok) == 600
    assert tok.eos_token == tok.bos_token == tok.unk_token == tok.pad_token == "<|endoftext|>"
    ids = tok(TEXT)["input_ids"]
    assert tok.eos_token_id not in ids  # no special tokens appended, as GPT-2
    assert len(ids) < 0.75 * len(TEXT.encode())  # merges were learnt (bytes alone: 64)
    assert tok.decode(ids) == TEXT
    # Byte level: any text, even characters never seen in training, survives.
    unseen = "naïve — 東京 🙂\n\ttabs"
    assert tok.decode(tok(unseen)["input_ids"]) == unseen


def test_wordpiece_round_trips_through_auto_tokenizer(tmp_path, play):
    out = train_tokenizer(play, str(tmp_path / "wp"), type="wordpiece", vocab_size=800,
                          min_frequency=1)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast and len(tok) == 800
    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    assert (tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token) == specials
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.unk_token_id not in ids
    decoded = tok.decode(ids, skip_special_tokens=True)
    # BERT-style decoding puts spaces around punctuation; the words and their case survive.
    assert decoded.replace(" ", "") == TEXT.replace(" ", "")
    pair = tok("Fair is foul", "foul is fair")
    assert pair["input_ids"].count(tok.sep_token_id) == 2
    assert set(pair["token_type_ids"]) == {0, 1}


def test_wordpiece_is_the_same_on_every_run(tmp_path, play):
    """The same files give the same tokenizer, byte for byte (tokenizers' own
    WordPieceTrainer numbers its ``##`` tokens in hash order: another vocabulary on almost
    every run), and the vocabulary is the one that trainer learns up to its ties."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    saved = []
    for run in range(3):
        out = train_tokenizer(play, str(tmp_path / f"wp{run}"), type="wordpiece",
                              vocab_size=800, lowercase=True)
        with open(f"{out}/tokenizer.json", "rb") as f:
            saved.append(f.read())
    assert saved[0] == saved[1] == saved[2]
    ours = set(json.loads(saved[0])["model"]["vocab"])
    theirs = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    theirs.normalizer = normalizers.BertNormalizer(lowercase=True)
    theirs.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    theirs.train(play, trainers.WordPieceTrainer(
        vocab_size=800, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        continuing_subword_prefix="##", show_progress=False))
    assert len(ours & set(theirs.get_vocab())) >= 0.98 * 800


def test_wordpiece_lowercase_is_bert_uncased(tmp_path, play):
    """--lowercase: the normalizer lowercases and strips accents before WordPiece, as
    bert-base-uncased's does; the vocabulary has no capitals."""
    out = train_tokenizer(play, str(tmp_path / "uncased"), type="wordpiece", vocab_size=800,
                          min_frequency=1, lowercase=True)
    tok = AutoTokenizer.from_pretrained(out)
    assert not any(t != t.lower() for t in tok.get_vocab() if not t.startswith("["))
    assert tok("FAIR is Foul")["input_ids"] == tok("fair is foul")["input_ids"]
    assert tok("naïve")["input_ids"] == tok("naive")["input_ids"]
    assert tok.decode(tok("Fair IS foul")["input_ids"], skip_special_tokens=True) == \
        "fair is foul"
    with pytest.raises(ConfigError, match="--lowercase applies to --type wordpiece"):
        train_tokenizer(play, str(tmp_path / "bpe"), type="bpe", lowercase=True)


def test_extra_ids_are_t5s_sentinels(tmp_path, play):
    """--extra_ids N: <extra_id_0> ... <extra_id_N-1> as T5's tokenizer has them: special,
    at the top of the vocabulary, <extra_id_0> the highest id."""
    out = train_tokenizer(play, str(tmp_path / "t5"), vocab_size=400, extra_ids=5)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 405
    ids = [tok.convert_tokens_to_ids(f"<extra_id_{i}>") for i in range(5)]
    assert ids == [404, 403, 402, 401, 400]
    assert set(ids) <= set(tok.all_special_ids)
    assert tok("a <extra_id_3> b")["input_ids"].count(401) == 1  # one token, never split


def test_trains_from_a_table_column(tmp_path):
    rows = [{"id": i, "body": f"line {i} of the witches' song", "label": "x"} for i in range(50)]
    path = tmp_path / "songs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = train_tokenizer([str(path)], str(tmp_path / "tok"), vocab_size=300,
                          text_column="body")
    tok = AutoTokenizer.from_pretrained(out)
    assert "witches" in "".join(tok.convert_ids_to_tokens(tok("the witches")["input_ids"]))


@pytest.mark.parametrize("kwargs,message", [
    ({"type": "unigram"}, "unknown tokenizer type 'unigram'"),
    ({"vocab_size": 100}, "--vocab_size: must be an integer >= 257 for a bpe tokenizer"),
    ({"type": "wordpiece", "vocab_size": 3}, "must be an integer >= 6 for a wordpiece"),
    ({"min_frequency": 0}, "--min_frequency: must be an integer >= 1"),
])
def test_bad_settings_are_config_errors(tmp_path, play, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        train_tokenizer(play, str(tmp_path / "tok"), **kwargs)
    assert not (tmp_path / "tok").exists()


def test_no_text_is_a_config_error(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n \n")
    with pytest.raises(ConfigError, match="contain no text"):
        train_tokenizer([str(path)], str(tmp_path / "tok"))
