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
* the losses of the elastic run against the fault-free twin (they must agree to 1e-5).

Prints a table; asserts nothing. Not yet here: Ray Train v2 side by side, a soak with a
kill every minute (goodput), and the fault-free cost of the per-step commit on its own.
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
    args = ap.parse_args()
    if args.quick:
        args.steps, args.kill_at, args.grow_from = 250, 8, 12
    import numpy as np
    import ray

    from raylm import TrainConfig, train

    size = "n_layer=2,n_embd=64,n_head=2" if args.quick else "n_layer=2,n_embd=128,n_head=4"
    work = tempfile.mkdtemp(prefix="raylm-bench-elastic-")
    corpus = os.path.join(REPO, "..", "shared", "data", "shakespeare")

    def cfg(name):
        return TrainConfig(model_type="gpt2", config_overrides=f"{size},n_positions=64",
                           train_file=[corpus], block_size=64,
                           cache_dir=os.path.join(work, "cache"),
                           output_dir=os.path.join(work, name), max_steps=args.steps,
                           save_steps=10**6, logging_steps=10**6, disable_tqdm=True,
                           learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                           per_device_train_batch_size=4, gradient_accumulation_steps=1,
                           do_eval=False)

    lines = Lines()
    logging.getLogger("raylm").addHandler(lines)
    logging.getLogger("raylm").setLevel(logging.INFO)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
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
    after_kill = watch.ends[args.kill_at + 1] - watch.kill_time
    print()
    print(f"| what | raylm ({hit.metrics['world_size']} ranks at the end) |")
    print("| --- | --- |")
    print(f"| fault-free step (median) | {step_s * 1000:.0f} ms |")
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


if __name__ == "__main__":
    main()
