"""raylm's elastic recovery, measured: a rank killed mid-run, then room for it again.

    python benchmarks/bench_elastic.py            # GPT-2 2 x 128, block 64, 3 ranks, 400 steps
    python benchmarks/bench_elastic.py --quick    # smaller, ~1 min

One run of 3 data-parallel rank actors (1 CPU each of Ray's 4 logical CPUs on this
machine) with a fault-free twin for reference:

* rank 1 is killed (SIGKILL by pid) when step --kill_at ends; the survivors carry on in
  memory (raylm.runtime.driver: leave the group, regroup in a new generation, the failed
  step runs again): reported are kill -> next committed step, split as the driver logs it
  (detect and settle, regroup, then the first step under the new layout), and the
  committed steps redone;
* from step --grow_from on, the driver looks for room at every step boundary: the freed
  CPU lets a new rank start, warm up while the others train, and join at a step boundary
  with a live replica's state: reported are room seen -> joined (warm-up, off the critical
  path) and the live ranks' pause;
* the losses of the elastic run against the fault-free twin (they must agree to 1e-5);
* the fault-free cost of the step-boundary protocol: each step the ranks report how long
  they idled between returning the step and starting the next, less the calls run in
  between (the commit); the rank that answered last idled least, and that is the cost.

Then, on a two-node cluster (ray.cluster_utils.Cluster, two 2-CPU nodes, both on this
machine; snapshots keep a copy on another node):

* dp=2 x pp=2: the last rank dies after its gradient sync; the survivors export their
  state to the object store and are re-laid out (re-planned to dp=1 x pp=2, each reading
  its stage from a live copy): kill -> next committed step, as the driver splits it;
* snapshots: the fault-free step time of 3 data-parallel ranks at ZeRO-1 with
  --snapshot_steps 1 and 10 against none (the overhead), and a ZeRO-1 run that loses a
  rank (no live copy of its optimizer partition) and restores from the keepers'
  snapshot: kill -> next committed step and steps redone;
* Ray Train v2 side by side: benchmarks/raytrain_elastic.py in a subprocess, same model
  (--n_layer 2) and machine (TorchTrainer, FailureConfig, ScalingConfig(num_workers=(2,
  3))): kill -> next committed step, node join -> carrying work, steps redone.

Quiet failures (``--quiet_only`` for just these; raylm.runtime.health, default settings):
a rank frozen with SIGSTOP (alive, sockets open) when step --kill_at ends: freeze -> next
committed step, split into detect (the heartbeat's silence), release and settle, regroup
and the first step; the fault-free cost of the heartbeats and the step deadline (the
median step with them against a run whose heartbeat never comes due); a node cut off
(every process of a 1-rank node of a three-node Cluster frozen, its raylet too, then
thawed 10 s later: the same split, and thaw -> grown back); and Ray Train v2 with a
frozen worker (benchmarks/raytrain_elastic.py --fault freeze). Written to
benchmarks/results/bench_elastic_quiet-<date>.json.

``--soak_minutes N``: N minutes of 3 ranks with a rank killed every minute (a newcomer
takes its place): goodput = fault-free step time x steps committed / wall time, from the
first step (``--soak_only``: just that, after 60 fault-free steps for the step time).

Prints tables; asserts nothing. Each part is written to benchmarks/results/: bench_elastic,
bench_elastic_quiet, bench_elastic_two_nodes, bench_elastic_raytrain and bench_elastic_soak
(-<date>.json; NAME-quick-<date>.json with --quick).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from raylm.runtime.cluster import start_local  # noqa: E402  (as `raylm train` starts Ray)


class Watch:
    def __init__(self, kill_at, grow_from):
        self.kill_at, self.grow_from = kill_at, grow_from
        self.ends, self.kill_time, self.grown_at = {}, None, None

    def on_step_end(self, driver, step, record):
        now = time.time()
        self.ends[step] = now
        driver.grow_check_s = 0.0 if step >= self.grow_from else 3600.0
        if step == self.kill_at and self.kill_time is None:
            self.kill_time = time.time()
            os.kill(driver.worker_pids[1], signal.SIGKILL)
        if self.grown_at is None and driver.record.plan.world_size == 3 and \
                self.kill_time is not None and step > self.kill_at:
            self.grown_at = step


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.created, record.getMessage()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill_at", type=int, default=15)
    ap.add_argument("--grow_from", type=int, default=25)
    ap.add_argument("--soak_minutes", type=float, default=0.0)
    ap.add_argument("--soak_only", action="store_true",
                    help="only the soak (after 60 fault-free steps for the step time)")
    ap.add_argument("--skip_ray_train", action="store_true")
    ap.add_argument("--two_nodes_only", action="store_true",
                    help="only the two-node part (re-layout, snapshots)")
    ap.add_argument("--quiet_only", action="store_true",
                    help="only the quiet failures (a frozen rank; the watches' cost)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.kill_at, args.grow_from = 250, 8, 12
    import numpy as np
    import ray

    from raylm import TrainConfig, train

    size = "n_layer=2,n_embd=64,n_head=2" if args.quick else "n_layer=2,n_embd=128,n_head=4"
    work = tempfile.mkdtemp(prefix="raylm-bench-elastic-")
    corpus = os.path.join(REPO, "..", "shared", "data", "shakespeare")

    def cfg(name, **kw):
        base = dict(model_type="gpt2", config_overrides=f"{size},n_positions=64",
                    train_file=[corpus], block_size=64,
                    data_cache_dir=os.path.join(work, "cache"),
                    output_dir=os.path.join(work, name), max_steps=args.steps,
                    save_steps=10**6, logging_steps=10**6, disable_tqdm=True,
                    learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                    per_device_train_batch_size=4, gradient_accumulation_steps=1,
                    do_eval=False)
        base.update(kw)
        return TrainConfig(**base)

    lines = Lines()
    logging.getLogger("raylm").addHandler(lines)
    logging.getLogger("raylm").setLevel(logging.INFO)
    if args.two_nodes_only:
        two_nodes(args, cfg, lines)
        return
    if args.quiet_only:
        quiet(args, cfg, lines)
        return
    if args.soak_only:
        start_local(num_cpus=4, log_to_driver=False)
        try:
            base = train(cfg("fault-free", max_steps=60))
        finally:
            ray.shutdown()
        soak(args, cfg, np.median([h["step_time_s"] for h in base.history[5:]]))
        return
    start_local(num_cpus=4, log_to_driver=False)
    try:
        base = train(cfg("fault-free"))
        watch = Watch(args.kill_at, args.grow_from)
        hit = train(cfg("elastic"), callbacks=(watch,))
    finally:
        ray.shutdown()
    a = np.array([h["loss"] for h in base.history])
    b = np.array([h["loss"] for h in hit.history])
    shrink = next(m for _, m in lines.lines if m.startswith("shrank in memory"))
    detect, regroup = map(float, re.search(r"detect and settle ([\d.]+) s, regroup ([\d.]+) s",
                                           shrink).groups())
    room = next(t for t, m in lines.lines if m.startswith("capacity for"))
    grew_t, grew = next((t, m) for t, m in lines.lines if m.startswith("grew in memory"))
    pause = float(re.search(r"paused ([\d.]+) s", grew).group(1))
    step_s = np.median([h["step_time_s"] for h in base.history[5:]])
    idle = np.median([h["boundary_idle_s"] for h in base.history[5:]])
    after_kill = watch.ends[args.kill_at + 1] - watch.kill_time
    print()
    print(f"| what | raylm ({hit.metrics['world_size']} ranks at the end) |")
    print("| --- | --- |")
    print(f"| fault-free step (median) | {step_s * 1000:.0f} ms |")
    print(f"| of which the step boundary (median; the ranks idle while the driver gathers "
          f"their answers and sends the commit and the next step) | {idle * 1000:.1f} ms "
          f"({idle / step_s:.1%}) |")
    print(f"| kill -> next committed step | {after_kill:.2f} s (detect and settle "
          f"{detect:.2f} s, regroup {regroup:.2f} s, then the step under dp=2) |")
    print("| committed steps redone | 0 (no checkpoint read) |")
    print(f"| room seen -> joined (warm-up, training went on) | {grew_t - room:.2f} s |")
    print(f"| live ranks' pause for the join (regroup + state) | {pause:.2f} s |")
    rel = np.abs(a - b) / np.abs(a)
    sizes = [h["world_size"] for h in hit.history]
    grown = next(i for i in range(args.kill_at, len(sizes)) if sizes[i] == 3)
    print(f"| losses vs the fault-free run, max relative: up to the kill / at dp=2 / "
          f"the first 10 steps after the join / to the end | "
          f"{rel[:args.kill_at].max():.1e} / {rel[args.kill_at:grown].max():.1e} / "
          f"{rel[grown:grown + 10].max():.1e} / {rel.max():.1e} |")
    print(f"| steps at 3 / 2 / 3 ranks | {args.kill_at} / {grown - args.kill_at} / "
          f"{len(sizes) - grown} |")
    from benchmarks.results import write

    figures = {
        "config": {"model": f"gpt2 {size}", "block_size": 64, "ranks": 3,
                   "steps": args.steps, "kill_at": args.kill_at, "grow_from": args.grow_from,
                   "quick": args.quick},
        "step_s": float(step_s), "boundary_idle_s": float(idle),
        "boundary_share": float(idle / step_s), "kill_to_next_step_s": after_kill,
        "detect_and_settle_s": detect, "regroup_s": regroup, "steps_redone": 0,
        "room_seen_to_joined_s": grew_t - room, "join_pause_s": pause,
        "max_rel_loss_diff": {"to_the_kill": float(rel[:args.kill_at].max()),
                              "at_dp2": float(rel[args.kill_at:grown].max()),
                              "10_steps_after_the_join": float(rel[grown:grown + 10].max()),
                              "to_the_end": float(rel.max())},
        "steps_at": {"3_ranks_before": args.kill_at, "2_ranks": grown - args.kill_at,
                     "3_ranks_after": len(sizes) - grown},
        "world_size_at_end": hit.metrics["world_size"]}
    print("written to", write("bench_elastic" + ("-quick" if args.quick else ""), figures))
    if args.soak_minutes:
        soak(args, cfg, step_s)
    quiet(args, cfg, lines)
    two_nodes(args, cfg, lines)
    if not args.skip_ray_train:
        ray_train_side_by_side(args)


class SoakOver(Exception):
    pass


def soak(args, cfg, step_s) -> None:
    """N minutes of 3 ranks, a rank killed every minute and replaced by a newcomer."""
    import ray

    from raylm import train

    class Killer:
        def __init__(self):
            self.t0, self.kills, self.last, self.steps = time.time(), 0, time.time(), 0

        def on_step_end(self, driver, step, record):
            driver.grow_check_s = 0.0
            if step == 1:  # from the first step: start-up is not the soak's
                self.t0 = self.last = time.time()
            self.steps = step
            if time.time() - self.last >= 60 and driver.record.plan.world_size == 3:
                os.kill(driver.worker_pids[1 + self.kills % 2], signal.SIGKILL)
                self.kills, self.last = self.kills + 1, time.time()
            if time.time() - self.t0 >= args.soak_minutes * 60:
                raise SoakOver()

    start_local(num_cpus=4, log_to_driver=False)
    killer = Killer()
    try:
        train(cfg("soak", max_steps=10**7, max_failures=10**6), callbacks=(killer,))
    except SoakOver:
        pass
    finally:
        ray.shutdown()
    wall = time.time() - killer.t0
    print()
    print(f"| soak: {args.soak_minutes:g} min, {killer.kills} kill(s) | {killer.steps - 1} steps "
          f"committed; goodput {(killer.steps - 1) * step_s / wall:.1%} (fault-free step "
          f"{step_s * 1000:.0f} ms) |")
    from benchmarks.results import write

    figures = {"minutes": args.soak_minutes, "kills": killer.kills,
               "steps_committed": killer.steps - 1, "wall_s": wall,
               "fault_free_step_s": float(step_s),
               "goodput": (killer.steps - 1) * step_s / wall, "quick": args.quick}
    print("written to", write("bench_elastic_soak" + ("-quick" if args.quick else ""), figures))


def quiet(args, cfg, lines) -> None:
    """A frozen rank, and what watching for one costs a fault-free step."""
    import numpy as np
    import ray

    from raylm import train
    from benchmarks.results import write

    class Freeze:
        def __init__(self, at):
            self.at, self.t, self.ends = at, None, {}

        def on_step_end(self, driver, step, record):
            self.ends[step] = time.time()
            driver.grow_check_s = 3600.0
            if step == self.at and self.t is None:
                self.t = time.time()
                os.kill(driver.worker_pids[1], signal.SIGSTOP)

    n = min(args.steps, 150)
    start_local(num_cpus=4, log_to_driver=False)
    try:
        # Two pairs after a warm-up run, in alternating order (runs differ by several %
        # here): the median of each kind's step medians.
        off = dict(heartbeat_interval_s=3600.0, heartbeat_timeout_s=7200.0,
                   step_deadline_floor_s=3600.0)
        runs = {"watched": [], "unwatched": []}
        train(cfg("quiet-warm-up", max_steps=n // 3))  # (the first run here is slower)
        for order in ((("watched", {}), ("unwatched", off)),
                      (("unwatched", off), ("watched", {}))):
            for name, kw in order:
                r = train(cfg(f"quiet-{name}-{len(runs[name])}", max_steps=n, **kw))
                runs[name].append(np.median([h["step_time_s"] for h in r.history[5:]]))
        steps = {k: float(np.median(v)) for k, v in runs.items()}
        print("fault-free step medians (ms): " + ", ".join(
            f"{k} {' '.join(f'{x * 1000:.1f}' for x in v)}" for k, v in runs.items()))
        del lines.lines[:]
        freeze = Freeze(args.kill_at)
        hit = train(cfg("quiet-frozen", max_steps=n), callbacks=(freeze,))
    finally:
        ray.shutdown()
    lost_t = next(t for t, m in lines.lines if m.startswith("ending rank 1"))
    shrink_t, shrink = next((t, m) for t, m in lines.lines
                            if m.startswith("shrank in memory"))
    settle, regroup = map(float, re.search(
        r"detect and settle ([\d.]+) s, regroup ([\d.]+) s", shrink).groups())
    next_step = min(t for t in freeze.ends.values() if t > freeze.t)
    figures = {
        "step_s_watched": steps["watched"], "step_s_unwatched": steps["unwatched"],
        "watch_overhead": steps["watched"] / steps["unwatched"] - 1,
        "step_s_runs": {k: [float(x) for x in v] for k, v in runs.items()},
        "freeze_to_next_step_s": next_step - freeze.t,
        "detect_s": lost_t - freeze.t, "release_and_settle_s": settle,
        "regroup_s": regroup, "first_step_s": next_step - shrink_t,
        "steps_redone": 0, "failures": hit.failures,
        "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 5.0}
    print()
    print("| quiet failures (default settings) | raylm |")
    print("| --- | --- |")
    print(f"| rank frozen (SIGSTOP) -> next committed step | "
          f"{figures['freeze_to_next_step_s']:.2f} s (detect {figures['detect_s']:.2f} s, "
          f"release and settle {settle:.2f} s, regroup {regroup:.2f} s, first step "
          f"{figures['first_step_s']:.2f} s) |")
    print(f"| fault-free step, watched vs unwatched (median) | {steps['watched'] * 1000:.1f} "
          f"ms vs {steps['unwatched'] * 1000:.1f} ms ({figures['watch_overhead']:+.1%}) |")
    figures["node_cut_off"] = cut_off(args, cfg, lines)
    if not args.skip_ray_train:
        figures["ray_train_frozen"] = ray_train_frozen(args)
    figures["quick"] = args.quick
    print("written to", write("bench_elastic_quiet" + ("-quick" if args.quick else ""), figures))


def cut_off(args, cfg, lines) -> dict:
    """A node cut off: every process of a node (its raylet, its rank) frozen at once, so
    that nothing there answers Ray either; default raylm settings. Thawed a few steps
    later: the run grows back onto it."""
    import ray

    from raylm import train

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from multinode_common import descendants, start_cluster  # noqa: E402

    class Cut:
        def __init__(self, cluster, at):
            self.cluster, self.at, self.t, self.thawed = cluster, at, None, None
            self.frozen = []
            self.ends, self.rank = {}, None

        def on_step_end(self, driver, step, record):
            self.ends[step] = time.time()
            driver.grow_check_s = 0.0
            info = driver.worker_info
            if step == self.at and self.t is None:
                self.rank = next(r for r, i in enumerate(info) if sum(
                    j["node_id"] == i["node_id"] for j in info) == 1)
                [node] = [n for n in self.cluster.worker_nodes
                          if n.node_id == info[self.rank]["node_id"]]
                self.frozen = descendants(node.all_processes["raylet"][0].process.pid)
                self.t = time.time()
                for pid in self.frozen:
                    os.kill(pid, signal.SIGSTOP)
            elif self.t is not None and self.thawed is None and \
                    driver.record.plan.world_size == 2 and time.time() - self.t > 10:
                for pid in self.frozen:
                    os.kill(pid, signal.SIGCONT)
                self.thawed = time.time()
            elif self.t is not None and self.thawed is None:
                time.sleep(0.1)  # (steps of a real size while the node is away)

    # Ray's own health checks at its defaults (a node is declared dead after about 15
    # s of silence), raylm's at its defaults.
    cluster = start_cluster(workers=1, cpus=2, health_check_period_ms=3000,
                            health_check_failure_threshold=5, health_check_timeout_ms=10000)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    cut = Cut(cluster, args.kill_at)
    try:
        del lines.lines[:]
        hit = train(cfg("node-cut-off", max_steps=min(args.steps, 150)), callbacks=(cut,))
    finally:
        for pid in cut.frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        ray.shutdown()
        cluster.shutdown()
    lost_t = next(t for t, m in lines.lines if m.startswith("ending rank"))
    shrink_t, shrink = next((t, m) for t, m in lines.lines
                            if m.startswith("shrank in memory"))
    settle, regroup = map(float, re.search(
        r"detect and settle ([\d.]+) s, regroup ([\d.]+) s", shrink).groups())
    next_step = min(t for t in cut.ends.values() if t > cut.t)
    back = next((t for t, m in lines.lines if "answers again" in m), None)
    grew = next((t for t, m in lines.lines if m.startswith("grew in memory")), None)
    out = {"freeze_to_next_step_s": next_step - cut.t, "detect_s": lost_t - cut.t,
           "release_and_settle_s": settle, "regroup_s": regroup,
           "first_step_s": next_step - shrink_t, "failures": hit.failures,
           "thaw_to_answers_again_s": back - cut.thawed if back and cut.thawed else None,
           "thaw_to_grown_s": grew - cut.thawed if grew and cut.thawed else None,
           "world_size_at_end": hit.metrics["world_size"]}
    print(f"| node cut off (raylet and rank frozen) -> next committed step | "
          f"{out['freeze_to_next_step_s']:.2f} s (detect {out['detect_s']:.2f} s, release "
          f"and settle {settle:.2f} s, regroup {regroup:.2f} s, first step "
          f"{out['first_step_s']:.2f} s); thawed -> grown back "
          f"{out['thaw_to_grown_s'] or float('nan'):.2f} s |")
    return out


def ray_train_frozen(args) -> dict:
    """benchmarks/raytrain_elastic.py --fault freeze, same model, its worker health check
    timeout set to raylm's heartbeat timeout (5 s; Ray's default is far longer)."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "raytrain_elastic.py"),
           "--n_layer", "2", "--fault", "freeze", "--health_timeout_s", "5", "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    got = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not got:
        print("Ray Train v2 run failed:", proc.stderr[-2000:])
        return {}
    r = json.loads(got[-1][len("RESULT "):])
    out = {k: r.get(k) for k in ("kill_to_step_s", "kill_detect_s", "kill_restart_group_s",
                                 "kill_imports_model_ckpt_ddp_s", "kill_first_step_s",
                                 "kill_steps_redone", "worker_health_check_timeout_s",
                                 "worker_health_check_timeout_s_default")}
    print(f"| Ray Train v2, a worker frozen, health check timeout "
          f"{out['worker_health_check_timeout_s']:g} s (default "
          f"{out['worker_health_check_timeout_s_default']:g} s) -> next committed step | "
          f"{out['kill_to_step_s']} s (detected {out['kill_detect_s']} s); steps redone "
          f"{out['kill_steps_redone']} |")
    return out


def two_nodes(args, cfg, lines) -> None:
    """A pipeline layout re-laid out in memory; snapshots' overhead and a restore."""
    import numpy as np
    import ray
    from ray.cluster_utils import Cluster

    from raylm import train

    class Kill:
        def __init__(self, rank, at):
            self.rank, self.at, self.t, self.ends = rank, at, None, {}

        def on_step_end(self, driver, step, record):
            self.ends[step] = time.time()
            driver.grow_check_s = 3600.0
            if step == self.at and self.t is None:
                time.sleep(2.0)  # the keepers take the last snapshot meanwhile
                self.t = time.time()
                os.kill(driver.worker_pids[self.rank], signal.SIGKILL)

    def after(kill):  # kill -> the end of the first step committed after it
        return min(t for t in kill.ends.values() if t > kill.t) - kill.t

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    n = min(args.steps, 120)
    try:
        del lines.lines[:]
        pp_kill = Kill(3, args.kill_at)
        train(cfg("pp", num_workers=4, pp=2, max_steps=n, gradient_accumulation_steps=2),
              callbacks=(pp_kill,))
        relaid = next(m for _, m in lines.lines if m.startswith("re-laid out in memory"))
        times = {}
        for every in (0, 10, 1):
            r = train(cfg(f"zero1-snap{every}", zero_stage=1, max_steps=n,
                          snapshot_steps=every))
            times[every] = (np.median([h["step_time_s"] for h in r.history[5:]]),
                            np.median([h["snapshot_s"] for h in r.history[5:]]))
        del lines.lines[:]
        snap_kill = Kill(1, args.kill_at)
        train(cfg("zero1-restore", zero_stage=1, max_steps=n, snapshot_steps=5),
              callbacks=(snap_kill,))
        restored = next((m for _, m in lines.lines if m.startswith("restored the snapshot")),
                        "no snapshot restored")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print()
    print("| two nodes | raylm |")
    print("| --- | --- |")
    print(f"| dp=2 x pp=2, rank 3 killed: kill -> next committed step | "
          f"{after(pp_kill):.2f} s; {relaid} |")
    base = times[0][0]
    for every in (10, 1):
        print(f"| ZeRO-1, 3 ranks, --snapshot_steps {every}: fault-free step (median) | "
              f"{times[every][0] * 1000:.0f} ms vs {base * 1000:.0f} ms without "
              f"({times[every][0] / base - 1:+.1%}); the ranks' wait for snapshots "
              f"{times[every][1] * 1000:.0f} ms per step |")
    print(f"| ZeRO-1 rank killed, --snapshot_steps 5: kill -> next committed step | "
          f"{after(snap_kill):.2f} s; {restored} |")
    from benchmarks.results import write

    figures = {
        "dp2_pp2_kill_to_next_step_s": after(pp_kill), "dp2_pp2_relaid": relaid,
        "snapshots": {f"every {every}" if every else "none": {
            "step_s": float(times[every][0]), "snapshot_wait_s": float(times[every][1]),
            "vs_none": float(times[every][0] / base)} for every in (0, 10, 1)},
        "zero1_restore_kill_to_next_step_s": after(snap_kill), "zero1_restored": restored,
        "steps": n, "quick": args.quick}
    print("written to", write("bench_elastic_two_nodes" + ("-quick" if args.quick else ""),
                              figures))


def ray_train_side_by_side(args) -> None:
    """benchmarks/raytrain_elastic.py, same model, in its own process."""
    import json
    import subprocess

    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "raytrain_elastic.py"),
           "--n_layer", "2"] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        print("Ray Train v2 run failed:", proc.stderr[-2000:])
        return
    r = json.loads(lines[-1][len("RESULT "):])
    print()
    print("| Ray Train v2, same model | |")
    print("| --- | --- |")
    print(f"| kill -> next committed step | {r.get('kill_to_step_s')} s; steps redone "
          f"{r.get('kill_steps_redone')} |")
    print(f"| node join -> carrying work | {r.get('join_to_step_s')} s; steps redone "
          f"{r.get('join_steps_redone')} |")
    print(f"| steady-state step at 3 workers (median) | {r.get('step_s_world3_median')} s |")
    from benchmarks.results import write

    figures = {k: r.get(k) for k in ("kill_to_step_s", "kill_steps_redone", "join_to_step_s",
                                     "join_steps_redone", "step_s_world3_median")}
    figures["quick"] = args.quick
    print("written to", write("bench_elastic_raytrain" + ("-quick" if args.quick else ""), figures))


if __name__ == "__main__":
    main()
