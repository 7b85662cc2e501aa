"""gloo's collectives on this machine, as ZeRO uses them: the reduce-scatter raylm does
(raylm.parallel.data.reduce_scatter_sum: an all-to-all and a local sum) against gloo's
own reduce-scatter and all-reduce of the same buffer, and the all-gather.

    python benchmarks/bench_collectives.py                 # 2 and 4 processes, 4 MiB (~20 s)
    python benchmarks/bench_collectives.py --mib 1 4 16 --procs 4

Each size: n processes (torch.multiprocessing, gloo over loopback, one torch thread each)
run every collective --repeat times after a barrier; the median per call in ms, rank 0's.
The reduce-scatters are checked against the all-reduce's section (raylm's must equal it).
Asserts nothing else: timings on a shared machine vary; run it twice. Written to
benchmarks/results/bench_collectives-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_pipeline import free_port  # noqa: E402

KINDS = ("all_reduce", "gloo reduce_scatter", "raylm reduce_scatter_sum", "all_gather")


def _rank(rank: int, n: int, port: int, sizes: list, repeat: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from raylm.parallel.data import reduce_scatter_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    rows = []
    for mib in sizes:
        numel = (int(mib * 2**20) // 4) // n * n
        x = torch.randn(numel) + rank
        out = torch.empty(numel // n)
        whole = x.clone()
        dist.all_reduce(whole)
        section = whole.view(n, -1)[rank]
        times = {}
        for kind in KINDS:
            ts = []
            for _ in range(repeat):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "all_reduce":
                    y = x.clone()
                    dist.all_reduce(y)
                elif kind == "gloo reduce_scatter":
                    dist.reduce_scatter_single(out, x)
                elif kind == "raylm reduce_scatter_sum":
                    reduce_scatter_sum(out, x, dist.group.WORLD).wait()
                else:
                    full = torch.empty(numel)
                    dist.all_gather_single(full, out)
                ts.append(time.perf_counter() - t0)
                if "reduce_scatter" in kind:
                    torch.testing.assert_close(out, section, rtol=1e-5, atol=1e-4)
            times[kind] = statistics.median(ts) * 1e3
        rows.append((mib, times))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--mib", type=float, nargs="*", default=[4.0],
                    help="buffer sizes in MiB (default 4: a gradient bucket)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    print(f"{'procs':>5} {'MiB':>6} " + " ".join(f"{k:>25}" for k in KINDS) + "   (ms)")
    figures = {"config": {"repeat": args.repeat}, "rows": {}}
    for n in args.procs:
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, n, port, args.mib, args.repeat, queue))
                 for r in range(n)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
        for mib, times in rows:
            print(f"{n:>5} {mib:>6g} " + " ".join(f"{times[k]:>25.1f}" for k in KINDS))
            figures["rows"][f"{n} procs, {mib:g} MiB"] = {"procs": n, "mib": mib,
                                                          "ms": dict(times)}
    from benchmarks.results import write

    print(f"written to {write('bench_collectives', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
