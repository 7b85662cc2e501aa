"""The data pipeline: raylm's stream against the cache path and `datasets`, on the same files.

    python benchmarks/bench_data.py                 # a 64 MiB corpus in 8 shards
    python benchmarks/bench_data.py --mb 256 --shards 16 --steps 40

Rows, every one tokenizing the same .txt shards with the same tokenizer (raylm's built-in
BPE) into blocks of --block_size tokens (run_clm's concatenate-and-chunk):

  raylm-stream      raylm.data.stream.TokenStream: Ray Data tokenizes pieces in the
                    epoch's order; first = the first global batch's ids are ready, then
                    every window of one pass is taken
  raylm-cache       build_tokenized_dataset: the whole corpus into the parquet cache (what
                    a run without --streaming waits for before its first step)
  raylm-cache-ids   the same, from the corpus tokenized already: parquet shards of an
                    input_ids column, a row per line (what a tokenizing map of the text
                    loader leaves; writing them is not timed): raylm-cache's tokens
                    (pieces of row groups, not byte ranges, drop other remainders)
  datasets.map      datasets' text loader, .map(tokenize, batched, num_proc=--procs), then
                    run_clm's group_texts .map: HF run_clm's path (first = all of it)
  datasets-stream   load_dataset(..., streaming=True) with the same two maps, iterated:
                    HF run_clm's --streaming path (one process)

Columns: time to the first block (or global batch) and to the end of one pass, in
seconds, and tokens/s over the pass. Then a `raylm.train --streaming` run of a tiny GPT-2
on the corpus: the share of its step time spent waiting for data (the driver's wait for
Ray Data and the ranks' reads, steps after the first; the issue's goal: under 2%), and
its time to the first step against raylm-cache's whole pass.

The figures are written to benchmarks/results/bench_data-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"
TINY = ("n_layer=2,n_embd=64,n_head=2,n_positions=128,resid_pdrop=0.0,embd_pdrop=0.0,"
        "attn_pdrop=0.0")


def make_corpus(directory: Path, mb: float, shards: int) -> list[str]:
    """``shards`` .txt files of about mb/shards MiB each, the plays repeated."""
    plays = [p.read_text(encoding="utf-8") for p in sorted(SHAKESPEARE.glob("*.txt"))]
    per = int(mb * (1 << 20) / shards)
    files = []
    k = 0
    for i in range(shards):
        path = directory / f"shard-{i:03d}.txt"
        size = 0
        with open(path, "w", encoding="utf-8") as f:
            while size < per:
                text = plays[k % len(plays)]
                f.write(text)
                size += len(text.encode("utf-8"))
                k += 1
        files.append(str(path))
    return files


def row_stream(files, tokenizer, block, piece_mb, window) -> dict:
    from raylm.data.pieces import plan_pieces
    from raylm.data.stream import TokenStream

    pieces = plan_pieces(files, piece_mb)
    stream = TokenStream(pieces, dict(tokenizer_dir=tokenizer, block_size=block,
                                      line_by_line=False, text_column=None, pad_token_id=0,
                                      keep_linebreaks=True),
                         global_batch_size=64, seed=0, window=window)
    t0 = time.time()
    try:
        stream.global_batch(0)
        first = time.time() - t0
        samples = 0
        while True:  # every window of the first pass
            w = stream.next_window()
            if w.epoch > 0:
                break
            samples = w.end
            stream.release_before(w.end // 64)
        total = time.time() - t0
    finally:
        stream.close()
    return {"first_s": first, "pass_s": total, "tokens": samples * block,
            "pieces": len(pieces)}


def row_cache(files, tokenizer, block, piece_mb, cache) -> dict:
    from raylm.data.tokenized import build_tokenized_dataset

    t0 = time.time()
    ds = build_tokenized_dataset(files, tokenizer, block, cache_root=cache, piece_mb=piece_mb,
                                 overwrite=True)
    total = time.time() - t0
    return {"first_s": total, "pass_s": total, "tokens": ds.num_samples * block}


def row_cache_ids(files, tokenizer, block, piece_mb, cache, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylm.data.tokenized import load_tokenizer

    tok = load_tokenizer(tokenizer)
    (work / "ids").mkdir(exist_ok=True)
    shards = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)  # (as --keep_linebreaks reads them)
        out = work / "ids" / (Path(path).stem + ".parquet")
        pq.write_table(pa.table({"input_ids": tok(lines)["input_ids"]}), out,
                       row_group_size=65_536)
        shards.append(str(out))
    return row_cache(shards, tokenizer, block, piece_mb, cache)


def _group(block):
    def group_texts(examples):  # run_clm's
        from itertools import chain

        joined = list(chain(*examples["input_ids"]))
        n = (len(joined) // block) * block
        return {"input_ids": [joined[i:i + block] for i in range(0, n, block)]}
    return group_texts


def row_datasets_map(files, tokenizer_dir, block, procs, cache) -> dict:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    t0 = time.time()
    raw = datasets.load_dataset("text", data_files={"train": files}, keep_linebreaks=True,
                                cache_dir=cache)["train"]
    ids = raw.map(lambda b: tok(b["text"]), batched=True, num_proc=procs,
                  remove_columns=["text"], load_from_cache_file=False)
    blocks = ids.map(_group(block), batched=True, num_proc=procs,
                     remove_columns=ids.column_names, load_from_cache_file=False)
    total = time.time() - t0
    return {"first_s": total, "pass_s": total, "tokens": len(blocks) * block}


def row_datasets_stream(files, tokenizer_dir, block) -> dict:
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    t0 = time.time()
    raw = datasets.load_dataset("text", data_files={"train": files}, keep_linebreaks=True,
                                streaming=True)["train"]
    ids = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    blocks = ids.map(_group(block), batched=True, remove_columns=["input_ids", "attention_mask"])
    first, n = None, 0
    for _ in blocks:
        if first is None:
            first = time.time() - t0
        n += 1
    return {"first_s": first, "pass_s": time.time() - t0, "tokens": n * block}


def row_train(files, out, cache, block, steps, piece_mb, window) -> dict:
    from raylm import TrainConfig, train

    cfg = TrainConfig(model_type="gpt2", config_overrides=TINY, train_file=files,
                      block_size=block, data_cache_dir=cache, output_dir=out,
                      overwrite_output_dir=True, max_steps=steps, logging_steps=1,
                      save_steps=10**6, disable_tqdm=True, do_eval=False,
                      per_device_train_batch_size=8, num_workers=1, cpus_per_worker=1.0,
                      streaming=True, piece_size_mb=piece_mb, shuffle_buffer_size=window)
    t0 = time.time()
    result = train(cfg)
    wall = time.time() - t0
    later = result.history[1:]
    wait = sum(h["data_wait_s"] for h in later)
    step = sum(h["step_time_s"] for h in later)
    first = result.metrics["startup_s"]
    return {"wait_share": wait / max(step, 1e-9), "steps": len(later),
            "first_step_s": sum(v for k, v in first.items() if k != "first_step")
            + first.get("first_step", 0.0), "wall_s": wall,
            "tokens_per_second": result.metrics["train_tokens_per_second"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="corpus size, MiB")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=128)
    ap.add_argument("--piece_mb", type=float, default=8.0)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=2, help="datasets.map's num_proc")
    ap.add_argument("--steps", type=int, default=30, help="steps of the training row")
    ap.add_argument("--cpus", type=int, default=2, help="Ray's CPUs")
    ap.add_argument("--skip", nargs="*", default=[], help="rows to leave out")
    args = ap.parse_args()

    import ray

    from raylm.data.sources import builtin_tokenizer_dir

    tokenizer = builtin_tokenizer_dir()
    work = Path(tempfile.mkdtemp(prefix="raylm-bench-data-"))
    try:
        files = make_corpus(work / "corpus", args.mb, args.shards) if \
            (work / "corpus").mkdir() is None else []
        print(f"corpus: {len(files)} shards, {args.mb:g} MiB; block {args.block_size}; "
              f"{os.cpu_count()} cores", flush=True)
        ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False)
        rows = {}
        runs = [("raylm-stream", lambda: row_stream(files, tokenizer, args.block_size,
                                                    args.piece_mb, args.window)),
                ("raylm-cache", lambda: row_cache(files, tokenizer, args.block_size,
                                                  args.piece_mb, str(work / "cache"))),
                ("raylm-cache-ids", lambda: row_cache_ids(files, tokenizer, args.block_size,
                                                          args.piece_mb, str(work / "cache"),
                                                          work)),
                ("datasets.map", lambda: row_datasets_map(files, tokenizer, args.block_size,
                                                          args.procs, str(work / "hf"))),
                ("datasets-stream", lambda: row_datasets_stream(files, tokenizer,
                                                                args.block_size))]
        print(f"{'row':<16} {'first (s)':>10} {'pass (s)':>10} {'tokens/s':>12}", flush=True)
        for name, fn in runs:
            if name in args.skip:
                continue
            r = rows[name] = fn()
            print(f"{name:<16} {r['first_s']:>10.1f} {r['pass_s']:>10.1f} "
                  f"{r['tokens'] / r['pass_s']:>12,.0f}", flush=True)
        if "raylm-cache" in rows and "raylm-cache-ids" in rows:
            ids, text = rows["raylm-cache-ids"], rows["raylm-cache"]
            # (the same tokens; pieces cut at other places drop other remainders)
            print(f"raylm-cache / raylm-cache-ids: time {text['pass_s'] / ids['pass_s']:.2f}"
                  f" (the ids need no tokenizer); tokens {text['tokens']:,} / "
                  f"{ids['tokens']:,}")
        base = rows.get("raylm-stream")
        if base:
            for name, r in rows.items():
                if name != "raylm-stream":
                    print(f"raylm-stream / {name}: tokens/s "
                          f"{(base['tokens'] / base['pass_s']) / (r['tokens'] / r['pass_s']):.2f}"
                          f", time to first {base['first_s'] / r['first_s']:.2f}")
        figures = {"config": {"mb": args.mb, "shards": args.shards,
                              "block_size": args.block_size, "piece_mb": args.piece_mb,
                              "window": args.window, "procs": args.procs,
                              "steps": args.steps, "cpus": args.cpus, "skip": args.skip},
                   "rows": {name: dict(r, tokens_per_s=r["tokens"] / r["pass_s"])
                            for name, r in rows.items()}}
        if "train" not in args.skip:
            t = row_train(files, str(work / "out"), str(work / "cache"), args.block_size,
                          args.steps, args.piece_mb, args.window)
            print(f"train --streaming: first step after {t['first_step_s']:.1f} s "
                  f"(the cache's whole pass: "
                  f"{rows['raylm-cache']['pass_s'] if 'raylm-cache' in rows else float('nan'):.1f}"
                  f" s); data wait {100 * t['wait_share']:.2f}% of step time over "
                  f"{t['steps']} steps (goal < 2%); {t['tokens_per_second']:,.0f} tokens/s")
            figures["train_streaming"] = t
        print(json.dumps({"rows": rows}, default=str))
        from benchmarks.results import write

        print(f"written to {write('bench_data', figures)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
