"""Every layout of 4 rank actors on the same model, against dp=4, in one run.

    python benchmarks/bench_layouts.py            # GPT-2 4 x 256, block 128 (~3 min)
    python benchmarks/bench_layouts.py --quick    # tiny model, few steps (~1 min)

Layouts (dp x pp x tp = 4): dp4, dp2 x tp2, tp4, dp2 x pp2, pp2 x tp2, pp4. Same model
(GPT-2 built from the size flags, raylm's built-in 4096-token tokenizer), same data, same
global batch, same micro-batch size (so each layout runs the same number of micro-batch
rows), fp32, 1F1B for the pipelines. Each rank actor gets 0.5 CPU and one torch thread
(4 actors on 2 cores).

Per layout: tokens/s from the median steady-state step time (the driver's wall time of a
step; warm-up steps dropped), its ratio to dp=4, each rank's peak resident memory (the
process's ru_maxrss: Python, torch and Ray included) as max / mean over the ranks, and
what the busiest rank holds of the training state (parameters, gradients, optimizer
states and saved activations, measured from its tensors: memory.json) next to what the
planner's memory model predicted for it. The loss column checks that every layout trains the same
model (dropout is off).

Asserts nothing: on a shared 2-core machine a single run varies by +-10%. What tensor and
pipeline parallelism buy (memory per rank, models that do not fit one worker) shows in
the memory columns; their communication costs show in tokens/s, which on CPU with gloo
and 4 actors on 2 cores is all overhead relative to dp.

The figures are written to benchmarks/results/bench_layouts-<date>.json
(-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYOUTS = (("dp4", 4, 1, 1), ("dp2xtp2", 2, 1, 2), ("tp4", 1, 1, 4),
           ("dp2xpp2", 2, 2, 1), ("pp2xtp2", 1, 2, 2), ("pp4", 1, 4, 1))


def add_run_args(ap, names, steps: int) -> None:
    """The model, batch and step flags this benchmark and bench_zero.py share; ``names``
    are the runs --only picks from, ``steps`` the default timed steps."""
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed steps (default {steps}; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; quick 1)")
    ap.add_argument("--n_layer", type=int, default=None, help="default 4")
    ap.add_argument("--n_embd", type=int, default=None, help="default 256 (quick 64)")
    ap.add_argument("--block_size", type=int, default=None, help="default 128 (quick 64)")
    ap.add_argument("--global_batch", type=int, default=16)
    ap.add_argument("--micro_batch", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=list(names), default=None)
    ap.add_argument("--quick", action="store_true")


def apply_preset(args, steps: int):
    """Fill the flags left unset from the --quick or the full preset."""
    preset = (dict(steps=3, warmup=1, n_layer=4, n_embd=64, block_size=64) if args.quick
              else dict(steps=steps, warmup=2, n_layer=4, n_embd=256, block_size=128))
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, [name for name, *_ in LAYOUTS], steps=6)
    return apply_preset(ap.parse_args(argv), steps=6)


def overrides(args) -> str:
    return (f"n_layer={args.n_layer},n_embd={args.n_embd},n_head=4,"
            f"n_positions={args.block_size},resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0")


def run_config(args, name, dp, cache, work, **layout):
    """The TrainConfig of one run: the benchmark's model and batch, ``dp`` data-parallel
    replicas, the rest of the layout (num_workers, pp, tp, zero_stage, ...) in ``layout``."""
    from raylm import TrainConfig

    return TrainConfig(
        model_type="gpt2", config_overrides=overrides(args), block_size=args.block_size,
        data_cache_dir=cache, output_dir=os.path.join(work, name), overwrite_output_dir=True,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.global_batch // (dp * args.micro_batch),
        max_steps=args.warmup + args.steps, do_eval=False, disable_tqdm=True,
        validation_split_percentage=0.0, logging_steps=10**6, save_steps=10**6,
        cpus_per_worker=0.5, dp=dp, **layout)


def on_local_ray(prefix: str, body) -> list:
    """``body(cache, work)`` on a local 2-CPU Ray cluster with a scratch directory (its
    block cache under it), both gone afterwards; body's result."""
    import ray

    work = tempfile.mkdtemp(prefix=prefix)
    try:
        from raylm.runtime.cluster import start_local  # as `raylm train` starts Ray

        start_local(num_cpus=2, log_to_driver=False)
        return body(os.path.join(work, "cache"), work)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def write_json(args, rows: list) -> None:
    """Every run's figures and the flags, to --json when given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=2)


def run_layout(args, name, dp, pp, tp, cache, work) -> dict:
    from raylm import train
    from raylm.runtime.cluster import stop_ray_data_actors
    from raylm.runtime.reporting import PREDICTED

    cfg = run_config(args, name, dp, cache, work, num_workers=4, pp=pp, tp=tp,
                     pipeline_schedule="1f1b")
    result = train(cfg)
    # (the first run tokenized the data through Ray Data: its idle actors stopped, as
    # `raylm train` stops them on a cluster of its own)
    stop_ray_data_actors()
    hist = sorted(result.history, key=lambda h: h["step"])
    timed = hist[args.warmup:]
    median = statistics.median(h["step_time_s"] for h in timed)
    rss = hist[-1]["peak_rss_bytes"]
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ranks = json.load(f)["ranks"]  # measured by each rank in its first step
    held = [sum(r["measured"].values()) for r in ranks]
    predicted = [sum(r["predicted"][k] for k in PREDICTED) for r in ranks if r["predicted"]]
    return {"name": name, "tokens_per_s": args.global_batch * args.block_size / median,
            "median_s": median, "rss_max": max(rss), "rss_mean": sum(rss) / len(rss),
            "held_max": max(held), "predicted_max": max(predicted) if predicted else None,
            "first_loss": hist[0]["loss"], "last_loss": hist[-1]["loss"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    logging.basicConfig(level=logging.WARNING)
    work = tempfile.mkdtemp(prefix="raylm-bench-layouts-")
    cache = os.path.join(work, "cache")
    rows = []
    print(f"model gpt2 {overrides(args)}; block {args.block_size}; global batch "
          f"{args.global_batch} in micro-batches of {args.micro_batch}; {args.warmup} warm-up "
          f"+ {args.steps} timed steps; 4 rank actors x 0.5 CPU", flush=True)
    try:
        from raylm.runtime.cluster import start_local  # as `raylm train` starts Ray

        start_local(num_cpus=2, log_to_driver=False)
        for name, dp, pp, tp in LAYOUTS:
            if args.only and name not in args.only:
                continue
            rows.append(run_layout(args, name, dp, pp, tp, cache, work))
            print(f"  {name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    base = next((r for r in rows if r["name"] == "dp4"), None)
    print()
    print(f"{'layout':<9} {'s/step':>7} {'tokens/s':>9} {'vs dp4':>7} {'peak RSS max':>13} "
          f"{'mean':>9} {'held/rank':>11} {'predicted':>11} {'loss first -> last':>19}")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a"
        pred = f"{r['predicted_max'] / mib:>7.1f} MiB" if r["predicted_max"] else "n/a"
        print(f"{r['name']:<9} {r['median_s']:>7.3f} {r['tokens_per_s']:>9,.0f} {ratio:>7} "
              f"{r['rss_max'] / mib:>9,.0f} MiB {r['rss_mean'] / mib:>5,.0f} MiB "
              f"{r['held_max'] / mib:>7.1f} MiB {pred:>11} "
              f"{r['first_loss']:>8.3f} -> {r['last_loss']:.3f}")
    shape = {name: (dp, pp, tp) for name, dp, pp, tp in LAYOUTS}
    figures = {
        "config": {"model": f"gpt2 {overrides(args)}", "block_size": args.block_size,
                   "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                   "warmup": args.warmup, "steps": args.steps, "quick": args.quick},
        "layouts": {r["name"]: {
            "dp": shape[r["name"]][0], "pp": shape[r["name"]][1], "tp": shape[r["name"]][2],
            "median_s": r["median_s"], "tokens_per_s": r["tokens_per_s"],
            "vs_dp4": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
            "rss_max_mib": r["rss_max"] / mib, "rss_mean_mib": r["rss_mean"] / mib,
            "held_mib": r["held_max"] / mib,
            "predicted_mib": r["predicted_max"] / mib if r["predicted_max"] else None,
            "first_loss": r["first_loss"], "last_loss": r["last_loss"]} for r in rows}}
    from benchmarks.results import write

    print(f"written to {write('bench_layouts' + ('-quick' if args.quick else ''), figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
