"""ZeRO stages 0-3 at dp=2 and dp=4, in one run: state per rank against theory, peak
resident memory, tokens/s against stage 0.

    python benchmarks/bench_zero.py            # GPT-2 4 x 256, block 128 (~4 min, ~7 loaded)
    python benchmarks/bench_zero.py --quick    # tiny model, few steps (~2-3 min)
    python benchmarks/bench_zero.py --malloc_mmap_threshold 1048576   # RSS without glibc's
                                               # retention (see below)
    python benchmarks/bench_zero.py --only stage0-dp4 stage3-dp4 --json zero.json

Runs: --zero_stage 0, 1, 2, 3 at dp=2 and at dp=4, pure data parallelism (pp=1, tp=1),
and stage 3 with --reshard_after_forward False (stage3k: the gathered parameters kept
through each step). --rounds N runs the chosen rows N times, interleaved, and reports
each row's median round.
Same model (GPT-2 built from the size flags, raylm's built-in 4096-token tokenizer), same
data, same seed, same global batch in micro-batches of the same size (so dp=2 accumulates
twice as many per rank as dp=4), fp32, AdamW. Each rank actor gets 0.5 CPU and one torch
thread (dp=4: 4 actors on the 2 cores).

Three tables. The first, per run: tokens/s from the median steady-state step time (the
driver's wall time of a step; warm-up steps dropped), its ratio to stage 0 at the same dp,
each rank's peak resident memory up to the end of the last step (the process's
ru_maxrss: Python, torch and Ray included; the final save is after it) as max / mean over
the ranks, and the loss, first -> last step, with the largest per-step difference from
stage 0 at the same dp (dropout is off: every stage trains the same model, so that is fp
rounding only). The second, per run: what a rank holds of the training state, measured
from its tensors in the first step (memory.json: parameters, gradients, AdamW moments;
local shards, each storage once), the largest over the ranks, next to the ZeRO paper's
figure for the rank's replica of Psi parameters (raylm.plan.zero.theory_bytes: 4 Psi +
4 Psi + 8 Psi bytes, each divided by dp once the stage partitions it); measured / theory
of the whole state, min-max over the ranks; and the peak of the activations autograd
saved (at stage 3 it comes out higher by the size of the tied embedding, vocabulary x
n_embd x 4 bytes: FSDP2 keeps the root unit's gathered parameters, the head's weight
among them, from forward to backward, and autograd saves that gathered tensor, which the
meter does not take for a parameter).

A third table: where a step goes, each part's median over the timed steps in ms (the
slowest rank's, as metrics.jsonl's ``breakdown``: data wait, forward and backward, the
gradient sync backward did not hide, clip, optimizer, the driver's round trip), and what
is left of the driver's step time.

Peak RSS is a high-water mark of the whole process. With glibc's default the mmap
threshold grows as large blocks are freed, after which freed tensors stay in the heap
and count as resident, so stages that allocate and free more (FSDP's all-gathers) can
show a higher peak than stage 0 while holding less; --malloc_mmap_threshold fixes the
threshold for the driver and every actor (through the environment the raylet inherits),
and peak RSS comes closer to what the ranks hold.

Asserts nothing: on a shared 2-core machine a single run varies by +-10%. What ZeRO buys
(state per rank) shows in the second table; what it costs (reduce-scatter and all-gather
in place of one all-reduce, FSDP's per-block parameter all-gathers at stage 3) shows in
tokens/s, which on CPU with gloo and up to 4 actors on 2 cores is all overhead.

The figures are written to benchmarks/results/bench_zero-<date>.json
(-quick, -mmap for those runs).
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

from benchmarks.bench_layouts import (add_run_args, apply_preset, overrides,  # noqa: E402
                                       run_config)  # (the same model, batch and flags)
from benchmarks.bench_throughput import median_parts  # noqa: E402
from raylm.runtime.profiling import BREAKDOWN  # noqa: E402

STAGES = (0, 1, 2, 3)
DPS = (2, 4)
# (name, stage, dp, --reshard_after_forward); stage3k: ZeRO-3 keeping the gathered
# parameters and unsharded gradients through each step (one all-gather and one
# reduce-scatter a step instead of two all-gathers and a reduce-scatter per micro-batch).
RUNS = tuple((f"stage{s}-dp{d}", s, d, True) for d in DPS for s in STAGES) + tuple(
    (f"stage3k-dp{d}", 3, d, False) for d in DPS)
KINDS = ("parameters", "gradients", "optimizer")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, [name for name, *_ in RUNS], steps=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the chosen rows this many times, interleaved; the table "
                         "shows each row's median round")
    ap.add_argument("--json", default=None, help="write every run's figures to this file")
    ap.add_argument("--huge_pages", choices=("true", "false"), default="true",
                    help="raylm's --huge_pages for every run (default true, raylm's)")
    ap.add_argument("--malloc_mmap_threshold", type=int, default=None, metavar="BYTES",
                    help="set glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ for "
                         "the driver and every actor (e.g. 1048576), so freed tensors go back "
                         "to the OS and peak RSS comes closer to what a rank holds (default: "
                         "glibc's own, whose growing threshold keeps freed memory resident)")
    return apply_preset(ap.parse_args(argv), steps=20)


def run_zero(args, name, stage, dp, reshard, cache, work) -> dict:
    from raylm import train
    from raylm.runtime.cluster import stop_ray_data_actors

    cfg = run_config(args, name, dp, cache, work, num_workers=dp, pp=1, tp=1,
                     zero_stage=stage, reshard_after_forward=reshard,
                     huge_pages=args.huge_pages == "true")
    result = train(cfg)
    # (the first run tokenized the data through Ray Data: its idle actors stopped, as
    # `raylm train` stops them on a cluster of its own)
    stop_ray_data_actors()
    hist = sorted(result.history, key=lambda h: h["step"])
    timed = hist[args.warmup:]
    median = statistics.median(h["step_time_s"] for h in timed)
    rss = hist[-1]["peak_rss_bytes"]  # ru_maxrss after the last step: the run's peak
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        report = json.load(f)  # measured by each rank in its first step
    ranks = [{"coords": r["coords"], "measured": {k: r["measured"][k] for k in KINDS},
              "activations": r["measured"]["activations"],
              "replica_elements": r["replica_elements"], "theory": r["zero_theory"]}
             for r in report["ranks"]]
    ratios = [sum(r["measured"].values()) / sum(r["theory"].values()) for r in ranks]
    return {"name": name, "stage": stage, "dp": dp, "zero_stage": report["layout"]["zero_stage"],
            "tokens_per_s": args.global_batch * args.block_size / median, "median_s": median,
            "mean_s": statistics.mean(h["step_time_s"] for h in timed),
            "rss_max": max(rss), "rss_mean": sum(rss) / len(rss), "rss": rss,
            "rss_first_step": [r["peak_rss_bytes"] for r in report["ranks"]],
            "measured_max": {k: max(r["measured"][k] for r in ranks) for k in KINDS},
            "theory_max": {k: max(r["theory"][k] for r in ranks) for k in KINDS},
            "held_max": max(sum(r["measured"].values()) for r in ranks),
            "theory_total_max": max(sum(r["theory"].values()) for r in ranks),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "activations_max": max(r["activations"] for r in ranks),
            "ranks": ranks, "losses": [h["loss"] for h in hist],
            "parts": median_parts([h["breakdown"] for h in hist if h.get("breakdown")],
                                  args.warmup)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from raylm.runtime.cluster import start_local

    from benchmarks.results import write

    logging.basicConfig(level=logging.WARNING)
    if args.malloc_mmap_threshold:  # inherited by the raylet ray.init starts, so by actors
        for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
            os.environ[var] = str(args.malloc_mmap_threshold)
    work = tempfile.mkdtemp(prefix="raylm-bench-zero-")
    cache = os.path.join(work, "cache")
    rows = []
    print(f"model gpt2 {overrides(args)}; block {args.block_size}; global batch "
          f"{args.global_batch} in micro-batches of {args.micro_batch}; {args.warmup} warm-up "
          f"+ {args.steps} timed steps; dp rank actors x 0.5 CPU, 1 torch thread; load "
          f"average {os.getloadavg()[0]:.1f}" + (f"; glibc mmap/trim threshold "
                                                 f"{args.malloc_mmap_threshold:,} B"
                                                 if args.malloc_mmap_threshold else ""),
          flush=True)
    try:
        start_local(num_cpus=2, log_to_driver=False)  # as `raylm train` starts Ray
        rounds: dict = {}
        for k in range(args.rounds):
            for name, stage, dp, reshard in RUNS:
                if args.only and name not in args.only:
                    continue
                row = run_zero(args, name, stage, dp, reshard, cache, work)
                rounds.setdefault(name, []).append(row)
                print(f"  {name} (round {k + 1}): {row['tokens_per_s']:,.0f} tokens/s",
                      flush=True)
        for runs in rounds.values():  # each row's median round
            runs.sort(key=lambda r: r["tokens_per_s"])
            rows.append(runs[(len(runs) - 1) // 2])
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    mib = 2**20
    base = {r["dp"]: r for r in rows if r["stage"] == 0}
    rows.sort(key=lambda r: (r["dp"], r["name"]))
    for r in rows:
        b = base.get(r["dp"])
        r["vs_stage0"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        n = min(len(r["losses"]), len(b["losses"])) if b else 0
        r["max_loss_diff_vs_stage0"] = (max(abs(x - y) for x, y in
                                            zip(r["losses"][:n], b["losses"][:n]))
                                        if n else None)
    print()
    print(f"{'run':<11} {'s/step':>7} {'tokens/s':>9} {'vs st0':>7} {'peak RSS max':>13} "
          f"{'mean':>9} {'loss first -> last':>19} {'max |dloss| vs st0':>19}")
    for r in rows:
        ratio = f"{r['vs_stage0']:.2f}" if r["vs_stage0"] is not None else "n/a"
        diff = (f"{r['max_loss_diff_vs_stage0']:.1e}"
                if r["max_loss_diff_vs_stage0"] is not None else "n/a")
        print(f"{r['name']:<11} {r['median_s']:>7.3f} {r['tokens_per_s']:>9,.0f} {ratio:>7} "
              f"{r['rss_max'] / mib:>9,.0f} MiB {r['rss_mean'] / mib:>5,.0f} MiB "
              f"{r['losses'][0]:>8.4f} -> {r['losses'][-1]:.4f} {diff:>19}")
    print()
    print("state per rank, MiB, measured (largest rank) / ZeRO theory; "
          "measured/theory of the whole state over the ranks")
    print(f"{'run':<11} {'parameters':>15} {'gradients':>15} {'optimizer':>15} "
          f"{'states':>15} {'meas/theory':>13} {'activations':>11}")

    def pair(m, t):
        return f"{m / mib:.2f} / {t / mib:.2f}"

    for r in rows:
        m, t = r["measured_max"], r["theory_max"]
        print(f"{r['name']:<11} " + " ".join(f"{pair(m[k], t[k]):>15}" for k in KINDS) +
              f" {pair(r['held_max'], r['theory_total_max']):>15} "
              f"{r['ratio_min']:>6.3f}-{r['ratio_max']:.3f} "
              f"{r['activations_max'] / mib:>7.2f} MiB")
    parts = BREAKDOWN  # (metrics.jsonl's parts, in their order)
    print("\nwhere a step goes, ms (medians over the timed steps; each step's slowest rank)")
    print(f"{'run':<11} {'s/step':>7} " + " ".join(f"{p[:-2].replace('_', ' '):>16}"
                                                  for p in parts) + f" {'rest':>8}")
    for r in rows:
        got = [1000 * r["parts"].get(p, 0.0) for p in parts]
        print(f"{r['name']:<11} {r['median_s']:>7.3f} " + " ".join(f"{v:>16.1f}" for v in got)
              + f" {1000 * r['median_s'] - sum(got):>8.1f}")
    if rows:
        psi = rows[0]["ranks"][0]["replica_elements"]
        print(f"\nPsi (parameters of one replica) = {psi:,}; theory per rank = "
              f"(4 + 4 + 8) Psi bytes, the partitioned parts / dp")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": rows}, f, indent=2)
    figures = {
        "config": {"model": f"gpt2 {overrides(args)}", "block_size": args.block_size,
                   "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                   "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
                   "huge_pages": args.huge_pages == "true",
                   "malloc_mmap_threshold": args.malloc_mmap_threshold, "quick": args.quick},
        "psi": rows[0]["ranks"][0]["replica_elements"] if rows else None,
        "runs": {r["name"]: {
            "stage": r["stage"], "dp": r["dp"], "median_s": r["median_s"],
            "tokens_per_s": r["tokens_per_s"], "vs_stage0": r["vs_stage0"],
            "rss_max_mib": r["rss_max"] / mib, "rss_mean_mib": r["rss_mean"] / mib,
            "first_loss": r["losses"][0], "last_loss": r["losses"][-1],
            "max_loss_diff_vs_stage0": r["max_loss_diff_vs_stage0"],
            "state_mib": {k: [r["measured_max"][k] / mib, r["theory_max"][k] / mib]
                          for k in KINDS},
            "held_mib": r["held_max"] / mib, "theory_mib": r["theory_total_max"] / mib,
            "measured_over_theory": [r["ratio_min"], r["ratio_max"]],
            "activations_mib": r["activations_max"] / mib,
            "parts_ms": {k: 1000 * v for k, v in r["parts"].items()}} for r in rows}}
    name = "bench_zero" + ("-quick" if args.quick else "") + (
        "-mmap" if args.malloc_mmap_threshold else "")
    print(f"written to {write(name, figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
