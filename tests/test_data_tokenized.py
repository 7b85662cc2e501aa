"""Tokenizing into the parquet cache with Ray Data, and reading samples back by id.

Expected samples are computed here, independently of raylm, with the tokenizer alone:
tokenize each text, concatenate per file, cut block_size chunks, drop the remainder
(or, line by line: one padded sample per non-empty text).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from raylm.data.reader import IGNORE_INDEX, PAD_ID, BlockReader, Prefetcher
from raylm.data.sources import builtin_tokenizer_dir, resolve_files
from raylm.data.tokenized import (
    CACHE_PREFIX,
    STALE_TMP_S,
    TMP_PREFIX,
    TokenizedDataset,
    build_tokenized_dataset,
    interrupts_deferred,
    load_tokenizer,
    tokenize_file,
    tokenizer_digest,
)
from raylm.errors import ConfigError

BLOCK = 8
TOKENIZER = builtin_tokenizer_dir()

# Texts of different lengths: each file gives a few blocks and a remainder to drop.
TEXTS = {
    "a": ["When shall we three meet again", "", "In thunder, lightning, or in rain?",
          "When the hurlyburly's done, ünïcödé ✓"],
    "b": ["Fair is foul, and foul is fair:", "   ", "Hover through the fog and filthy air."],
    "c": ["What bloody man is that? He can report,", "As seemeth by his plight, of the revolt",
          "The newest state."],
}


@pytest.fixture(scope="module")
def ray_local():
    """Ray for this module: 2 CPUs, stopped at the end (or a cluster already up, shared)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def expected_blocks(tok, texts_per_file, block_size=BLOCK):
    out = []
    for texts in texts_per_file:
        ids = [i for t in texts for i in tok(t)["input_ids"]]
        out += [ids[k:k + block_size] for k in range(0, len(ids) - block_size + 1, block_size)]
    return np.array(out, dtype=np.int64).reshape(-1, block_size)


def as_read(texts):
    """A text file's lines as run_clm's loader reads them: each with its line break."""
    return [t + "\n" for t in texts]


def expected_line_by_line(tok, texts_per_file, block_size=BLOCK, rows_of_ids=False):
    rows, lengths = [], []
    for texts in texts_per_file:
        for t in texts:
            if (tok(t)["input_ids"] if rows_of_ids else t.strip()):
                ids = tok(t)["input_ids"][:block_size]
                lengths.append(len(ids))
                rows.append(ids + [tok.pad_token_id] * (block_size - len(ids)))
    return np.array(rows, dtype=np.int64), np.array(lengths)


def all_samples(ds: TokenizedDataset) -> dict:
    return BlockReader(ds).read(np.arange(ds.num_samples))


def build(files, cache_root, **kw) -> TokenizedDataset:
    return build_tokenized_dataset(files, TOKENIZER, kw.pop("block_size", BLOCK),
                                   cache_root=str(cache_root), **kw)


def write_txt(path, texts, newline="\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(newline.join(texts).encode("utf-8") + newline.encode())
    return str(path)


# --- every input format gives the exact expected blocks ------------------------------------

TXT_FORMATS = ("txt", "dir", "glob", "uri")


def write_format(tmp_path, fmt: str, tok=None) -> tuple[list[str], list[list[str]], dict]:
    """Files of format `fmt` holding TEXTS (-ids: their token ids by ``tok``); returns
    (specs, texts per file in order, kwargs)."""
    d = tmp_path / "data"
    d.mkdir()
    kwargs = {}
    if fmt in TXT_FORMATS:
        # b.txt uses Windows line ends; lines become texts either way.
        paths = [write_txt(d / f"{k}.txt", v, "\r\n" if k == "b" else "\n")
                 for k, v in TEXTS.items()]
        specs = {"txt": paths, "dir": [str(d)], "glob": [str(d / "[ab].txt"), str(d / "c.*")],
                 "uri": [f"file://{p}" for p in paths]}[fmt]
        with open(paths[1], encoding="utf-8") as f:  # what a text loader sees
            texts = [TEXTS["a"], f.read().splitlines(), TEXTS["c"]]
        return specs, texts, kwargs
    for name, texts in TEXTS.items():
        if fmt in ("jsonl", "json"):
            with open(d / f"{name}.{fmt}", "w") as f:
                for i, t in enumerate(texts):
                    f.write(json.dumps({"id": i, "text": t, "meta": {"n": len(t)}}) + "\n")
        elif fmt == "csv":
            # The text is one column among others; values with commas, quotes and newlines.
            kwargs = {"text_column": "body"}
            with open(d / f"{name}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["id", "body", "label"])
                w.writerows([i, t, "x"] for i, t in enumerate(texts))
        elif fmt == "parquet":
            pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}),
                           d / f"{name}.parquet")
        elif fmt == "parquet-ids":  # rows tokenized already (no text column)
            ids = [tok(t)["input_ids"] for t in texts]
            pq.write_table(pa.table({"id": list(range(len(texts))), "input_ids": ids}),
                           d / f"{name}.parquet")
        elif fmt == "jsonl-ids":
            with open(d / f"{name}.jsonl", "w") as f:
                for i, t in enumerate(texts):
                    f.write(json.dumps({"input_ids": tok(t)["input_ids"], "n": i}) + "\n")
    return [str(d)], list(TEXTS.values()), kwargs


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "json", "csv", "parquet", "dir", "glob", "uri",
                                 "parquet-ids", "jsonl-ids"])
def test_each_format_gives_the_expected_blocks(ray_local, tok, tmp_path, fmt):
    specs, texts, kwargs = write_format(tmp_path, fmt, tok)
    files = resolve_files(specs)
    assert len(files) == 3
    ds = build(files, tmp_path / "cache", **kwargs)
    if fmt in TXT_FORMATS:  # lines keep their breaks (--keep_linebreaks, run_clm's default)
        texts = [as_read(t) for t in texts]
    want = expected_blocks(tok, texts)
    assert ds.num_samples == len(want) > 3
    got = all_samples(ds)
    assert torch.equal(got["input_ids"], torch.from_numpy(want))
    assert torch.equal(got["labels"], got["input_ids"])
    assert bool(got["attention_mask"].all())
    # One shard per file here, in file order; offsets are the running sample counts.
    per_file = [len(expected_blocks(tok, [t])) for t in texts]
    assert ds.shard_offsets == [0, per_file[0], per_file[0] + per_file[1]]


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet-ids"])
def test_line_by_line_pads_and_truncates_each_text(ray_local, tok, tmp_path, fmt):
    specs, texts, kwargs = write_format(tmp_path, fmt, tok)
    ds = build(resolve_files(specs), tmp_path / "cache", line_by_line=True, **kwargs)
    ids = fmt.endswith("-ids")
    want, lengths = expected_line_by_line(tok, texts, rows_of_ids=ids)
    assert ds.line_by_line and ds.pad_token_id == tok.eos_token_id
    # Empty and blank lines are not samples; a row of token ids is unless it has none
    # (a blank line's spaces are tokens).
    assert ds.num_samples == len(want) == (9 if ids else 8)
    assert lengths.min() < BLOCK and lengths.max() == BLOCK  # some padded, some truncated
    got = BlockReader(ds).read(np.arange(ds.num_samples))
    assert torch.equal(got["input_ids"], torch.from_numpy(want))
    mask = torch.arange(BLOCK)[None, :] < torch.from_numpy(lengths)[:, None]
    assert torch.equal(got["attention_mask"], mask.long())
    assert torch.equal(got["labels"], torch.where(mask, got["input_ids"], -100))


def test_line_by_line_blocks_of_mostly_padding_are_warned_of(ray_local, tmp_path):
    """Lines of a few tokens in blocks of 64: the median sample is under a quarter of the
    block, which degenerate() warns of with the numbers; blocks of 8 are not."""
    from raylm.config import TrainConfig
    from raylm.runtime.inputs import Data
    from raylm.runtime.prepare import degenerate

    files = [write_txt(tmp_path / "data" / "a.txt", TEXTS["a"] + TEXTS["b"] + TEXTS["c"])]
    for block, warned in ((64, True), (8, False)):
        ds = build(files, tmp_path / "cache", line_by_line=True, block_size=block)
        median = int(np.median(all_samples(ds)["attention_mask"].sum(1).numpy()))
        data = Data(train=ds, eval=None, train_ids=np.arange(ds.num_samples))
        got = [w for w in degenerate(TrainConfig(max_steps=1), data, 2, 1)
               if w.startswith("--line_by_line")]
        assert got == ([f"--line_by_line: half the training samples hold {median} token(s) "
                        f"or fewer of --block_size {block}; the rest of each block is "
                        "padding, computed and thrown away: lower --block_size"]
                       if warned else []), got


@pytest.mark.parametrize("fmt", ["parquet-ids", "jsonl-ids"])
def test_rows_of_token_ids_are_checked_as_files_and_train_no_tokenizer(tok, tmp_path, fmt):
    """Files of token ids pass the checks a run makes before it starts (their rows
    counted); a tokenizer cannot be trained on them (one error naming the column)."""
    from raylm.data.sources import iter_texts, validate_files

    files = resolve_files(write_format(tmp_path, fmt, tok)[0])
    validate_files(files, None)
    with pytest.raises(ConfigError, match="column 'input_ids' holds token ids, not text: "
                                          "give the tokenizer they come from"):
        next(iter_texts(files[0]))


def test_an_id_outside_the_vocabulary_names_the_file_s_row(tok, tmp_path):
    """In a piece of a parquet file (row groups 1-2 of 2 rows each), the file's row."""
    rows = [tok(t)["input_ids"] for t in TEXTS["a"] + TEXTS["c"]]
    rows[3] = rows[3][:1] + [len(tok)]
    path = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"input_ids": rows}), path, row_group_size=2)
    with pytest.raises(ConfigError, match=rf"ids.parquet: row 3 of column 'input_ids' holds "
                                          rf"token id {len(tok)}, outside the tokenizer's "
                                          rf"vocabulary of {len(tok)}"):
        list(tokenize_file(path, tok, BLOCK, False, None, 0, piece=(1, 3)))


def test_chunked_reading_does_not_change_the_samples(tok, tmp_path):
    # A file read in tiny chunks (lines and UTF-8 characters cut at chunk boundaries) gives
    # the same samples as read whole.
    path = write_txt(tmp_path / "a.txt", TEXTS["a"] * 5)
    def samples(chunk_bytes):
        return np.concatenate([b for b, _ in tokenize_file(
            path, tok, BLOCK, False, None, tok.pad_token_id, chunk_bytes=chunk_bytes)])
    whole = samples(1 << 20)
    np.testing.assert_array_equal(whole, expected_blocks(tok, [TEXTS["a"] * 5]))
    for chunk_bytes in (1, 3, 17):
        np.testing.assert_array_equal(samples(chunk_bytes), whole)


# --- determinism and the cache -------------------------------------------------------------

@pytest.fixture
def three_files(tmp_path):
    return [write_txt(tmp_path / "data" / f"{k}.txt", v) for k, v in TEXTS.items()]


def test_same_inputs_give_the_same_samples_whatever_the_parallelism(ray_local, tmp_path,
                                                                     three_files):
    one = build(three_files, tmp_path / "c1", num_workers=1)
    two = build(three_files, tmp_path / "c2", num_workers=3)
    assert not one.reused and not two.reused
    assert one.num_samples == two.num_samples
    assert one.shard_offsets == two.shard_offsets
    assert [os.path.basename(f) for f in one.shard_files] == [
        os.path.basename(f) for f in two.shard_files]
    assert torch.equal(all_samples(one)["input_ids"], all_samples(two)["input_ids"])


def snapshot(cache_root):
    """Every file under the cache root with its inode and mtime."""
    out = {}
    for dirpath, _, names in os.walk(cache_root):
        for n in names:
            st = os.stat(os.path.join(dirpath, n))
            out[os.path.join(dirpath, n)] = (st.st_ino, st.st_mtime_ns)
    return out


def test_second_build_reuses_the_cache_without_tokenizing(ray_local, tmp_path, three_files):
    root = tmp_path / "cache"
    first = build(three_files, root)
    assert not first.reused
    assert os.listdir(root) == [os.path.basename(first.cache_dir)]
    before = snapshot(root)

    again = build(three_files, root)
    assert again.reused
    assert again.cache_dir == first.cache_dir
    assert again.shard_files == first.shard_files
    # Nothing was written: same files, same inodes and mtimes, no new directory.
    assert snapshot(root) == before
    assert os.listdir(root) == [os.path.basename(first.cache_dir)]

    # Other settings are other caches.
    assert not build(three_files, root, block_size=4).reused
    assert len(os.listdir(root)) == 2


def test_a_model_directory_s_tokenizer_is_known_by_its_own_files(tmp_path):
    """A tokenizer loaded from a model directory is identified by the files AutoTokenizer
    reads: the weights and checkpoints there are not read, and a new checkpoint is not a
    new cache; a changed vocabulary is."""
    model_dir = tmp_path / "model"
    shutil.copytree(TOKENIZER, model_dir)
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    digest = tokenizer_digest(str(model_dir))
    (model_dir / "model.safetensors").write_bytes(b"weights")
    (model_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (model_dir / "checkpoints" / "step-00000002" / "model.safetensors").write_bytes(b"w")
    (model_dir / "metrics.jsonl").write_text("{}\n")
    assert tokenizer_digest(str(model_dir)) == digest
    (model_dir / "merges.txt").write_text("a b\n")
    merged = tokenizer_digest(str(model_dir))
    assert merged != digest
    (model_dir / "config.json").write_text('{"model_type": "bert"}')
    assert tokenizer_digest(str(model_dir)) not in (digest, merged)


def test_changed_input_gives_a_new_cache(ray_local, tok, tmp_path, three_files):
    root = tmp_path / "cache"
    first = build(three_files, root)

    # Same content, new mtime: a new cache (a file's identity is path, size and mtime).
    st = os.stat(three_files[0])
    os.utime(three_files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = build(three_files, root)
    assert not touched.reused and touched.cache_dir != first.cache_dir

    # New content: a new cache with the new samples.
    texts = dict(TEXTS, a=TEXTS["a"] + ["Upon the heath."])
    write_txt(tmp_path / "data" / "a.txt", texts["a"])
    changed = build(three_files, root)
    assert not changed.reused and changed.cache_dir not in (first.cache_dir, touched.cache_dir)
    assert torch.equal(all_samples(changed)["input_ids"],
                       torch.from_numpy(expected_blocks(tok, [as_read(t) for t in
                                                              texts.values()])))


def test_leftover_temporary_directory_is_never_used(ray_local, tok, tmp_path, three_files):
    root = tmp_path / "cache"
    good = build(three_files, root)
    key = os.path.basename(good.cache_dir)[len(CACHE_PREFIX):]
    # What a build killed just before its final rename leaves: a complete-looking directory
    # (manifest included) under the temporary name. Make its samples wrong, so using it
    # would show.
    leftover = root / f"{TMP_PREFIX}{key}-crashed"
    os.rename(good.cache_dir, leftover)
    for shard in leftover.glob("*.parquet"):
        t = pq.read_table(shard)
        zeros = pa.array([[0] * BLOCK] * t.num_rows, pa.list_(pa.int32()))
        pq.write_table(t.set_column(0, "input_ids", zeros), shard)

    rebuilt = build(three_files, root)
    assert not rebuilt.reused
    assert rebuilt.cache_dir == good.cache_dir
    assert torch.equal(all_samples(rebuilt)["input_ids"],
                       torch.from_numpy(expected_blocks(tok, [as_read(t) for t in TEXTS.values()])))
    assert leftover.exists()  # maybe a build still running: not ours to delete or read

    # Idle for longer than any build runs (nothing in it written since): left by a crash,
    # and cleared by the next build.
    stale_time = time.time() - STALE_TMP_S - 60
    for path in [*leftover.rglob("*"), leftover]:
        os.utime(path, (stale_time, stale_time))
    shutil.rmtree(good.cache_dir)
    build(three_files, root)
    assert not leftover.exists()


def test_failed_build_leaves_no_cache(ray_local, tmp_path, three_files):
    # Files are not validated here: the error comes from a tokenization task, mid-build,
    # and still reaches the caller as one ConfigError line.
    bad = tmp_path / "data" / "d.txt"
    bad.write_bytes(b"fine line\nbad \xff byte\n")
    root = tmp_path / "cache"
    with pytest.raises(ConfigError) as e:
        build(three_files + [str(bad)], root)
    assert str(e.value) == f"{bad} is not valid UTF-8: invalid byte at offset 14"
    assert os.listdir(root) == []


def test_corpus_shorter_than_one_block_is_an_error(ray_local, tmp_path, three_files):
    with pytest.raises(ConfigError, match="yields no samples: every file is shorter than one "
                                          "block of 1024 tokens; use a smaller --block_size "
                                          "or --line_by_line"):
        build(three_files, tmp_path / "cache", block_size=1024)
    assert os.listdir(tmp_path / "cache") == []


def test_bad_block_size_is_an_error(tmp_path, three_files):
    with pytest.raises(ConfigError, match="--block_size: must be a positive integer"):
        build(three_files, tmp_path / "cache", block_size=0)


def test_load_reads_the_manifest(ray_local, tmp_path, three_files):
    ds = build(three_files, tmp_path / "cache")
    loaded = TokenizedDataset.load(ds.cache_dir)
    assert loaded == ds  # reused=False on both: built now, loaded plainly
    with pytest.raises(ConfigError, match="not a raylm token cache"):
        TokenizedDataset.load(str(tmp_path))


# --- reading by id -------------------------------------------------------------------------

def test_reader_returns_rows_in_the_order_asked_across_shards(ray_local, tok, tmp_path,
                                                              three_files):
    ds = build(three_files, tmp_path / "cache")
    assert len(ds.shard_files) == 3
    want = expected_blocks(tok, [as_read(t) for t in TEXTS.values()])
    reader = BlockReader(ds)
    rng = np.random.default_rng(0)
    for ids in (rng.permutation(ds.num_samples), [ds.num_samples - 1, 0, 5, 5, 2],
                np.array([ds.shard_offsets[2], ds.shard_offsets[1] - 1])):
        got = reader.read(ids)
        assert got["input_ids"].dtype == torch.long
        assert torch.equal(got["input_ids"], torch.from_numpy(want[np.asarray(ids)]))
        assert got["sample_ids"].tolist() == list(ids)  # for objectives that draw per sample
    filler = reader.read([PAD_ID, 1])
    assert filler["sample_ids"].tolist() == [PAD_ID, 1]
    assert (filler["labels"][0] == IGNORE_INDEX).all()
    empty = reader.read([])
    assert {k: tuple(v.shape) for k, v in empty.items()} == {
        "input_ids": (0, BLOCK), "labels": (0, BLOCK), "attention_mask": (0, BLOCK),
        "sample_ids": (0,)}
    with pytest.raises(IndexError, match="out of range"):
        reader.read([ds.num_samples])


def test_prefetcher_returns_what_a_direct_read_returns(ray_local, tmp_path, three_files):
    ds = build(three_files, tmp_path / "cache")
    reader = BlockReader(ds)
    step0, step1 = [[0, 3], [7, 1]], [[2], [4, 5]]
    with Prefetcher(reader, depth=2) as pf:
        pf.submit(0, step0)
        pf.submit(1, step1)
        for key, ids in ((0, step0), (1, step1), (2, [[6]]),  # 2: never submitted
                         (1, [[1, 2]])):                      # 1 again, other ids
            got = pf.get(key, ids)
            assert len(got) == len(ids)
            for mb, mb_ids in zip(got, ids):
                assert torch.equal(mb["input_ids"], reader.read(mb_ids)["input_ids"])
        pf.submit(3, [[0]])
        pf.submit(4, [[1]])
        pf.submit(5, [[2]])  # depth 2: drops the read for key 3
        assert torch.equal(pf.get(3, [[0]])[0]["input_ids"], reader.read([0])["input_ids"])
    # prepare(key, batch) runs in the prefetch thread on submitted reads only.
    seen = []
    with Prefetcher(reader, prepare=lambda key, b: seen.append((key, b["sample_ids"].tolist()))
                    ) as pf:
        pf.submit(7, step0)
        pf.get(7, step0)
        pf.get(8, step1)  # read now: not prepared
    assert seen == [(7, [0, 3]), (7, [7, 1])]


def test_cache_dir_can_be_moved(ray_local, tmp_path, three_files):
    ds = build(three_files, tmp_path / "cache")
    moved = shutil.copytree(ds.cache_dir, tmp_path / "elsewhere")
    again = TokenizedDataset.load(str(moved))
    assert all(f.startswith(str(moved)) for f in again.shard_files)
    assert torch.equal(all_samples(again)["input_ids"], all_samples(ds)["input_ids"])


def test_unloadable_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_keep_linebreaks_false_joins_the_lines_without_breaks(ray_local, tok, tmp_path,
                                                              three_files):
    kept = build(three_files, tmp_path / "cache")
    joined = build(three_files, tmp_path / "cache", keep_linebreaks=False)
    assert joined.cache_dir != kept.cache_dir  # another cache
    assert torch.equal(all_samples(joined)["input_ids"],
                       torch.from_numpy(expected_blocks(tok, list(TEXTS.values()))))
    assert not torch.equal(all_samples(kept)["input_ids"][:3],
                           all_samples(joined)["input_ids"][:3])


def test_overwrite_cache_tokenizes_again_and_replaces_the_build(ray_local, tmp_path,
                                                                three_files):
    root = tmp_path / "cache"
    first = build(three_files, root)
    manifest = os.path.join(first.cache_dir, "manifest.json")
    before = os.stat(manifest).st_ino
    again = build(three_files, root, overwrite=True)
    assert not again.reused and again.cache_dir == first.cache_dir
    assert os.stat(manifest).st_ino != before  # a new build took the old one's place
    assert os.listdir(root) == [os.path.basename(first.cache_dir)]  # nothing left over
    assert torch.equal(all_samples(again)["input_ids"], all_samples(first)["input_ids"])


@pytest.mark.parametrize("guard", [True, False], ids=["deferred", "unguarded"])
def test_a_cancel_waits_for_the_tokenizer_load(guard):
    """Ray Data cancels its running tasks when a stream closes, and Ray delivers a
    non-forced cancel as ``_thread.interrupt_main()`` in the worker (its
    ``kill_main_task``). Delivered so inside interrupts_deferred (where a task imports
    and loads its tokenizer), the interrupt is held back until the block is done, then
    raised: the block's work is complete, so no worker keeps half-imported modules.
    Unguarded, the same interrupt ends the block early."""
    import _thread
    import signal
    import threading

    # A Ray worker runs Python's own SIGINT handler (interrupt_main does nothing under
    # SIG_IGN or SIG_DFL); the suite's process may have another by now.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with (interrupts_deferred() if guard else contextlib.nullcontext([])) as held:
                threading.Timer(0.2, _thread.interrupt_main).start()
                deadline = time.time() + 5
                while not held and time.time() < deadline:
                    time.sleep(0.01)
                done.append(True)  # the block's last step
    finally:
        signal.signal(signal.SIGINT, before)
    assert done == ([True] if guard else [])


TRICKY = ["Hello, world!", "  leading and trailing spaces  ", "ünïcödé ✓ 😀 mixed", "",
          "a [SEP] inside, and <|endoftext|> too", "word " * 300, "\n", "tabs\tand\r\nends\n"]


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "wordpiece-left"])
def test_task_tokenizer_gives_the_fast_tokenizers_ids(tmp_path, kind):
    """Tokenizing tasks run the fast tokenizer's Rust half alone (no transformers, no
    torch to import in a fresh worker): the same ids as transformers' call, with and
    without truncation (from either side), special tokens added by the post-processor
    (WordPiece's [CLS] ... [SEP]) and special-token strings inside the text."""
    from raylm.data.tokenized import RustTokenizer, task_tokenizer_state
    from raylm.data.tokenizer_train import train_tokenizer
    from tests.conftest import SHAKESPEARE

    if kind == "bpe":
        directory = TOKENIZER
    else:
        directory = str(tmp_path / "wp")
        train_tokenizer([str(SHAKESPEARE / "macbeth.txt")], directory, type="wordpiece",
                        vocab_size=600, lowercase=True)
        if kind == "wordpiece-left":
            hf = AutoTokenizer.from_pretrained(directory, truncation_side="left")
            hf.save_pretrained(directory)
    hf = load_tokenizer(directory)
    state = task_tokenizer_state(directory)
    assert "backend" in state  # (the driver's probe agreed: tasks get the Rust half)
    rust = RustTokenizer(state)
    for _ in range(2):  # (the truncation setting is switched back and forth)
        assert rust(TRICKY)["input_ids"] == hf(TRICKY)["input_ids"]
        assert (rust(TRICKY, truncation=True, max_length=7)["input_ids"]
                == hf(TRICKY, truncation=True, max_length=7)["input_ids"])
    if kind != "bpe":
        assert hf(["x"])["input_ids"][0][0] == hf.cls_token_id  # (the post-processor ran)
    if kind == "wordpiece-left":
        assert hf.truncation_side == "left"
