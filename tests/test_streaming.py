"""--streaming: Ray Data tokenizes pieces of the corpus while training runs.

Exactly once per pass over the data, the same order and losses on 1, 2 and 4 ranks, a
resume mid-epoch that continues where the stream stood, large files cut into pieces
that tokenize in separate tasks, a bad piece met mid-stream, and a corpus and token cache
in an object store (``s3://``, served on this machine by moto's S3 server).
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylm import TrainConfig, train
from raylm.data.pieces import plan_pieces
from raylm.data.reader import BlockReader
from raylm.data.sources import (builtin_tokenizer_dir, iter_text_chunks, iter_texts,
                                resolve_files)
from raylm.data.stream import PIECE_SHIFT, TokenStream, piece_order
from raylm.data import tokenized
from raylm.data.tokenized import (CACHE_PREFIX, MANIFEST, TMP_PREFIX, build_tokenized_dataset,
                                  cache_key, load_tokenizer, tokenize_file)
from raylm.errors import ConfigError
from raylm.runtime.input_checks import check_inputs
from tests.conftest import SHAKESPEARE, TINY_GPT2
from tests.object_store import s3_endpoint
from tests.test_recovery import KillRank

PIECE_MB = 0.005  # 5 KiB pieces: the corpus's files are cut in two or three
BATCH = 16
STEPS = 16  # one pass over the corpus is about 13 steps: the run starts a second


def _head(name: str, size: int) -> str:
    text = (SHAKESPEARE / name).read_text(encoding="utf-8")[:size]
    return text[:text.rfind("\n") + 1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream-corpus")
    (d / "a.txt").write_text(_head("comedy_of_errors.txt", 6000), encoding="utf-8")
    (d / "b.txt").write_text(_head("macbeth.txt", 6000), encoding="utf-8")
    (d / "big.txt").write_text(_head("julius_caesar.txt", 14000), encoding="utf-8")
    return d


def config(out, corpus, cache_root, workers, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2,
                train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                gradient_accumulation_steps=BATCH // 4 // workers, num_workers=workers,
                cpus_per_worker=0.5, logging_steps=1, save_steps=1000, disable_tqdm=True,
                do_eval=False, log_sample_ids=True, learning_rate=1e-3, streaming=True,
                shuffle_buffer_size=40, piece_size_mb=PIECE_MB)
    base.update(kw)
    return TrainConfig(**base)


def step_ids(output_dir) -> dict:
    """Step -> the global batch's sample ids, in order (the last record of a step)."""
    out = {}
    with open(os.path.join(output_dir, "samples.jsonl")) as f:
        for rec in map(json.loads, f):
            out[rec["step"]] = [i for rank in rec["ranks"] for i in rank]
    return out


def every_sample(corpus, cache_root) -> set:
    """The ids of every sample of the corpus (piece << 32 | row): the cache path packs
    the same pieces, so its shards (named by piece and first row) list them."""
    files = sorted(str(p) for p in corpus.iterdir())
    ds = build_tokenized_dataset(files, builtin_tokenizer_dir(), 32, cache_root=cache_root,
                                 piece_mb=PIECE_MB)
    ends = ds.shard_offsets[1:] + [ds.num_samples]
    ids = set()
    for name, start, end in zip(ds.shard_files, ds.shard_offsets, ends):
        piece, first = map(int, re.findall(r"shard-(\d+)-(\d+)", name)[0])
        ids.update((piece << PIECE_SHIFT) | (first + k) for k in range(end - start))
    return ids


@pytest.fixture(scope="module")
def runs(ray_cluster, corpus, cache_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("stream-runs")
    return {n: train(config(base / f"w{n}", corpus, cache_root, n)) for n in (1, 2, 4)}


@pytest.mark.slow
def test_streaming_is_exactly_once_and_the_same_on_1_2_and_4_ranks(runs, corpus, cache_root):
    expected = every_sample(corpus, cache_root)
    assert len(plan_pieces(sorted(str(p) for p in corpus.iterdir()), PIECE_MB)) == 7
    order = {n: step_ids(r.output_dir) for n, r in runs.items()}
    for n in (2, 4):
        assert order[n] == order[1]  # the same samples, in the same order, every step
        np.testing.assert_allclose([h["loss"] for h in runs[n].history],
                                   [h["loss"] for h in runs[1].history], rtol=1e-5)
        np.testing.assert_allclose([h["grad_norm"] for h in runs[n].history],
                                   [h["grad_norm"] for h in runs[1].history], rtol=1e-4)
    seen = [i for s in range(1, STEPS + 1) for i in order[1][s]]
    assert len(seen) == STEPS * BATCH > len(expected)  # the run passes an epoch's end
    first = seen[:len(expected)]
    assert len(set(first)) == len(first) and set(first) == expected  # each sample once
    assert set(seen[len(expected):]) <= expected  # the second pass: the same samples
    assert seen[len(expected):] != first[:STEPS * BATCH - len(expected)]  # reshuffled
    with open(os.path.join(runs[2].output_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert all("stream_wait_s" in r for r in logged if "loss" in r)


class StopAt:
    """Ends the driver (an exception out of its loop) after a step: a driver killed."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, driver, step, record):
        if step == self.step:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_streaming_resumes_mid_epoch_where_the_stream_stood(runs, corpus, cache_root,
                                                             tmp_path):
    cfg = config(tmp_path / "out", corpus, cache_root, 2, save_steps=6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, callbacks=(StopAt(9),))
    resumed = train(cfg)
    whole = runs[2]
    losses = {h["step"]: h["loss"] for h in resumed.history}
    assert sorted(losses) == list(range(7, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in range(7, STEPS + 1)],
                               [h["loss"] for h in whole.history[6:]], rtol=1e-5)
    assert step_ids(resumed.output_dir) == step_ids(whole.output_dir)
    # The resumed stream starts at the window of step 7, not at the corpus's start.
    assert resumed.metrics["stream_samples_read"] < whole.metrics["stream_samples_read"]


@pytest.mark.slow
def test_a_rank_lost_mid_stream_leaves_every_sample_trained_once(runs, corpus, cache_root,
                                                                 tmp_path):
    killer = KillRank(at_step=5, rank=1)
    result = train(config(tmp_path / "out", corpus, cache_root, 2, do_train=True,
                          do_eval=True, validation_file=[str(SHAKESPEARE / "macbeth.txt")],
                          max_eval_samples=16), callbacks=(killer,))
    assert killer.killed is not None and result.failures
    assert np.isfinite(result.metrics["eval_loss"])  # (a --validation_file: the cache)
    whole = runs[2]
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [h["loss"] for h in whole.history], rtol=1e-5)
    assert step_ids(result.output_dir) == step_ids(whole.output_dir)


class FirstStep:
    def __init__(self):
        self.at = None

    def on_step_end(self, driver, step, record):
        if self.at is None:
            self.at = time.time()


@pytest.mark.slow
def test_the_first_step_comes_long_before_the_corpus_could_be_tokenized(
        ray_cluster, cache_root, tmp_path):
    """A corpus whose whole tokenization takes at least 120 s: (one 4 MiB piece's
    measured time) x pieces / the cores, a lower bound; shards of 50 MiB are added until
    it does. The stream's first step comes before the corpus could have been tokenized
    (against a bound measured on the same machine: a slower one takes longer to start
    its rank, and to tokenize)."""
    data = tmp_path / "data"
    data.mkdir()
    plays = "".join(p.read_text(encoding="utf-8") for p in sorted(SHAKESPEARE.glob("*.txt")))
    shard = plays * 12
    (data / "shard-0000.txt").write_text(shard, encoding="utf-8")
    tokenizer = load_tokenizer(builtin_tokenizer_dir())
    piece = plan_pieces([str(data / "shard-0000.txt")], 4.0)[1]
    t0 = time.time()
    tokens = sum(b.size for b, _ in tokenize_file(piece.path, tokenizer, 32, False, None, 0,
                                                  keep_linebreaks=True, piece=piece.range))
    one_piece = time.time() - t0
    cpus = min(ray_cluster.cluster_resources()["CPU"], os.cpu_count())
    pieces = plan_pieces([str(data / "shard-0000.txt")], 4.0)
    while one_piece * len(pieces) / cpus < 120 and len(pieces) < 500:
        (data / f"shard-{len(list(data.iterdir())):04d}.txt").write_text(shard,
                                                                        encoding="utf-8")
        pieces = plan_pieces(sorted(str(p) for p in data.iterdir()), 4.0)
    whole = one_piece * len(pieces) / cpus  # a lower bound: every piece, every CPU busy
    first = FirstStep()
    t0 = time.time()
    result = train(config(tmp_path / "out", data, cache_root, 1, max_steps=2,
                          piece_size_mb=4.0, shuffle_buffer_size=200,
                          streaming_buffer_mb=32, log_sample_ids=False),
                   callbacks=(first,))
    to_first = first.at - t0
    print(f"first step after {to_first:.1f} s; the whole corpus ({len(pieces)} pieces, "
          f"{tokens * len(pieces) / 1e6:.0f}M tokens) takes at least {whole:.1f} s")
    assert tokens > 0 and whole >= 120
    assert to_first < whole and len(result.history) == 2


def test_a_stream_read_again_or_resumed_gives_the_same_batches(ray_cluster, corpus):
    pieces = plan_pieces(sorted(str(p) for p in corpus.iterdir()), PIECE_MB)

    def stream(identity="corpus"):
        return TokenStream(pieces, dict(tokenizer_dir=builtin_tokenizer_dir(), block_size=32,
                                        line_by_line=False, text_column=None,
                                        pad_token_id=0, keep_linebreaks=True),
                           global_batch_size=BATCH, seed=3, window=40, identity=identity)

    a = stream()
    try:
        first = [a.global_batch(k).tolist() for k in range(STEPS + 4)]  # into pass two
        state = a.state_at(11)
        a.release_before(STEPS + 2)
        assert a.global_batch(4).tolist() == first[4]  # released: read again from its mark
        assert a.global_batch(STEPS + 3).tolist() == first[STEPS + 3]
        assert a.epoch_of(1) == 0.0 and a.epoch_of(STEPS + 4) == 1.0
    finally:
        a.close()
    with pytest.raises(ConfigError, match="changed since the checkpoint"):
        stream("other files").restore(state)
    b = stream()
    b.restore(state)
    try:
        assert [b.global_batch(k).tolist() for k in range(11, STEPS + 4)] == first[11:]
    finally:
        b.close()


@pytest.mark.parametrize("text", [
    "a\nbb\n\nccc", "line one\r\nline two\r\n", "x" * 500 + "\nshort\n" + "y" * 300 + "\n",
    "\n\n\n", "é😀 wide\nü\n" * 40])
def test_byte_pieces_hold_every_line_once(tmp_path, text):
    path = tmp_path / "f.txt"
    data = text.encode("utf-8")
    path.write_bytes(data)
    for size in (1, 2, 3, 7, 64, 1000):
        chunks = [c for start in range(0, len(data), size)
                  for c in iter_text_chunks(str(path), 16, None, start,
                                            min(len(data), start + size))]
        assert "".join(chunks) == text, size
    bad = data[:len(data) // 2] + b"\xff" + data[len(data) // 2:]
    path.write_bytes(bad)
    errors = []
    for start in range(0, len(bad), 7):
        try:
            list(iter_text_chunks(str(path), 16, None, start, min(len(bad), start + 7)))
        except ConfigError as e:
            errors.append(str(e))
    assert errors == [f"{path} is not valid UTF-8: invalid byte at offset {len(data) // 2}"]


def test_a_large_file_is_cut_into_pieces_that_tokenize_in_separate_tasks(ray_cluster,
                                                                       tmp_path):
    text = _head("hamlet.txt", 60000)
    big = tmp_path / "big.txt"
    big.write_text(text, encoding="utf-8")
    pieces = plan_pieces([str(big)], 0.01)
    assert len(pieces) == 6
    lines = [t for p in pieces for batch in iter_texts(str(big), keep_linebreaks=True,
                                                       piece=p.range) for t in batch]
    assert "".join(lines) == text  # each line in exactly one piece
    rows = [{"text": f"row {i} " + "word " * (i % 7)} for i in range(3000)]
    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    parquet = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=500)
    for path, mb in ((jsonl, 0.02), (parquet, 0.005)):
        cut = plan_pieces([str(path)], mb)
        assert len(cut) > 1
        got = [t for p in cut for batch in iter_texts(str(path), piece=p.range) for t in batch]
        assert got == [r["text"] for r in rows]

    stream = TokenStream(pieces, dict(tokenizer_dir=builtin_tokenizer_dir(), block_size=32,
                                      line_by_line=False, text_column=None, pad_token_id=0,
                                      keep_linebreaks=True),
                         global_batch_size=8, seed=0, window=10_000)
    try:
        first = stream.global_batch(0)  # the whole file is one window: every piece read
        assert len(first) == 8 and len(stream.stats.tasks) > 1
        per_piece = {int(i) >> PIECE_SHIFT for i in stream.windows[0].ids}
        assert per_piece == {p.index for p in pieces}
    finally:
        stream.close()


def test_a_bad_piece_mid_stream_stops_the_run_after_saving_what_was_trained(
        ray_cluster, corpus, cache_root, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = _head("macbeth.txt", 20000)
    (data / "ok.txt").write_text(good, encoding="utf-8")
    bad = _head("hamlet.txt", 80000).encode("utf-8")
    offset = 70000 + bad[70000:].index(b"\n") + 1
    (data / "bad.txt").write_bytes(bad[:offset] + b"\xff" + bad[offset:])
    files = sorted(str(p) for p in data.iterdir())
    pieces = plan_pieces(files, 0.02)
    bad_piece = next(p.index for p in pieces if p.path.endswith("bad.txt")
                     and p.start <= offset < p.end)
    # A seed whose first pass reads two good pieces or more before the bad one.
    seed = next(s for s in range(100)
                if list(piece_order(len(pieces), s, 0)).index(bad_piece) >= 2)
    cfg = config(tmp_path / "out", data, cache_root, 1, seed=seed, max_steps=200,
                 save_steps=1000, shuffle_buffer_size=20)
    with pytest.raises(ConfigError, match=rf"bad\.txt is not valid UTF-8: invalid byte at "
                                          rf"offset {offset}"):
        train(cfg)
    with open(os.path.join(cfg.output_dir, "metrics.jsonl")) as f:
        trained = max(r["step"] for r in map(json.loads, f) if "loss" in r)
    assert trained > 0
    state = os.path.join(cfg.output_dir, "checkpoints", f"step-{trained:08d}",
                         "trainer_state.json")
    with open(state) as f:
        assert json.load(f)["step"] == trained


@pytest.mark.parametrize("flags, message", [
    (dict(max_steps=-1, num_train_epochs=1), "--streaming needs --max_steps"),
    (dict(save_strategy="epoch"), "--save_strategy epoch"),
    (dict(max_train_samples=10), "--max_train_samples is not taken with --streaming"),
    (dict(do_eval=True), "--do_eval with --streaming needs --validation_file"),
    (dict(shuffle_buffer_size=0), "--shuffle_buffer_size must be >= 1"),
])
def test_streaming_flags_are_checked_before_anything_starts(corpus, tmp_path, flags,
                                                            message):
    cfg = config(tmp_path / "out", corpus, None, 1, **flags)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_inputs(cfg)


def test_unset_streaming_streams_a_large_corpus_when_the_run_allows_it(corpus, tmp_path,
                                                                       monkeypatch):
    import raylm.runtime.input_checks as input_checks

    files = sorted(str(p) for p in corpus.iterdir())
    size = sum(os.path.getsize(f) for f in files)
    auto = dict(streaming=None, do_eval=False)
    assert not input_checks.streams(config(tmp_path, corpus, None, 1, **auto), files)
    monkeypatch.setattr(input_checks, "STREAM_AUTO_BYTES", size - 1)  # "large" is now this
    assert input_checks.streams(config(tmp_path, corpus, None, 1, **auto), files)
    assert check_inputs(config(tmp_path / "o", corpus, None, 1, **auto)).streaming
    for flags in (dict(do_eval=None), dict(max_steps=-1, num_train_epochs=1),
                  dict(save_strategy="epoch"), dict(streaming=False, do_eval=False)):
        assert not input_checks.streams(config(tmp_path, corpus, None, 1,
                                               **{**auto, **flags}), files), flags


def test_a_pipeline_that_cannot_keep_up_is_logged_once_with_its_rates(caplog):
    """The driver's check after each step (Reporter.stream_rate_check, on the run's
    records): ten steps of 1 s that waited 0.5 s each for a global batch of 16 reach
    16 samples/s where training alone would take 32; the warning comes once. Waits of a
    twentieth of the step time are not worth a line."""
    from types import SimpleNamespace

    from raylm.runtime.reporting import Reporter

    def check(wait_s, steps=12):
        report = SimpleNamespace(stream_warned=False, record=SimpleNamespace(history=[]))
        for step in range(1, steps + 1):
            rec = {"step": step, "stream_wait_s": wait_s, "step_time_s": 1.0}
            report.record.history.append(rec)
            Reporter.stream_rate_check(report, 16)
        return report

    with caplog.at_level("WARNING", logger="raylm"):
        slow = check(0.5)
    lines = [r.getMessage() for r in caplog.records if "--streaming" in r.getMessage()]
    assert slow.stream_warned and len(lines) == 1, lines
    assert "keeps up with 16.0 samples/s, and training needs 32.0" in lines[0]
    assert "wait 50% of their time" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="raylm"):
        fast = check(0.05)
    assert not fast.stream_warned and not caplog.records


@pytest.mark.slow
def test_masked_lm_streams_the_same_on_1_and_2_ranks(ray_cluster, corpus, corpus_dir,
                                                    cache_root, tmp_path):
    """BERT's masked LM under --streaming: a sample's masks are drawn per (seed, step,
    sample id) (a stream has no fixed epoch length; each time a sample is trained on it
    gets fresh masks), so 1 and 2 ranks train the same samples with the same losses and
    gradient norms."""
    from tests.test_mlm import TINY_BERT, wordpiece_tokenizer

    class DrawKey:
        """What the driver gives the ranks for the draw's "epoch": step // this."""
        def on_step_end(self, driver, step, record):
            self.steps_per_epoch = driver.steps_per_epoch

    results, key = {}, DrawKey()
    for n in (1, 2):
        results[n] = train(config(
            tmp_path / f"w{n}", corpus, cache_root, n, model_type="bert",
            config_overrides=TINY_BERT, tokenizer_name=wordpiece_tokenizer(corpus_dir,
                                                                           cache_root),
            max_steps=4, per_device_train_batch_size=2,
            gradient_accumulation_steps=4 // n), callbacks=(key,))
    assert key.steps_per_epoch == 1  # each step its own draw (a pass has no fixed length)
    assert results[1].history[0]["loss"] > 0
    assert step_ids(results[2].output_dir) == step_ids(results[1].output_dir)
    np.testing.assert_allclose([h["loss"] for h in results[2].history],
                               [h["loss"] for h in results[1].history], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in results[2].history],
                               [h["grad_norm"] for h in results[1].history], rtol=1e-4)


# --- object stores -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3(corpus):
    """The corpus's files in a bucket of a local S3 endpoint, under corpus/."""
    with s3_endpoint() as endpoint:
        for path in sorted(corpus.iterdir()):
            endpoint.put(f"corpus/{path.name}", path.read_bytes())
        yield endpoint


@pytest.mark.slow
def test_a_corpus_in_an_object_store_streams_and_trains_as_it_does_from_disk(
        runs, s3, corpus, cache_root, tmp_path):
    """--train_file s3://bucket/dir: the files are listed, cut into byte ranges and read by
    Ray Data's tasks through pyarrow's S3 filesystem; the run is the disk run, step for
    step (samples, losses, gradient norms), into its second pass over the bucket."""
    result = train(config(tmp_path / "out", corpus, cache_root, 1,
                          train_file=[s3.uri("corpus")]))
    assert step_ids(result.output_dir) == step_ids(runs[1].output_dir)
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [h["loss"] for h in runs[1].history], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in result.history],
                               [h["grad_norm"] for h in runs[1].history], rtol=1e-4)
    assert len(result.history) == STEPS


@pytest.mark.slow
def test_a_token_cache_in_an_object_store_commits_whole_and_is_reused(
        ray_cluster, s3, corpus, cache_root, monkeypatch):
    """--data_cache_dir s3://...: a build from the bucket's files into the bucket holds the
    disk build's samples. An object store has no rename, so the shards are copied into
    place and the manifest last: what an interrupted commit left (shards, no manifest) is
    never read as a cache but replaced, and nothing temporary is left behind. What a
    crashed build left in the bucket is cleared once idle (dated by its newest object),
    what a build still running is writing is not."""
    tokenizer, root = builtin_tokenizer_dir(), s3.uri("cache")
    files = resolve_files([s3.uri("corpus")])
    on_disk = build_tokenized_dataset(sorted(str(p) for p in corpus.iterdir()), tokenizer, 32,
                                      cache_root=cache_root, piece_mb=PIECE_MB)
    key = cache_key(files, tokenizer, 32, False, None, True, PIECE_MB)
    final = f"cache/{CACHE_PREFIX}{key}"
    s3.put(f"{final}/shard-000009-000000000000.parquet", b"half a shard")  # no manifest
    crashed = f"cache/{TMP_PREFIX}{key}-crashed/shard-000000-000000000000.parquet"
    s3.put(crashed, b"a crashed build's shard")
    monkeypatch.setattr(tokenized, "STALE_TMP_S", 2.0)  # (S3 sets an object's time itself)
    time.sleep(3.0)
    running = f"cache/{TMP_PREFIX}{key}-running/shard-000000-000000000000.parquet"
    s3.put(running, b"a running build's shard")
    built = build_tokenized_dataset(files, tokenizer, 32, cache_root=root, piece_mb=PIECE_MB)
    assert not built.reused and built.num_samples == on_disk.num_samples
    assert all(f.startswith("s3://") for f in built.shard_files)
    ids = np.arange(on_disk.num_samples)
    assert (BlockReader(built).read(ids)["input_ids"]
            == BlockReader(on_disk).read(ids)["input_ids"]).all()
    shards = [os.path.basename(f) for f in on_disk.shard_files]
    assert s3.keys("cache") == sorted([f"{final}/{name}" for name in shards + [MANIFEST]]
                                      + [running])
    again = build_tokenized_dataset(files, tokenizer, 32, cache_root=root, piece_mb=PIECE_MB)
    assert again.reused and again.shard_files == built.shard_files


@pytest.mark.parametrize("key", ["no-such-dir", "corpus/*.parquet"])
def test_a_missing_object_store_path_is_one_error_before_anything_starts(s3, corpus,
                                                                         tmp_path, key):
    cfg = config(tmp_path / "out", corpus, None, 1, train_file=[s3.uri(key)])
    with pytest.raises(ConfigError, match=r"--train_file: .*" + re.escape(s3.uri(key))):
        check_inputs(cfg)
