"""The step boundary: how long a rank sits idle between answering step k and receiving
step k+1 (``boundary_idle_s`` in raylm's step breakdown), against a bare Ray actor's
round trip with the same arguments and answer, measured in the same run.

    python benchmarks/bench_boundary.py                 # 1 and 2 ranks, 300 steps
    python benchmarks/bench_boundary.py --ranks 2 --steps 100

raylm trains a tiny GPT-2 (1 x 32, block 32, 2 samples a rank) so that a step takes a few
milliseconds and the boundary shows; the bare actor answers at once. What raylm adds over
the bare round trip is its own: the driver's work between the answers and the next call,
the call's arguments and the answer's size. Asserts nothing; prints medians (ms) and
writes them to benchmarks/results/bench_boundary-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


class Bare:
    """An actor that answers a raylm-shaped train_step call (a StepRequest in, a
    StepResult out) at once and reports, as a rank does, how long it sat idle since its
    last answer."""

    def __init__(self):
        self.returned_at = None

    def train_step(self, req):
        from raylm.runtime.protocol import StepResult

        t0 = time.time()
        idle = t0 - self.returned_at if self.returned_at else None
        out = StepResult(loss=1.0, tokens=64, local_tokens=64, has_loss=True,
                         learning_rate=1e-3, grad_norm=1.0, overflow=False, peak_rss_bytes=1,
                         data_wait_s=0.001, forward_backward_s=0.001, grad_sync_s=0.001,
                         clip_s=0.001, optimizer_s=0.001, step_s=0.0, boundary_idle_s=idle)
        self.returned_at = time.time()
        return out


def bare_ms(ranks: int, steps: int) -> float:
    """Median boundary (ms) of ``ranks`` bare actors driven as raylm's driver drives its
    ranks: every call sent, then each answer waited for in turn."""
    import ray

    from raylm.runtime.protocol import StepRequest

    actors = [ray.remote(num_cpus=0.5)(Bare).remote() for _ in range(ranks)]
    idle = []
    try:
        for step in range(steps):
            refs = [a.train_step.remote(StepRequest(
                        step, [[2 * r, 2 * r + 1]], [[2 * r + 2, 2 * r + 3]], 1.0, None, 0,
                        step - 1 if step else None)) for r, a in enumerate(actors)]
            pending, got = list(refs), []
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=60)
                got.append(ray.get(ready[0]))
            if step >= 10:
                idle.append(min(g.boundary_idle_s for g in got))
    finally:
        for a in actors:
            ray.kill(a)
    return 1000 * statistics.median(idle)


def raylm_ms(ranks: int, steps: int) -> tuple:
    """(median boundary, median step) in ms of raylm training a tiny GPT-2."""
    from raylm import TrainConfig, train

    result = train(TrainConfig(
        model_type="gpt2", config_overrides="n_layer=1,n_embd=32,n_head=2", block_size=32,
        per_device_train_batch_size=2, max_steps=steps, num_workers=ranks,
        cpus_per_worker=0.5, output_dir=tempfile.mkdtemp(prefix="bench-boundary-"),
        logging_steps=10 ** 6, save_steps=10 ** 6, do_eval=False, report_to=["none"],
        disable_tqdm=True))
    late = result.history[10:]
    return (1000 * statistics.median(h["boundary_idle_s"] for h in late),
            1000 * statistics.median(h["step_time_s"] for h in late),
            result.metrics["steps_sent_ahead"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)

    import ray

    from raylm.runtime.cluster import start_local

    from benchmarks.results import write

    start_local(num_cpus=2, log_to_driver=False)  # as `raylm train` starts Ray
    figures = {}
    try:
        print(f"{'ranks':>5} {'bare actor':>11} {'raylm':>8} {'raylm - bare':>13} "
              f"{'raylm step':>11} {'sent ahead':>11}")
        for n in args.ranks:
            bare = bare_ms(n, args.steps)
            boundary, step, ahead = raylm_ms(n, args.steps)
            print(f"{n:>5} {bare:>9.2f}ms {boundary:>6.2f}ms {boundary - bare:>11.2f}ms "
                  f"{step:>9.2f}ms {ahead:>5}/{args.steps}", flush=True)
            figures[f"ranks_{n}"] = {"bare_ms": bare, "raylm_ms": boundary, "step_ms": step,
                                     "sent_ahead": ahead, "steps": args.steps}
    finally:
        ray.shutdown()
    print(f"written to {write('bench_boundary', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
