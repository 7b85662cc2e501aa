"""The driver's cost per step as the number of ranks grows, under both step protocols:
``driver`` (one Ray call to every rank and one answer from each, every step) and
``ranks`` (the ranks run the steps themselves and agree each commit; the driver reads
one answer a step, from rank 0).

    python benchmarks/bench_control_plane.py                  # 1-32 ranks, ~12 min here
    python benchmarks/bench_control_plane.py --ranks 2 4 8 --steps 100 --protocol ranks

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
driver's log; and a run of N - 1 ranks that a new rank joins (rank 0 stalls 1.5 s in
step 6, for the driver's look for room, and 12 s in step 26 while the newcomer warms
up): how long the live ranks paused for the join. For each protocol two shapes, a + b x N and a + b x log2 N, are fitted to the
driver's CPU per step over the smaller Ns and checked against the largest (held back),
then extrapolated to 1,000 and 10,000 ranks (``--refit`` fits them again to a result
file's rows).
Asserts nothing; writes benchmarks/results/bench_control_plane-<date>.json.
"""

from __future__ import annotations

import argparse
import logging
import math
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
    GREW = re.compile(r"^grew in memory to \d+ rank\(s\) \(generation \d+\).*?paused "
                      r"([\d.]+) s")

    def __init__(self):
        super().__init__(logging.INFO)
        self.marks = []  # (step, process CPU s, wall s)
        self.shrank = None  # a recovery's (whole, detect and settle, regroup) seconds
        self.grew = None  # how long a join paused the live ranks, seconds

    def emit(self, record):
        message = record.getMessage()
        m = self.LINE.match(message)
        if m:
            self.marks.append((int(m.group(1)), time.process_time(), time.perf_counter()))
        m = self.SHRANK.match(message)
        if m:
            self.shrank = tuple(float(x) for x in m.groups())
        m = self.GREW.match(message)
        if m:
            self.grew = float(m.group(1))


def run(ranks: int, steps: int, play: str, cache: str, protocol: str,
        kill_at: int = 0, grow_to: int = 0) -> tuple:
    """One run of ``steps`` steps on ``ranks`` ranks (``kill_at``: the last rank dies
    before step ``kill_at``'s forward; ``grow_to``: one rank more may join: rank 0
    stalls in step 6, so that the driver finds the room, and in step LOG_EVERY + 1
    while the newcomer warms up): (the StepClock, the history's
    per-step records)."""
    from raylm import TrainConfig, train
    from raylm.runtime import faults

    clock = StepClock()
    logger = logging.getLogger("raylm")
    logger.addHandler(clock)
    logger.setLevel(logging.INFO)  # (main's handler shows warnings only)
    kill = [{"rank": ranks - 1, "step": kill_at, "phase": "step"}] if kill_at else []
    if grow_to:  # (the driver looks for room between steps, once a second)
        kill += [{"rank": 0, "step": 5, "phase": "step", "action": "stall", "seconds": 1.5},
                 {"rank": 0, "step": LOG_EVERY, "phase": "step", "action": "stall",
                  "seconds": 12.0}]
    try:
        with faults.inject(*kill):
            result = train(TrainConfig(
                train_file=[play], block_size=8, data_cache_dir=cache,
                per_device_train_batch_size=1, max_steps=steps, num_workers=ranks,
                max_workers=grow_to, cpus_per_worker=min(0.5, 1.5 / (grow_to or ranks)),
                output_dir=tempfile.mkdtemp(prefix="bench-control-"),
                overwrite_output_dir=True, logging_steps=LOG_EVERY, save_strategy="no",
                do_eval=False, report_to=["none"], disable_tqdm=True,
                step_protocol=protocol), model_init=stand_in)
    finally:
        logger.removeHandler(clock)
    return clock, result.history


FORMS = {  # the shapes fitted to the driver's CPU a step against the ranks N
    "linear": (lambda n: n, "a + b x N"),
    "log": (lambda n: math.log2(n), "a + b x log2 N"),
}
ASSUMED = {
    "driver": "each rank costs the driver the same CPU per step (one Ray call out, one "
              "answer in) and nothing else grows with the ranks",
    "ranks": "the driver reads one answer a step whatever the ranks; what grows with them "
             "is that answer's table of every rank's figures, read in array operations, "
             "and here the step time, which the driver's Ray threads spend CPU through"}


def fit_models(rows: dict, protocols: list) -> dict:
    """Per protocol and form (FORMS): the line fitted on every N but the largest, its
    prediction for that one (held back), and its extrapolation to 1,000 and 10,000
    ranks; ``better``: the form whose held-back prediction was nearer."""
    models = {}
    for protocol in protocols:
        ns = sorted(n for p, n in rows if p == protocol)
        if len(ns) < 3:
            continue
        held = ns[-1]
        cpu = {n: rows[protocol, n]["driver_cpu_ms"] for n in ns}
        forms = {}
        for form, (x, words) in FORMS.items():
            b, a = statistics.linear_regression([x(n) for n in ns[:-1]],
                                                [cpu[n] for n in ns[:-1]])
            forms[form] = {"shape": words, "intercept_ms": a, "slope_ms": b,
                           "held_back_predicted_ms": a + b * x(held),
                           "extrapolated_ms": {k: a + b * x(k) for k in (1000, 10000)}}
        better = min(forms, key=lambda f: abs(forms[f]["held_back_predicted_ms"] - cpu[held]))
        models[protocol] = {"fitted_on": ns[:-1], "held_back": held,
                            "held_back_measured_ms": cpu[held], "forms": forms,
                            "better": better, "assumption": ASSUMED[protocol]}
        for form, m in forms.items():
            print(f"{protocol}, {m['shape']}: a = {m['intercept_ms']:.3f} ms, b = "
                  f"{m['slope_ms']:.4f} ms (fitted on {ns[:-1]}); at {held} ranks predicted "
                  f"{m['held_back_predicted_ms']:.2f} ms, measured {cpu[held]:.2f} ms; "
                  f"extrapolated: 1,000 ranks {m['extrapolated_ms'][1000]:.1f} ms, 10,000 "
                  f"{m['extrapolated_ms'][10000]:.1f} ms")
    return models


def refit(path: str) -> str:
    """Fit the models again to a result file's measured rows; its date, commit and
    machine are kept (they say when and where the rows were measured)."""
    import json

    with open(path) as f:
        result = json.load(f)
    figures = result["figures"]
    rows = {(r["protocol"], r["ranks"]): r for r in figures["rows"].values()}
    figures["models"] = fit_models(rows, figures["config"]["protocols"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def measure(n: int, steps: int, play: str, cache: str, protocol: str) -> dict:
    """One protocol at ``n`` ranks: a timed run, then (from 2 ranks) one that loses a
    rank and one of n - 1 ranks that one joins."""
    clock, history = run(n, steps, play, cache, protocol)
    (k0, c0, t0), (k1, c1, t1) = clock.marks[1], clock.marks[-1]  # (2nd line on)
    idle = [h["boundary_idle_s"] for h in history[k0:k1]
            if h.get("boundary_idle_s") is not None]
    out = {"driver_cpu_ms": 1000 * (c1 - c0) / (k1 - k0), "step_ms": 1000 * (t1 - t0) / (k1 - k0),
           "boundary_idle_ms": 1000 * statistics.median(idle) if idle else None,
           "steps_timed": k1 - k0,
           "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if n > 1:  # a rank killed: the survivors carry on in memory
        shrank = run(n, 2 * LOG_EVERY, play, cache, protocol, kill_at=LOG_EVERY)[0].shrank
        if shrank:
            out.update(zip(("recovery_s", "detect_settle_s", "regroup_s"), shrank))
        # a rank joins n - 1: how long the live ranks pause for it
        # (steps enough after the stall for the ranks' protocol, whose ranks run on
        # while the driver asks rank 0 to stop)
        out["join_pause_s"] = run(n - 1, 4 * LOG_EVERY, play, cache, protocol,
                                  grow_to=n)[0].grew
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=300, help="steps of each timed run")
    ap.add_argument("--protocol", nargs="+", choices=("driver", "ranks"),
                    default=["driver", "ranks"], help="the step protocols to measure")
    ap.add_argument("--refit", metavar="RESULT_FILE",
                    help="fit the models again to a result file's rows, measuring nothing")
    args = ap.parse_args(argv)
    if args.refit:
        print(f"written to {refit(args.refit)}")
        return 0

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
        print(f"{'protocol':>8} {'ranks':>5} {'driver CPU/step':>16} {'step':>10} "
              f"{'boundary idle':>14} {'driver RSS':>11} {'rank lost: settle':>18} "
              f"{'regroup':>9} {'join: pause':>12}")
        with keep_ranks():
            for n in args.ranks:
                run(n, 2, play, cache, "driver")  # (starts the ranks; the first tokenizes)
                for protocol in args.protocol:
                    rows[protocol, n] = r = measure(n, args.steps, play, cache, protocol)
                    print(f"{protocol:>8} {n:>5} {r['driver_cpu_ms']:>13.2f} ms "
                          f"{r['step_ms']:>7.2f} ms {(r['boundary_idle_ms'] or 0):>11.2f} ms "
                          f"{r['driver_peak_rss_bytes'] / 2**20:>7.0f} MiB "
                          + (f"{r['detect_settle_s']:>16.2f} s {r['regroup_s']:>7.2f} s"
                             if "regroup_s" in r else "")
                          + (f" {r['join_pause_s']:>10.2f} s" if r.get("join_pause_s")
                             else ""), flush=True)
    finally:
        ray.shutdown()
    models = fit_models(rows, args.protocol)
    figures = {"config": {"steps": args.steps, "protocols": args.protocol,
                          "model": "stand-in: embedding of width 1 and a head"},
               "rows": {f"{p}_ranks_{n}": {"protocol": p, "ranks": n, **r}
                        for (p, n), r in rows.items()},
               "models": models}
    print(f"written to {write('bench_control_plane', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
