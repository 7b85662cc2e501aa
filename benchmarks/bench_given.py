"""What a dataset object handed to train() costs before the first step, against files.

    python benchmarks/bench_given.py                # the 36 Shakespeare works, x4
    python benchmarks/bench_given.py --copies 16

`train(config, train_dataset=ds)` reads the dataset once on the driver and writes its
text column as one parquet file (raylm.data.given); from there it is a file. Rows, on the
same lines (the works' lines, --copies times, with their line breaks):

  export            raylm.data.given.export of a Ray Dataset of the lines (a
                    ray.data.read_parquet of a file of them, --blocks blocks, through a
                    map): the pass every start pays
  export again      the same, when the file exists (the pass still runs: the digest is
                    learned by reading the rows)
  write parquet     pyarrow writing the same rows to a file in this process: the floor
                    of any export
  tokenize          build_tokenized_dataset of the exported file (what follows for files
                    and datasets alike, once: cached after)

Columns: seconds and rows/s; then the export's ratio to tokenizing.

The figures are written to benchmarks/results/bench_given-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block_size", type=int, default=128)
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from raylm.data.given import export
    from raylm.data.sources import builtin_tokenizer_dir
    from raylm.data.tokenized import build_tokenized_dataset

    rows = []
    for path in sorted(SHAKESPEARE.glob("*.txt")):
        rows += path.read_text().splitlines(keepends=True)
    rows *= args.copies
    mb = sum(map(len, rows)) / 2**20
    work = tempfile.mkdtemp(prefix="bench-given-")
    source = os.path.join(work, "lines.parquet")
    pq.write_table(pa.table({"line": rows}), source)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    print(f"{len(rows):,} rows, {mb:.1f} MiB, {os.cpu_count()} CPUs")

    def dataset():
        return ray.data.read_parquet(source, override_num_blocks=args.blocks).map_batches(
            lambda b: {"text": b["line"]}, batch_format="pyarrow")

    results = []
    t = time.perf_counter()
    exported, _ = export(dataset(), "train_dataset", None, os.path.join(work, "cache"))
    results.append(("export", time.perf_counter() - t))
    t = time.perf_counter()
    export(dataset(), "train_dataset", None, os.path.join(work, "cache"))
    results.append(("export again", time.perf_counter() - t))
    t = time.perf_counter()
    pq.write_table(pa.table({"text": rows}), os.path.join(work, "floor.parquet"))
    results.append(("write parquet", time.perf_counter() - t))
    t = time.perf_counter()
    build_tokenized_dataset([exported], builtin_tokenizer_dir(), args.block_size,
                            cache_root=os.path.join(work, "tokens"))
    results.append(("tokenize", time.perf_counter() - t))

    print(f"{'':15s} {'seconds':>8s} {'rows/s':>12s}")
    for name, secs in results:
        print(f"{name:15s} {secs:8.2f} {len(rows) / secs:12,.0f}")
    by = dict(results)
    print(f"export / tokenize: {by['export'] / by['tokenize']:.2f}; "
          f"export / write parquet: {by['export'] / by['write parquet']:.1f}")
    ray.shutdown()
    from benchmarks.results import write

    figures = {"config": {"copies": args.copies, "blocks": args.blocks,
                          "block_size": args.block_size, "rows": len(rows), "text_mib": mb},
               "rows": {name: {"seconds": secs, "rows_per_s": len(rows) / secs}
                        for name, secs in results},
               "export/tokenize": by["export"] / by["tokenize"],
               "export/write parquet": by["export"] / by["write parquet"]}
    print(f"written to {write('bench_given', figures)}")


if __name__ == "__main__":
    main()
