"""What Ray's own processes take while a rank trains: the CPU time of every process of a
local Ray cluster over a window in which one actor (a stand-in rank) sits in a call,
for a cluster started with Ray's defaults and for one started as raylm starts its own
(``raylm.runtime.cluster.start_local``), each in a fresh process, alternating. First a
small Ray Data pipeline runs, as tokenizing does before training (``--no_data``: not),
and in raylm's case Ray Data's idle actors are then stopped, as its driver does.

    python benchmarks/bench_ray_idle.py                  # 2 rounds of 20 s each
    python benchmarks/bench_ray_idle.py --window 30 --rounds 3

On a machine whose cores the ranks fill, this CPU time comes out of the step. Asserts
nothing; prints each process's share of one core and the totals.

The figures are written to benchmarks/results/bench_ray_idle-<date>.json
(-no_data with --no_data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def measure(mode: str, window: float, data: bool) -> dict:
    """In this process: start Ray (``mode`` 'ray-defaults' or 'raylm'), with ``data`` run
    a small Ray Data pipeline, then one actor asleep in a call, and each Ray process's CPU
    seconds over ``window`` seconds."""
    import logging

    import psutil
    import ray

    if mode == "raylm":
        from raylm.runtime.cluster import start_local, stop_ray_data_actors
        start_local(num_cpus=2, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
    if data:  # a Ray Data pipeline first, as tokenizing runs one before training
        ray.data.range(64).map(lambda r: {"x": r["id"] * 2}).materialize()
        if mode == "raylm":
            stop_ray_data_actors()  # as the driver does once its data are ready

    @ray.remote(num_cpus=1)
    class Rank:
        def pid(self):
            return os.getpid()

        def sleep(self, s):
            time.sleep(s)
            return s

    try:
        rank = Rank.remote()
        rank_pid = ray.get(rank.pid.remote())
        time.sleep(5)  # past the start-up of every process
        me = os.getpid()
        procs = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if p.pid == me or ("ray" in cmd and os.path.basename(__file__) not in cmd):
                    procs[p.pid] = (p, cmd, sum(p.cpu_times()[:2]))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        ray.get(rank.sleep.remote(window))
        shares = {}
        for pid, (p, cmd, t0) in procs.items():
            try:
                dt = sum(p.cpu_times()[:2]) - t0
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            name = _name(cmd, pid == me, pid == rank_pid)
            shares[name] = shares.get(name, 0.0) + 100 * dt / window
        return {"mode": mode, "shares": shares}
    finally:
        ray.shutdown()


def _name(cmd: str, driver: bool, rank: bool) -> str:
    if driver:
        return "driver"
    if rank:
        return "rank actor"
    for key, name in (("gcs_server", "GCS"), ("raylet/raylet", "raylet"),
                      ("log_monitor", "log monitor"), ("monitor.py", "autoscaler monitor"),
                      ("dashboard.py", "dashboard head"), ("DashboardAgent", "dashboard agent"),
                      ("RuntimeEnvAgent", "runtime env agent"), ("ray::IDLE", "idle worker"),
                      ("_StatsActor", "Ray Data stats actor"),
                      ("_AutoscalingCoordinator", "Ray Data coordinator")):
        if key in cmd:
            return name
    return cmd.split()[0][-40:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured (20)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both modes (2)")
    ap.add_argument("--no_data", action="store_true",
                    help="no Ray Data pipeline before the window (a run whose data are cached)")
    ap.add_argument("--one", choices=("ray-defaults", "raylm"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.window, not args.no_data)),
              flush=True)
        return
    modes = ("ray-defaults", "raylm")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--window",
                                  str(args.window)] + (["--no_data"] if args.no_data else []),
                                 capture_output=True, text=True, check=True).stdout
            res = json.loads(next(line for line in out.splitlines()
                                  if line.startswith("RESULT "))[7:])
            runs[mode].append(res["shares"])
            print(f"  round {rnd + 1} {mode}: {sum(res['shares'].values()):.2f}% of one core",
                  flush=True)
    names = sorted({n for m in modes for r in runs[m] for n in r},
                   key=lambda n: -statistics.median(r.get(n, 0.0) for r in runs["ray-defaults"]))
    print()
    print(f"% of one core over {args.window:.0f} s, median of {args.rounds} round(s); one "
          "actor asleep in a call, Ray started with num_cpus=2"
          + ("" if args.no_data else ", after a Ray Data pipeline"))
    print(f"{'process':<20} {'ray-defaults':>12} {'raylm':>8}")
    for n in names:
        cells = [statistics.median(r.get(n, 0.0) for r in runs[m]) for m in modes]
        print(f"{n:<20} " + f"{cells[0]:>12.2f} {cells[1]:>8.2f}")
    tot = [statistics.median(sum(r.values()) for r in runs[m]) for m in modes]
    print(f"{'total':<20} {tot[0]:>12.2f} {tot[1]:>8.2f}")
    from benchmarks.results import write

    figures = {"config": {"window_s": args.window, "rounds": args.rounds,
                          "ray_data_first": not args.no_data},
               "percent_of_one_core": {
                   n: {m: statistics.median(r.get(n, 0.0) for r in runs[m]) for m in modes}
                   for n in names},
               "total_percent_of_one_core": dict(zip(modes, tot))}
    name = "bench_ray_idle" + ("-no_data" if args.no_data else "")
    print(f"written to {write(name, figures)}")


if __name__ == "__main__":
    main()
