"""In-memory recovery on several GPUs (NCCL): a rank killed, a rank frozen, in dp, dp x tp
and dp x pp; parity, recovery time and steps redone for each.

    python benchmarks/gpu_recovery.py           # a machine with 2 or more GPUs: NCCL
    python benchmarks/gpu_recovery.py --cpu     # the same on CPU ranks (gloo): a check
                                                # of the script where there is no GPU

Per layout (dp=2, then dp=2 x tp=2 and dp=2 x pp=2 where 4 GPUs are there) and fault:
an unchanged run, then the same run with rank 1 killed (it exits) or frozen (SIGSTOP:
alive, answering nothing, as a stuck GPU or a hung process) in its gradient sync at step
--at. A survivor blocked on a dead NCCL peer raises nothing: raylm's heartbeat finds the
lost rank, ends it, and each survivor aborts all its communicators at once from its
health thread (raylm.runtime.health.abort_groups) before the group is rebuilt. Printed:
the largest relative loss difference from the unchanged run (dropout off, so the
function is the same), fault -> next committed step, the failures counted and the
committed steps redone. Written to benchmarks/results/gpu_recovery-<date>.json.

Asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYOUTS = {"dp": dict(num_workers=2), "dp x tp": dict(num_workers=4, tp=2),
           "dp x pp": dict(num_workers=4, pp=2)}


class Ends:
    """When each step ended (the driver's callback)."""

    def __init__(self):
        self.ends = {}

    def on_step_end(self, driver, step, record):
        self.ends[step] = time.time()
        driver.grow_check_s = 3600.0  # (recovery only: no growth back)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU ranks on gloo instead of GPUs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--at", type=int, default=8, help="the fault's step")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--faults", nargs="+", default=["die", "freeze"], choices=["die", "freeze"])
    ap.add_argument("--verbose", action="store_true", help="raylm's log on stderr")
    args = ap.parse_args()
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import numpy as np
    import ray

    from benchmarks.bench_elastic import Lines
    from benchmarks.results import write
    from raylm import TrainConfig, train
    from raylm.runtime.cluster import start_local
    from raylm.runtime.faults import inject

    gpus = 0
    if not args.cpu:
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:
            sys.exit(f"{gpus} GPU(s) here: this needs 2 or more (or --cpu)")
    work = tempfile.mkdtemp(prefix="raylm-gpu-recovery-")
    corpus = os.path.join(REPO, "..", "shared", "data", "shakespeare")
    lines = Lines()
    logging.getLogger("raylm").addHandler(lines)
    logging.getLogger("raylm").setLevel(logging.INFO)

    def cfg(name, **kw):
        base = dict(model_type="gpt2",
                    config_overrides="n_layer=2,n_embd=64,n_head=2,n_positions=64,"
                    "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0", train_file=[corpus],
                    block_size=64, data_cache_dir=os.path.join(work, "cache"),
                    output_dir=os.path.join(work, name), max_steps=args.steps,
                    save_steps=10**6, logging_steps=10**6, disable_tqdm=True,
                    learning_rate=1e-3, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, do_eval=False, use_gpu=not args.cpu,
                    heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, max_failures=3,
                    **({"cpus_per_worker": 0.4} if args.cpu else {}))
        base.update(kw)
        return TrainConfig(**base)

    start_local(**({"num_cpus": 4} if args.cpu else {}), log_to_driver=False)
    rows = {}
    try:
        for layout in args.layouts:
            kw = LAYOUTS[layout]
            if not args.cpu and kw["num_workers"] > gpus:
                print(f"{layout}: needs {kw['num_workers']} GPUs, {gpus} here: not run")
                continue
            base = train(cfg(f"{layout}-unchanged", **kw))
            ref = np.array([h["loss"] for h in base.history])
            for action in args.faults:
                del lines.lines[:]
                ends = Ends()
                with inject({"rank": 1, "step": args.at, "phase": "sync",
                             "action": action}):
                    hit = train(cfg(f"{layout}-{action}", **kw), callbacks=(ends,))
                fault_t = ends.ends[args.at]  # (it trips in the next step's sync)
                after = [t for s, t in ends.ends.items() if s > args.at]
                redone = re.search(r"(\d+) step\(s\) will be redone",
                                   " ".join(m for _, m in lines.lines))
                got = np.array([h["loss"] for h in hit.history])
                rows[f"{layout}, {action}"] = {
                    "max_rel_loss_diff": float(np.max(np.abs(got - ref) / np.abs(ref)))
                    if len(got) == len(ref) else None,
                    "fault_to_next_step_s": min(after) - fault_t if after else None,
                    "failures": hit.failures,
                    "steps_redone": int(redone.group(1)) if redone else 0,
                    "world_size_after": hit.metrics["world_size"]}
    finally:
        ray.shutdown()
    print()
    print(f"| layout, fault ({'CPU, gloo' if args.cpu else f'{gpus} GPUs, NCCL'}) | loss vs "
          "unchanged (max rel.) | fault -> next step | failures | steps redone | ranks after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        diff = "n/a" if r["max_rel_loss_diff"] is None else f"{r['max_rel_loss_diff']:.1e}"
        took = "n/a" if r["fault_to_next_step_s"] is None else f"{r['fault_to_next_step_s']:.2f} s"
        print(f"| {name} | {diff} | {took} | {r['failures']} | {r['steps_redone']} | "
              f"{r['world_size_after']} |")
    print(f"written to {write('gpu_recovery' + ('-cpu' if args.cpu else ''), rows)}")


if __name__ == "__main__":
    main()
