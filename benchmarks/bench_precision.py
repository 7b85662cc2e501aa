"""Precision, recomputation and compile, in one run: tokens/s, peak memory per rank and
what each block keeps for backward, for fp32 with each activation checkpointing mode,
for --bf16 and --fp16 (with none and full recomputation), and fp32 with --torch_compile.

    python benchmarks/bench_precision.py            # GPT-2 4 x 256, block 128 (~4 min)
    python benchmarks/bench_precision.py --quick    # tiny model, few steps (~2 min)
    python benchmarks/bench_precision.py --only fp32-none bf16-none --json precision.json

Runs, each at dp=2 (pure data parallelism, ZeRO-0): fp32 with --activation_checkpointing
none, selective and full; --bf16 with none and full; --fp16 with none; fp32 with
--torch_compile. Same model (GPT-2 built from the size flags, raylm's built-in
tokenizer), same data, seed and global batch, AdamW with fp32 master weights. Each rank
actor gets 0.5 CPU and one torch thread.

One table, per run: tokens/s from the median steady-state step time (warm-up steps
dropped: compile's happen in the first) and its ratio to fp32 keeping every activation;
the activations autograd kept for backward at the first step's peak, measured on the rank
(raylm.runtime.memory.ActivationMeter, memory.json) next to the planner's prediction
(raylm.plan.cost: the precision's bytes; the recomputation's own one-block transient is
workspace, not shown), and under bf16/fp16 autocast's weight copies, measured and
predicted; each rank's peak resident memory (ru_maxrss: Python, torch and Ray
included); the largest per-step loss difference from fp32 with nothing recomputed (the
same arithmetic for the fp32 rows: 0 up to compile's order of sums); the mean MFU where
the ranks' peak is known (a GPU).

Asserts nothing: on a shared 2-core machine a single run varies by +-10%. On a GPU the
time of recomputation is one more forward (full) or a few memory-bound passes
(selective), bf16 runs on tensor cores and compile fuses the element-wise ops; this CPU
has no bf16 or fp16 arithmetic (autocast emulates it, about 30x slower per matrix
multiply) and its compiled kernels gain little on a small model, so read the memory and
loss columns here.

The figures are written to benchmarks/results/bench_precision-<date>.json
(-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_layouts import (add_run_args, apply_preset, on_local_ray,  # noqa: E402
                                       overrides, run_config, write_json)

DP = 2
RUNS = tuple((f"{precision}-{mode}", precision, mode) for precision, mode in (
    ("fp32", "none"), ("fp32", "selective"), ("fp32", "full"),
    ("bf16", "none"), ("bf16", "full"), ("fp16", "none"))) + (
    ("fp32-none-compile", "fp32", "none"),)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, [name for name, *_ in RUNS], steps=10)
    ap.add_argument("--json", default=None, help="write every run's figures to this file")
    return apply_preset(ap.parse_args(argv), steps=10)


def run_one(args, name, precision, mode, cache, work) -> dict:
    from raylm import train

    cfg = run_config(args, name, DP, cache, work, num_workers=DP, pp=1, tp=1,
                     zero_stage=0, activation_checkpointing=mode,
                     bf16=precision == "bf16", fp16=precision == "fp16",
                     torch_compile=name.endswith("-compile"))
    result = train(cfg)
    hist = sorted(result.history, key=lambda h: h["step"])
    median = statistics.median(h["step_time_s"] for h in hist[args.warmup:])
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        report = json.load(f)  # measured by each rank in its first step
    assert report["layout"]["recompute"] == mode, report["layout"]
    ranks = report["ranks"]
    rss = hist[-1]["peak_rss_bytes"]
    return {"name": name, "precision": precision, "recompute": mode, "median_s": median,
            "tokens_per_s": args.global_batch * args.block_size / median,
            "activations": max(r["measured"]["activations"] for r in ranks),
            "predicted_activations": max(r["predicted"]["activations"] for r in ranks
                                         if r["predicted"]),
            "weight_copies": max(r["measured"]["weight_copies"] for r in ranks),
            "predicted_weight_copies": max(r["predicted"]["weight_copies"] for r in ranks
                                           if r["predicted"]),
            "mfu": statistics.mean(mfu) if (mfu := [h["mfu"] for h in hist[args.warmup:]
                                                      if h.get("mfu")]) else None,
            "rss_max": max(rss), "losses": [h["loss"] for h in hist]}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"model gpt2 {overrides(args)}; block {args.block_size}; global batch "
          f"{args.global_batch} in micro-batches of {args.micro_batch}; dp={DP}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; rank actors x 0.5 CPU, 1 torch "
          f"thread; load average {os.getloadavg()[0]:.1f}", flush=True)

    def runs(cache, work):
        rows = []
        for name, precision, mode in RUNS:
            if not args.only or name in args.only:
                rows.append(run_one(args, name, precision, mode, cache, work))
                print(f"  {name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        return rows

    rows = on_local_ray("raylm-bench-precision-", runs)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    mib = 2**20
    base = next((r for r in rows if r["name"] == "fp32-none"), None)
    print()
    print(f"{'run':<18} {'s/step':>7} {'tokens/s':>9} {'vs fp32':>8} {'kept (measured)':>16} "
          f"{'predicted':>10} {'copies':>10} {'predicted':>10} {'peak RSS max':>13} "
          f"{'max |dloss| vs fp32':>20} {'mfu':>6}")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a"
        diff = "n/a"
        if base:
            n = min(len(r["losses"]), len(base["losses"]))
            diff = f"{max(abs(x - y) for x, y in zip(r['losses'][:n], base['losses'][:n])):.1e}"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "n/a"
        print(f"{r['name']:<18} {r['median_s']:>7.3f} {r['tokens_per_s']:>9,.0f} {ratio:>8} "
              f"{r['activations'] / mib:>12.2f} MiB {r['predicted_activations'] / mib:>6.2f} MiB "
              f"{r['weight_copies'] / mib:>6.2f} MiB {r['predicted_weight_copies'] / mib:>6.2f} "
              f"MiB {r['rss_max'] / mib:>9,.0f} MiB {diff:>20} {mfu:>6}")
    write_json(args, rows)
    figures = {
        "config": {"model": f"gpt2 {overrides(args)}", "block_size": args.block_size,
                   "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                   "dp": DP, "warmup": args.warmup, "steps": args.steps, "quick": args.quick},
        "runs": {}}
    for r in rows:
        n = min(len(r["losses"]), len(base["losses"])) if base else 0
        figures["runs"][r["name"]] = {
            "median_s": r["median_s"], "tokens_per_s": r["tokens_per_s"],
            "vs_fp32": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
            "activations_mib": r["activations"] / mib,
            "predicted_activations_mib": r["predicted_activations"] / mib,
            "weight_copies_mib": r["weight_copies"] / mib,
            "predicted_weight_copies_mib": r["predicted_weight_copies"] / mib,
            "rss_max_mib": r["rss_max"] / mib,
            "max_loss_diff_vs_fp32": max(abs(x - y) for x, y in zip(
                r["losses"][:n], base["losses"][:n])) if n else None,
            "mfu": r["mfu"]}
    from benchmarks.results import write

    print(f"written to {write('bench_precision' + ('-quick' if args.quick else ''), figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
