"""Ray Train baseline for bench_throughput.py: the DDP loop (ddp_baseline.run_loop) run by
Ray Train's ``TorchTrainer`` on N workers.

    python benchmarks/raytrain_baseline.py --workers 2 --config_dir D --data_dir C \
        --global_batch 16 --steps 23 --threads 1

What a Ray user writes without raylm: the loop of ddp_baseline.py (same model, seed,
blocks, order, AdamW, clipping, schedule) as a TorchTrainer's train function, Ray Train
setting up the gloo process group and the workers (1 CPU each with 2 workers on 2 CPUs).
Starts its own local Ray cluster. Prints one line ``RESULT {json}``: rank 0's per-step
times and losses, and the seconds of ``ray.init`` and of ``TorchTrainer.fit`` (the
whole call with Ray running, as raylm's ``train()`` is timed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.ddp_baseline import add_args  # noqa: E402


def train_func(config: dict) -> None:
    import ray.train

    from benchmarks.ddp_baseline import run_loop

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    result = run_loop(argparse.Namespace(**config), rank, world)
    if rank == 0:
        with open(config["result_path"], "w") as f:
            json.dump(result, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t0 = time.time()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": str(args.threads)}})
    init_s = time.time() - t0
    with tempfile.TemporaryDirectory() as work:
        config = {**vars(args), "result_path": os.path.join(work, "result.json")}
        config.pop("workers")
        trainer = TorchTrainer(
            train_func, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args.workers,
                                         resources_per_worker={"CPU": 2 / args.workers}),
            run_config=RunConfig(name="bench", storage_path=os.path.join(work, "results")))
        t1 = time.time()
        trainer.fit()
        fit_s = time.time() - t1
        with open(config["result_path"]) as f:
            result = json.load(f)
    ray.shutdown()
    print("RESULT " + json.dumps({**result, "ray_init_s": init_s, "fit_s": fit_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
