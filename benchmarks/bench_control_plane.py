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
up): how long the live ranks paused for the join. Under the ranks' protocol a second
timed run, each step sleeping ``--sleep_ms`` longer, splits the driver's CPU a step
into a part a step and a part a second of step (Ray's threads). For each protocol
(and each part) two shapes, a + b x N and a + b x log2 N, are fitted over the smaller
Ns and checked against the largest (held back), then extrapolated to 1,000 and 10,000
ranks (``--refit`` fits them again to a result file's rows).
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


def stand_in(sleep_s: float = 0.0):
    """A language model whose step costs next to nothing: an embedding of width 1 and a
    linear head over the built-in tokenizer's 4,096 tokens; ``sleep_s``: its forward
    also sleeps that long (a longer step at the same CPU)."""
    import time

    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(4096, 1), nn.Linear(1, 4096)

        def forward(self, input_ids):
            if sleep_s:
                time.sleep(sleep_s)
            return self.head(self.embed(input_ids))

    return Tiny()


class Calls:
    """The function calls (Python's and C's) of the thread that profiles with it
    (``sys.setprofile``): a count of its work that other processes on the cores cannot
    inflate as they inflate its CPU time."""

    def __init__(self):
        self.n = 0

    def __call__(self, frame, event, arg):
        if event in ("call", "c_call"):
            self.n += 1


class StepClock(logging.Handler):
    """The driver process's CPU, its logging thread's CPU (the driver's own loop) and the
    wall clock at each "step k/M" log line (the handler runs in the driver's thread as
    it logs; a callback would change the protocol: the driver sends no step ahead while
    one is due)."""

    LINE = re.compile(r"^step (\d+)/")
    SHRANK = re.compile(r"^shrank in memory to \d+ rank\(s\) \(generation \d+\) in "
                        r"([\d.]+) s \(detect and settle ([\d.]+) s, regroup ([\d.]+) s\)")
    GREW = re.compile(r"^grew in memory to \d+ rank\(s\) \(generation \d+\).*?paused "
                      r"([\d.]+) s")

    def __init__(self, count: bool = False):
        super().__init__(logging.INFO)
        self.marks = []  # (step, process CPU s, wall s, this thread's CPU s)
        # ``count``: the driver's thread's Calls from the second step line to the third
        self.calls = Calls() if count else None
        self.shrank = None  # a recovery's (whole, detect and settle, regroup) seconds
        self.grew = None  # how long a join paused the live ranks, seconds

    def emit(self, record):
        message = record.getMessage()
        m = self.LINE.match(message)
        if m:
            self.marks.append((int(m.group(1)), time.process_time(), time.perf_counter(),
                               time.thread_time()))
            if self.calls is not None and len(self.marks) in (2, 3):
                sys.setprofile(self.calls if len(self.marks) == 2 else None)
        m = self.SHRANK.match(message)
        if m:
            self.shrank = tuple(float(x) for x in m.groups())
        m = self.GREW.match(message)
        if m:
            self.grew = float(m.group(1))


def run(ranks: int, steps: int, play: str, cache: str, protocol: str,
        kill_at: int = 0, grow_to: int = 0, sleep_s: float = 0.0,
        count: bool = False) -> tuple:
    """One run of ``steps`` steps on ``ranks`` ranks (``kill_at``: the last rank dies
    before step ``kill_at``'s forward; ``grow_to``: one rank more may join: rank 0
    stalls in step 6, so that the driver finds the room, and in step LOG_EVERY + 1
    while the newcomer warms up; ``sleep_s``: the stand-in's forward sleeps; ``count``:
    StepClock's): (the StepClock, the history's per-step records)."""
    import functools

    from raylm import TrainConfig, train
    from raylm.runtime import faults

    clock = StepClock(count)
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
                step_protocol=protocol), model_init=functools.partial(stand_in, sleep_s))
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


def fit(ns: list, values: dict, assumption: str, label: str) -> dict:
    """Each form (FORMS) fitted to ``values`` on every N of ``ns`` but the largest, its
    prediction for that one (held back) and its extrapolation to 1,000 and 10,000 ranks;
    ``better``: the form whose held-back prediction was nearer."""
    held = ns[-1]
    forms = {}
    for form, (x, words) in FORMS.items():
        b, a = statistics.linear_regression([x(n) for n in ns[:-1]],
                                            [values[n] for n in ns[:-1]])
        forms[form] = {"shape": words, "intercept_ms": a, "slope_ms": b,
                       "held_back_predicted_ms": a + b * x(held),
                       "extrapolated_ms": {k: a + b * x(k) for k in (1000, 10000)}}
    better = min(forms, key=lambda f: abs(forms[f]["held_back_predicted_ms"] - values[held]))
    for m in forms.values():
        print(f"{label}, {m['shape']}: a = {m['intercept_ms']:.3f} ms, b = "
              f"{m['slope_ms']:.4f} ms (fitted on {ns[:-1]}); at {held} ranks predicted "
              f"{m['held_back_predicted_ms']:.2f} ms, measured {values[held]:.2f} ms; "
              f"extrapolated: 1,000 ranks {m['extrapolated_ms'][1000]:.1f} ms, 10,000 "
              f"{m['extrapolated_ms'][10000]:.1f} ms")
    return {"fitted_on": ns[:-1], "held_back": held, "held_back_measured_ms": values[held],
            "forms": forms, "better": better, "assumption": assumption}


SPLIT_ASSUMED = {
    "per_step_cpu_ms": "the driver's CPU a step that does not depend on how long the step "
                       "takes (reading rank 0's answer and its table of every rank's "
                       "figures, the record, the log)",
    "per_second_cpu_ms": "the driver's CPU a second of step whatever the steps (Ray's "
                         "threads; the ranks' protocol sends no heartbeat while answers "
                         "come on time)"}


def fit_models(rows: dict, protocols: list) -> dict:
    """Per protocol, FORMS fitted to the driver's CPU a step (``fit``); for a protocol
    measured at two step times, also to its part per step and its part per second
    (``split``)."""
    models = {}
    for protocol in protocols:
        ns = sorted(n for p, n in rows if p == protocol)
        if len(ns) < 3:
            continue
        models[protocol] = fit(ns, {n: rows[protocol, n]["driver_cpu_ms"] for n in ns},
                               ASSUMED[protocol], protocol)
        if all("per_step_cpu_ms" in rows[protocol, n] for n in ns):
            parts = {key: fit(ns, {n: rows[protocol, n][key] for n in ns},
                              SPLIT_ASSUMED[key], f"{protocol}, {key}")
                     for key in SPLIT_ASSUMED}
            models[protocol]["split"] = parts
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
    if "simulated" in figures:
        figures["simulated"].pop("at_1000_ranks_1s_step_ms", None)  # (an older form)
        at_1000(rows, figures["simulated"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def step_table(n: int):
    """Rank 0's answer under the ranks' protocol at ``n`` ranks: every rank's row of a
    step (raylm.runtime.protocol.StepTable), rank n // 3 the slowest."""
    from raylm.runtime.protocol import StepResult, StepTable

    return StepTable.of([StepResult(
        loss=2.5, tokens=8 * n, local_tokens=8, has_loss=True, learning_rate=1e-3,
        grad_norm=1.25, overflow=False, peak_rss_bytes=2**29 + r, data_wait_s=1e-4,
        forward_backward_s=0.5, grad_sync_s=0.1, clip_s=0.01, optimizer_s=0.02,
        step_s=0.7 + (0.2 if r == n // 3 else 0.0), boundary_idle_s=0.001,
        peer_wait_s=0.1) for r in range(n)])


def simulate(n: int, steps: int = 500) -> dict:
    """The driver's own work a step under the ranks' protocol at ``n`` ranks, without
    Ray: rank 0's answer unpickled (as Ray reads it) and recorded by the real Reporter
    (the record, the straggler check, the progress, the log window every LOG_EVERY
    steps), plus the step deadline's update. What it leaves out, Ray's receipt of the
    answer, ``receipt_ms`` measures; the measured part a step (``split``) holds both.
    Returns the CPU, the calls and the bytes the history grew by, a step."""
    import pickle
    import tracemalloc

    import numpy as np

    from raylm.config import TrainConfig
    from raylm.data.sampler import GlobalBatchSampler
    from raylm.models.loading import ModelSpec
    from raylm.plan.dims import ParallelDims
    from raylm.plan.layout import Plan
    from raylm.runtime.health import StepDeadline
    from raylm.runtime.metrics import MetricsLog, Progress
    from raylm.runtime.policy import RunRecord
    from raylm.runtime.reporting import Reporter

    out = tempfile.mkdtemp(prefix="bench-control-sim-")
    cfg = TrainConfig(train_file=["unused.txt"], output_dir=out, num_workers=n,
                      max_steps=2 * steps, logging_steps=LOG_EVERY, disable_tqdm=True)
    plan = Plan(ParallelDims(dp=n), micro_batch_size=1, global_batch_size=n,
                cpus_per_worker=0.5)
    sampler = GlobalBatchSampler(np.arange(2 * n * steps), n, seed=0)
    spec = ModelSpec(config=None, pretrained_path=None, tokenizer_dir=out, vocab_size=4096,
                     objective="clm")
    record = RunRecord(plan=plan)
    report = Reporter(cfg, record, MetricsLog(out), Progress(2 * steps, 0, True), 2 * steps,
                      spec, 8, out)
    deadline = StepDeadline(3.0, 60.0)
    answer = pickle.dumps(step_table(n), protocol=5)

    def steps_done() -> None:
        for _ in range(steps):
            table = pickle.loads(answer)
            record.step += 1
            deadline.add(0.7)
            report.step(table, table.loss_row(), 0.7, 0.0, None, None, False, sampler, plan)

    c0 = time.thread_time()  # (not Ray's threads, when it runs)
    steps_done()
    cpu = time.thread_time() - c0
    tracemalloc.start()  # (a second pass: tracing slows the first's clock)
    m0 = tracemalloc.get_traced_memory()[0]
    steps_done()
    grew = tracemalloc.get_traced_memory()[0] - m0
    tracemalloc.stop()
    calls = Calls()  # (a third pass: its function calls)
    sys.setprofile(calls)
    steps_done()
    sys.setprofile(None)
    return {"ranks": n, "cpu_ms": 1000 * cpu / steps, "history_bytes_a_step": grew / steps,
            "answer_bytes": len(answer), "calls_a_step": calls.n / steps}


def receipt_ms(n: int, answers: int = 300) -> float:
    """The driver's CPU to receive one of rank 0's answers at ``n`` ranks through Ray, as
    the driver does (a streaming generator of an actor, each answer got): a table of
    more than 100 KB (past 600 ranks) goes through the object store, not inline."""
    import ray

    @ray.remote(num_cpus=0.25)
    class Rank0:
        def answers(self, n: int, k: int):
            table = step_table(n)
            for _ in range(k):
                yield table

    actor = Rank0.remote()
    try:
        best = math.inf
        for _ in range(2):  # (the first warms up)
            c0 = time.process_time()
            for ref in actor.answers.options(num_returns="streaming").remote(n, answers):
                ray.get(ref)
            best = min(best, 1000 * (time.process_time() - c0) / answers)
        return best
    finally:
        ray.kill(actor)


def simulated(rows: dict, ns: list) -> dict:
    """``simulate`` and ``receipt_ms`` at each N (Ray running); beside each measured N of
    the ranks' protocol, what the measured part a step holds over the two (the driver's
    other Ray calls, and the CPU time the cores' other processes cost each call); and
    ``at_1000``."""
    sims = {n: {**simulate(n), "receipt_ms": receipt_ms(n)} for n in ns}
    left = {n: rows["ranks", n]["per_step_cpu_ms"] - sims[n]["cpu_ms"] - sims[n]["receipt_ms"]
            for n in ns if "per_step_cpu_ms" in rows.get(("ranks", n), {})}
    for n, sim in sims.items():
        print(f"simulated, {n} ranks: {sim['cpu_ms']:.3f} ms a step, the history "
              f"{sim['history_bytes_a_step']:,.0f} bytes a step, {sim['calls_a_step']:,.0f} "
              f"calls a step, rank 0's answer "
              f"{sim['answer_bytes']:,} bytes, received in {sim['receipt_ms']:.3f} ms"
              + (f"; measured a step {sim['cpu_ms'] + sim['receipt_ms'] + left[n]:.3f} ms"
                 if n in left else ""))
    out = {"rows": {str(n): sim for n, sim in sims.items()},
           "measured_over_simulated_ms": {str(n): ms for n, ms in left.items()}}
    return at_1000(rows, out)


def at_1000(rows: dict, sim: dict) -> dict:
    """The driver's CPU a step at 1,000 ranks and a step of 1 s, under the ranks'
    protocol: the simulated part a step and the answer's receipt at 1,000, plus the
    most any measured part a step held over the two, plus the largest part a second
    measured (it did not grow with the ranks measured; a fit of it extrapolates below
    zero)."""
    left = sim["measured_over_simulated_ms"]
    seconds = [r["per_second_cpu_ms"] for (p, _), r in rows.items()
               if p == "ranks" and "per_second_cpu_ms" in r]
    if left and seconds and "1000" in sim["rows"]:
        parts = {"simulated_a_step_ms": sim["rows"]["1000"]["cpu_ms"],
                 "receipt_ms": sim["rows"]["1000"].get("receipt_ms", 0.0),
                 "most_left_over_ms": max(left.values()),
                 "largest_part_a_second_ms": max(seconds)}
        sim["at_1000_ranks_1s_step"] = {**parts, "total_ms": sum(parts.values())}
        print("at 1,000 ranks and a 1 s step: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sim["at_1000_ranks_1s_step"].items()))
    return sim


def timed(clock: StepClock, history: list) -> dict:
    """A run's figures a step, from its second step line to its last (no start-up)."""
    (k0, c0, t0, m0), (k1, c1, t1, m1) = clock.marks[1], clock.marks[-1]
    idle = [h["boundary_idle_s"] for h in history[k0:k1]
            if h.get("boundary_idle_s") is not None]
    return {"driver_cpu_ms": 1000 * (c1 - c0) / (k1 - k0),
            "driver_loop_cpu_ms": 1000 * (m1 - m0) / (k1 - k0),
            "step_ms": 1000 * (t1 - t0) / (k1 - k0),
            "boundary_idle_ms": 1000 * statistics.median(idle) if idle else None,
            "steps_timed": k1 - k0}


def split(fast: dict, slow: dict) -> dict:
    """The driver's CPU a step, c = a + b x T, as a part a step (a) and a part a second
    of step (b), from two runs whose steps take T apart (the slow one's forward
    sleeps: the same work, a longer step)."""
    b = (slow["driver_cpu_ms"] - fast["driver_cpu_ms"]) / (slow["step_ms"] - fast["step_ms"])
    return {"slow_step_ms": slow["step_ms"], "slow_driver_cpu_ms": slow["driver_cpu_ms"],
            "per_step_cpu_ms": fast["driver_cpu_ms"] - b * fast["step_ms"],
            "per_second_cpu_ms": 1000 * b}


def measure(n: int, steps: int, play: str, cache: str, protocol: str,
            sleep_ms: float = 0.0) -> dict:
    """One protocol at ``n`` ranks: a timed run (and with ``sleep_ms`` one whose steps
    sleep that long more: ``split``), then (from 2 ranks) one that loses a rank and one
    of n - 1 ranks that one joins."""
    out = timed(*run(n, steps, play, cache, protocol))
    if sleep_ms:
        out.update(split(out, timed(*run(n, steps, play, cache, protocol,
                                         sleep_s=sleep_ms / 1000))))
        counted = run(n, 3 * LOG_EVERY, play, cache, protocol, count=True)[0]
        out["driver_calls_a_step"] = counted.calls.n / LOG_EVERY
    out["driver_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
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
    ap.add_argument("--sleep_ms", type=float, default=200.0,
                    help="a second timed run of the ranks' protocol, each step sleeping "
                         "this long more: the driver's CPU split into a part a step and a "
                         "part a second (0: none)")
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
                    rows[protocol, n] = r = measure(
                        n, args.steps, play, cache, protocol,
                        args.sleep_ms if protocol == "ranks" else 0.0)
                    print(f"{protocol:>8} {n:>5} {r['driver_cpu_ms']:>13.2f} ms "
                          f"{r['step_ms']:>7.2f} ms {(r['boundary_idle_ms'] or 0):>11.2f} ms "
                          f"{r['driver_peak_rss_bytes'] / 2**20:>7.0f} MiB "
                          + (f"{r['detect_settle_s']:>16.2f} s {r['regroup_s']:>7.2f} s"
                             if "regroup_s" in r else "")
                          + (f" {r['join_pause_s']:>10.2f} s" if r.get("join_pause_s")
                             else ""), flush=True)
                    if "per_step_cpu_ms" in r:
                        print(f"{'':>14} steps {args.sleep_ms:.0f} ms longer: "
                              f"{r['slow_step_ms']:.1f} ms, driver CPU "
                              f"{r['slow_driver_cpu_ms']:.2f} ms; so "
                              f"{r['per_step_cpu_ms']:.2f} ms a step + "
                              f"{r['per_second_cpu_ms']:.2f} ms a second; "
                              f"{r['driver_calls_a_step']:,.0f} calls a step", flush=True)
        sim = simulated(rows, sorted(set(args.ranks) | {1000, 10000}))
    finally:
        ray.shutdown()
    models = fit_models(rows, args.protocol)
    figures = {"config": {"steps": args.steps, "protocols": args.protocol,
                          "sleep_ms": args.sleep_ms,
                          "model": "stand-in: embedding of width 1 and a head"},
               "rows": {f"{p}_ranks_{n}": {"protocol": p, "ranks": n, **r}
                        for (p, n), r in rows.items()},
               "models": models,
               "simulated": sim}
    print(f"written to {write('bench_control_plane', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
