"""The driver's cost per step as the number of ranks grows, today's step protocol: one
Ray call to every rank and one answer from each, every step.

    python benchmarks/bench_control_plane.py                  # 1-32 ranks, ~6 min here
    python benchmarks/bench_control_plane.py --ranks 2 4 8 --steps 100

The real driver and rank code on a stand-in model (an embedding of width 1 and a head:
a step's compute is nearly nothing, so what is left is the protocol's), every rank on
this machine's 2 cores with a fraction of a CPU each. For each N a run of 2 steps starts
the ranks (``raylm.keep_ranks()``), then a run of ``--steps`` is timed from its second
step log line to its last (the driver's log is read as it writes it), without the
start-up: the driver process's CPU time per step (all its threads, Ray's own
included), the wall time per step, the ranks' median idle time at the step boundary,
and the driver's peak resident memory. Then, from 2 ranks on, a run whose last rank
dies at step 25: the recovery's "detect and settle" (the failure seen, the survivors
out of the old group) and "regroup" (the smaller group formed) times, from the
driver's log. A line a + b x N is fitted to the driver's CPU
per step over the smaller Ns and checked against the largest (held back), then
extrapolated to 1,000 and 10,000 ranks, assuming that each rank costs the driver the
same per step (one call out, one answer in) and nothing else grows with N. Asserts
nothing; writes benchmarks/results/bench_control_plane-<date>.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
LOG_EVERY = 25  # steps between the driver's step lines, which the clock reads


def stand_in():
    """A language model whose step costs next to nothing: an embedding of width 1 and a
    linear head over the built-in tokenizer's 4,096 tokens."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(4096, 1), nn.Linear(1, 4096)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    return Tiny()


class StepClock(logging.Handler):
    """The driver process's CPU and wall clocks at each "step k/M" log line (the handler
    runs in the driver's thread as it logs; a callback would change the protocol: the
    driver sends no step ahead while one is due)."""

    LINE = re.compile(r"^step (\d+)/")
    SHRANK = re.compile(r"^shrank in memory to \d+ rank\(s\) \(generation \d+\) in "
                        r"([\d.]+) s \(detect and settle ([\d.]+) s, regroup ([\d.]+) s\)")

    def __init__(self):
        super().__init__(logging.INFO)
        self.marks = []  # (step, process CPU s, wall s)
        self.shrank = None  # a recovery's (whole, detect and settle, regroup) seconds

    def emit(self, record):
        message = record.getMessage()
        m = self.LINE.match(message)
        if m:
            self.marks.append((int(m.group(1)), time.process_time(), time.perf_counter()))
        m = self.SHRANK.match(message)
        if m:
            self.shrank = tuple(float(x) for x in m.groups())


def run(ranks: int, steps: int, play: str, cache: str, kill_at: int = 0) -> tuple:
    """One run of ``steps`` steps on ``ranks`` ranks (``kill_at``: the last rank dies
    before step ``kill_at``'s forward): (the StepClock, the history's per-step
    records)."""
    from raylm import TrainConfig, train
    from raylm.runtime import faults

    clock = StepClock()
    logger = logging.getLogger("raylm")
    logger.addHandler(clock)
    logger.setLevel(logging.INFO)  # (main's handler shows warnings only)
    kill = [{"rank": ranks - 1, "step": kill_at, "phase": "step"}] if kill_at else []
    try:
        with faults.inject(*kill):
            result = train(TrainConfig(
                train_file=[play], block_size=8, data_cache_dir=cache,
                per_device_train_batch_size=1, max_steps=steps, num_workers=ranks,
                cpus_per_worker=min(0.5, 1.5 / ranks),
                output_dir=tempfile.mkdtemp(prefix="bench-control-"),
                overwrite_output_dir=True, logging_steps=LOG_EVERY, save_strategy="no",
                do_eval=False, report_to=["none"], disable_tqdm=True), model_init=stand_in)
    finally:
        logger.removeHandler(clock)
    return clock, result.history


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=300, help="steps of each timed run")
    args = ap.parse_args(argv)

    import ray

    from raylm import keep_ranks
    from raylm.data.sources import builtin_sample_files
    from raylm.runtime.cluster import start_local

    from benchmarks.results import write

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    play = [f for f in builtin_sample_files() if f.endswith("macbeth.txt")][0]
    cache = tempfile.mkdtemp(prefix="bench-control-cache-")
    start_local(num_cpus=2, log_to_driver=False)  # as `raylm train` starts Ray
    rows = {}
    try:
        print(f"{'ranks':>5} {'driver CPU/step':>16} {'step':>10} {'boundary idle':>14} "
              f"{'driver RSS':>11} {'rank lost: settle':>18} {'regroup':>9}")
        with keep_ranks():
            for n in args.ranks:
                run(n, 2, play, cache)  # (starts the ranks, and the first tokenizes)
                clock, history = run(n, args.steps, play, cache)
                (k0, c0, t0), (k1, c1, t1) = clock.marks[1], clock.marks[-1]  # (2nd line on)
                idle = [h["boundary_idle_s"] for h in history[k0:k1]
                        if h.get("boundary_idle_s") is not None]
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                rows[n] = {"driver_cpu_ms": 1000 * (c1 - c0) / (k1 - k0),
                           "step_ms": 1000 * (t1 - t0) / (k1 - k0),
                           "boundary_idle_ms": 1000 * statistics.median(idle) if idle else None,
                           "steps_timed": k1 - k0, "driver_peak_rss_bytes": rss}
                if n > 1:  # a rank killed: the survivors carry on in memory
                    shrank = run(n, 2 * LOG_EVERY, play, cache, kill_at=LOG_EVERY)[0].shrank
                    if shrank:
                        rows[n].update(zip(("recovery_s", "detect_settle_s", "regroup_s"),
                                           shrank))
                r = rows[n]
                print(f"{n:>5} {r['driver_cpu_ms']:>13.2f} ms {r['step_ms']:>7.2f} ms "
                      f"{(r['boundary_idle_ms'] or 0):>11.2f} ms {rss / 2**20:>7.0f} MiB "
                      + (f"{r['detect_settle_s']:>16.2f} s {r['regroup_s']:>7.2f} s"
                         if "regroup_s" in r else ""), flush=True)
    finally:
        ray.shutdown()
    ns = sorted(rows)
    held = ns[-1]
    b, a = statistics.linear_regression(ns[:-1], [rows[n]["driver_cpu_ms"] for n in ns[:-1]])
    model = {"intercept_ms": a, "per_rank_ms": b, "fitted_on": ns[:-1], "held_back": held,
             "held_back_predicted_ms": a + b * held,
             "held_back_measured_ms": rows[held]["driver_cpu_ms"],
             "extrapolated_ms": {k: a + b * k for k in (1000, 10000)},
             "assumption": "each rank costs the driver the same CPU per step (one Ray call "
                           "out, one answer in) and nothing else grows with the ranks"}
    print(f"driver CPU per step = {a:.2f} ms + {b:.3f} ms x ranks (fitted on {ns[:-1]}); "
          f"at {held} ranks: predicted {a + b * held:.2f} ms, measured "
          f"{rows[held]['driver_cpu_ms']:.2f} ms; at 1,000 ranks {a + b * 1000:.0f} ms, "
          f"at 10,000 {a + b * 10000:.0f} ms (extrapolated)")
    figures = {"config": {"steps": args.steps, "protocol": "today's: a call per rank a step",
                          "model": "stand-in: embedding of width 1 and a head"},
               "rows": {f"ranks_{n}": {"ranks": n, **r} for n, r in rows.items()},
               "model": model}
    print(f"written to {write('bench_control_plane', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
