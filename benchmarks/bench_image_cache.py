"""What a rank's reads of the image cache cost in memory: memory-mapped shards against
shards read into memory.

    python benchmarks/bench_image_cache.py                    # 20,000 images of 64x64 RGB
    python benchmarks/bench_image_cache.py --images 40000 --ranks 2

The image cache (raylm.data.images) is built once, through the real path
(``build_given_images`` of a Ray Dataset of random pixel arrays). Then ``--ranks``
processes at once each read every image, in batches of 64 in id order:

  mmap      raylm's ImageReader: the cache's Arrow IPC shards memory-mapped, the pixels
            read in place from the page cache (file pages: shared by the ranks of a
            node, and reclaimable by the kernel)
  in memory the same reader, each shard's pixels read from a parquet copy into the
            process's own memory, as the cache's first format was

Each process reports its anonymous memory (RssAnon: the heap, which only the process
holds and the kernel cannot drop) and its file-backed pages (RssFile) after the pass,
less what it held before, and the images it read per second. Linux only (/proc).

The figures are written to benchmarks/results/bench_image_cache-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BATCH = 64


def rss() -> dict:
    """RssAnon and RssFile of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def read_all(kind: str, cache_dir: str, parquet: list, queue) -> None:
    import numpy as np
    import pyarrow.parquet as pq

    from raylm.data.images import ImageDataset
    from raylm.data.reader import ImageReader

    class InMemory(ImageReader):
        """The same reader with each shard read from parquet into this process's memory
        (the image cache's first format)."""

        def _load(self, path):
            d = self.dataset
            table = pq.read_table(parquet[self.dataset.shard_files.index(path)])
            raw = table.column("pixels").combine_chunks()
            flat = np.frombuffer(raw.buffers()[1], dtype=np.uint8,
                                 count=len(raw) * d.block_size,
                                 offset=raw.offset * d.block_size)
            return (flat.reshape(len(raw), d.image_size, d.image_size, d.channels),
                    table.column("label").to_numpy().astype(np.int64))

    dataset = ImageDataset.load(cache_dir)
    reader = (ImageReader if kind == "mmap" else InMemory)(dataset)
    before = rss()
    start = time.perf_counter()
    total = 0
    for first in range(0, dataset.num_samples, BATCH):
        ids = np.arange(first, min(first + BATCH, dataset.num_samples))
        total += int(reader.read(ids)["pixel_values"].numpy().sum(dtype=np.int64) > 0)
    seconds = time.perf_counter() - start
    after = rss()
    queue.put({"anon": after["RssAnon"] - before["RssAnon"],
               "file": after["RssFile"] - before["RssFile"],
               "images_per_s": dataset.num_samples / seconds, "batches": total})


def measure(kind: str, ranks: int, cache_dir: str, parquet: list) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=read_all, args=(kind, cache_dir, parquet, queue))
             for _ in range(ranks)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()

    import numpy as np
    import pyarrow.parquet as pq
    import ray

    from raylm.data.images import build_given_images, given_images, read_shard

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    work = tempfile.mkdtemp(prefix="bench-image-cache-")
    size, n = args.size, args.images

    def pictures(batch):
        rng = np.random.default_rng(int(batch["id"][0]))
        return {"image": list(rng.integers(0, 256, (len(batch["id"]), size, size, 3),
                                           dtype=np.uint8)),
                "label": [f"class{int(i) % 10}" for i in batch["id"]]}

    ds = ray.data.range(n, override_num_blocks=max(1, n // 2000)).map_batches(pictures)
    start = time.perf_counter()
    built, _ = build_given_images(given_images(ds, "train_dataset"), size, 3, work)
    build_s = time.perf_counter() - start
    print(f"built the cache of {n} images ({n * size * size * 3 / 2**20:.0f} MiB of "
          f"pixels) in {build_s:.1f} s: {built.cache_dir}")
    ray.shutdown()
    parquet = []  # the same shards as parquet (the first format), for the baseline
    for i, path in enumerate(built.shard_files):
        parquet.append(os.path.join(work, f"shard-{i}.parquet"))
        pq.write_table(read_shard(path), parquet[-1])

    rows = {kind: measure(kind, args.ranks, built.cache_dir, parquet)
            for kind in ("in memory", "mmap")}
    print(f"\n{args.ranks} process(es) at once, each reading all {n} images "
          f"({size}x{size} RGB) in batches of {BATCH}:")
    print(f"{'shards':<12}{'anon MiB/proc':>15}{'file MiB/proc':>15}{'images/s/proc':>16}")
    for kind, results in rows.items():
        anon = np.mean([r["anon"] for r in results])
        file = np.mean([r["file"] for r in results])
        speed = np.mean([r["images_per_s"] for r in results])
        print(f"{kind:<12}{anon:>15.0f}{file:>15.0f}{speed:>16.0f}")
    base, mm = rows["in memory"], rows["mmap"]
    ratio = np.mean([r["images_per_s"] for r in mm]) / np.mean([r["images_per_s"]
                                                                for r in base])
    print(f"\nmmap / in memory: anonymous memory "
          f"{np.mean([r['anon'] for r in mm]):.0f} / {np.mean([r['anon'] for r in base]):.0f}"
          f" MiB per process; read speed x{ratio:.2f}")
    print(json.dumps({"images": n, "ranks": args.ranks, "results": rows}))
    from benchmarks.results import write

    figures = {"config": {"images": n, "size": size, "ranks": args.ranks, "batch": BATCH,
                          "pixels_mib": n * size * size * 3 / 2**20},
               "build_s": build_s,
               "rows": {kind: {"anon_per_proc_mib": float(np.mean([r["anon"] for r in res])),
                               "file_per_proc_mib": float(np.mean([r["file"] for r in res])),
                               "images_per_s_per_proc": float(np.mean(
                                   [r["images_per_s"] for r in res]))}
                        for kind, res in rows.items()},
               "mmap/in memory, read speed": float(ratio)}
    print(f"written to {write('bench_image_cache', figures)}")


if __name__ == "__main__":
    main()
