"""raylm's training throughput against plain PyTorch, torchrun DDP, the HF Trainer and
Ray Train, in one run.

    python benchmarks/bench_throughput.py            # full: GPT-2 4 x 256, block 128
    python benchmarks/bench_throughput.py --quick    # tiny smoke check (~1 min)

Six measurements, same model (GPT-2 from --model_type gpt2 with the size flags, the vocab
of raylm's built-in 4096-token tokenizer), same data (tokenized once into raylm's cache;
the baselines read the same blocks with raylm's BlockReader, in the same order), same
global batch, fp32:

  (a) plain       one process, a plain PyTorch loop, 2 torch threads
  (b) hf-trainer  one process, transformers' Trainer with its defaults, 2 threads
  (c) raylm-1     raylm, 1 rank actor with 2 CPUs (2 threads)  -> ratios (c)/(a), (c)/(b)
  (d) ddp-2       torchrun --nproc_per_node 2, DDP over gloo, 1 thread each
  (e) raytrain-2  Ray Train's TorchTrainer, 2 workers of 1 CPU running (d)'s loop
  (f) raylm-2     raylm, 2 rank actors with 1 CPU each (1 thread each)
                                                               -> ratios (f)/(d), (f)/(e)

and raylm's defaults off: raylm-1-loop and raylm-2-loop are (b) and (d) with
--optim adamw_torch (torch's AdamW loop, as the plain and DDP rows use) instead of the
default fused kernel (adamw_torch_fused) -> ratios (b)/(b-loop), (d)/(d-loop);
raylm-1-4k and raylm-2-4k with --huge_pages false (the rank processes' allocator in the
system's 4 KiB pages) -> (b)/(b-4k), (d)/(d-4k).

Timing: steady state only. Each run does --warmup + --steps optimizer steps and the first
--warmup are dropped. raylm's per-step time is the driver's wall time of the step
(TrainResult.history step_time_s: from sending the step to the ranks to having every
rank's answer), so it includes raylm's own overheads; the baselines time their loop body
(the HF Trainer: from one step's end to the next's, its bookkeeping included).
tokens/s counts input tokens (global batch x block size) for every row. Ray is shut down
while the baselines run, so they do not share the 2 cores with an idle Ray cluster; raylm's
runs pay for their Ray cluster, as they would in use; Ray Train's row starts its own.

Whole call: raylm's train() and Ray Train's fit(), each with Ray already running (Ray's
start is in bench_startup.py); the plain, DDP and HF Trainer rows' whole process, Python
and torch imports included.

The loss column checks that every row trains the same model on the same samples: a DDP
row's (torchrun, Ray Train) is its rank 0's half of the batch, and the HF Trainer logs
(block - 1) / block of the same loss (hf_trainer_baseline.py says why).

Prints a table and the ratios and writes them to
benchmarks/results/bench_throughput-<date>.json (bench_throughput-quick-<date>.json with
--quick); asserts nothing (timings on a shared 2-core machine are noisy: repeat a run
before trusting a difference of a few percent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BASELINES = {name: os.path.join(REPO, "benchmarks", script) for name, script in (
    ("plain", "ddp_baseline.py"), ("ddp-2", "ddp_baseline.py"),
    ("hf-trainer", "hf_trainer_baseline.py"), ("raytrain-2", "raytrain_baseline.py"))}
VENV_BIN = os.path.dirname(sys.executable)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick 6)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed first steps (default 3; quick 2)")
    ap.add_argument("--n_layer", type=int, default=None, help="default 4 (quick 2)")
    ap.add_argument("--n_embd", type=int, default=None, help="default 256 (quick 64)")
    ap.add_argument("--n_head", type=int, default=None, help="default 4 (quick 2)")
    ap.add_argument("--block_size", type=int, default=None, help="default 128 (quick 64)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="GPT-2's resid/embd/attn dropout (default 0: then every row computes "
                    "the same losses, a check that they all train the same model)")
    ap.add_argument("--attn_dropout", type=float, default=None,
                    help="attention dropout alone (default: --dropout's); raylm runs eager "
                    "attention for it (per-sample masks), the other rows sdpa")
    ap.add_argument("--global_batch", type=int, default=None,
                    help="samples per optimizer step, all ranks (default 16; quick 8)")
    ap.add_argument("--train_file", nargs="*", default=None,
                    help="text files (default: raylm's built-in sample)")
    ap.add_argument("--cache_dir", default=None,
                    help="raylm token cache (default: a temporary directory)")
    ap.add_argument("--only", nargs="*", choices=ORDER,
                    default=None, help="run only these rows")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of all rows, interleaved; the table shows the best and "
                    "the median round (default 1)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps")
    args = ap.parse_args(argv)
    quick = dict(steps=6, warmup=2, n_layer=2, n_embd=64, n_head=2, block_size=64,
                 global_batch=8)
    full = dict(steps=20, warmup=3, n_layer=4, n_embd=256, n_head=4, block_size=128,
                global_batch=16)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.global_batch % 2:
        ap.error("--global_batch must be even (it is split over 2 ranks)")
    return args


def config_overrides(args) -> str:
    d = args.dropout
    a = getattr(args, "attn_dropout", None)
    return (f"n_layer={args.n_layer},n_embd={args.n_embd},n_head={args.n_head},"
            f"n_positions={args.block_size},resid_pdrop={d},embd_pdrop={d},"
            f"attn_pdrop={d if a is None else a}")


def train_config(args, workers: int, out: str, cache: str, optim: str = "adamw_torch_fused",
                 huge_pages: bool = True):
    from raylm import TrainConfig

    return TrainConfig(
        model_type="gpt2", config_overrides=config_overrides(args),
        train_file=list(args.train_file or []), block_size=args.block_size,
        data_cache_dir=cache, output_dir=out, overwrite_output_dir=True,
        per_device_train_batch_size=args.global_batch // workers,
        gradient_accumulation_steps=1, max_steps=args.warmup + args.steps,
        learning_rate=5e-4, seed=42, do_eval=False, disable_tqdm=True,
        validation_split_percentage=0.0,  # train on every block, as the baselines do
        logging_steps=10**6, save_steps=10**6,  # only the final save, after the timing
        num_workers=workers, cpus_per_worker=2 / workers, optim=optim, huge_pages=huge_pages)


def summarize(name: str, procs: str, step_times: list, warmup: int, tokens_per_step: int,
              losses: list) -> dict:
    """Steady-state figures of one run. tokens/s is taken from the median step time: on a
    shared machine another process's burst slows a few steps a lot, and the median ignores
    them; the mean-based figure is kept too."""
    timed = step_times[warmup:]
    median = statistics.median(timed)
    return {"name": name, "procs": procs, "steps": len(timed),
            "mean_s": sum(timed) / len(timed), "median_s": median,
            "tokens_per_s": tokens_per_step / median,
            "tokens_per_s_mean": tokens_per_step * len(timed) / sum(timed),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None}


def run_baseline(args, name: str, nproc: int, config_dir: str, data_dir: str) -> dict:
    threads = 2 // nproc
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = ["--config_dir", config_dir, "--data_dir", data_dir,
             "--global_batch", str(args.global_batch), "--steps", str(args.warmup + args.steps),
             "--threads", str(threads)]
    script = BASELINES[name]
    if name == "ddp-2":
        cmd = [os.path.join(VENV_BIN, "torchrun"), "--standalone",
               f"--nproc_per_node={nproc}", script, *flags]
    elif name == "raytrain-2":
        cmd = [sys.executable, script, "--workers", str(nproc), *flags]
    else:
        cmd = [sys.executable, script, *flags]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{name}: baseline failed ({proc.returncode})")
    r = json.loads(lines[-1][len("RESULT "):])
    out = summarize(name, f"{nproc} x {threads} thr", r["step_times"], args.warmup,
                    args.global_batch * r["block_size"], r["losses"])
    out["parameters"] = r["parameters"]
    out["parts"] = median_parts(r.get("parts") or [], args.warmup)
    out["run_wall_s"] = r.get("fit_s", wall)  # (Ray Train: its fit(), Ray running)
    return out


def median_parts(parts: list, warmup: int) -> dict:
    """Each part's median over the timed steps (seconds per step)."""
    timed = parts[warmup:]
    keys = sorted({k for p in timed for k in p})
    return {k: statistics.median(p.get(k) or 0.0 for p in timed) for k in keys}


def run_raylm(args, name: str, workers: int, cache: str, work: str) -> dict:
    from raylm import train

    out_dir = os.path.join(work, f"out-{name}")
    t0 = time.time()
    optim = "adamw_torch" if name.endswith("-loop") else "adamw_torch_fused"
    result = train(train_config(args, workers, out_dir, cache, optim,
                                huge_pages=not name.endswith("-4k")))
    wall = time.time() - t0
    hist = sorted(result.history, key=lambda h: h["step"])
    r = summarize(name, f"{workers} x {max(1, 2 // workers)} thr",
                  [h["step_time_s"] for h in hist], args.warmup,
                  args.global_batch * args.block_size, [h["loss"] for h in hist])
    timed = hist[args.warmup:]
    r["data_wait_s"] = statistics.mean(h["data_wait_s"] for h in timed)
    r["run_wall_s"] = wall
    r["parts"] = median_parts([h["breakdown"] for h in hist], args.warmup)
    return r


ORDER = ("plain", "hf-trainer", "raylm-1", "raylm-1-loop", "raylm-1-4k", "ddp-2", "raytrain-2",
         "raylm-2", "raylm-2-loop", "raylm-2-4k")
# (row, against, goal): the goals; None: a default on against off.
GOALS = (("raylm-1", "plain", 1.0), ("raylm-1", "hf-trainer", 1.0), ("raylm-2", "ddp-2", 1.0),
         ("raylm-2", "raytrain-2", 1.05),
         ("raylm-1", "raylm-1-loop", None), ("raylm-2", "raylm-2-loop", None),
         ("raylm-1", "raylm-1-4k", None), ("raylm-2", "raylm-2-4k", None))


def main(argv=None) -> int:
    args = parse_args(argv)
    import logging

    import ray

    from raylm.config import TrainConfig
    from raylm.runtime.cluster import start_local, stop_ray_data_actors
    from raylm.data.sources import builtin_sample_files
    from raylm.data.tokenized import build_tokenized_dataset
    from raylm.models.loading import resolve_model

    from benchmarks.results import write

    logging.basicConfig(level=logging.WARNING)
    rows = [r for r in ORDER if r in (args.only or ORDER)]
    work = tempfile.mkdtemp(prefix="raylm-bench-")
    cache = args.cache_dir or os.path.join(work, "cache")
    runs: dict[str, list[dict]] = {name: [] for name in rows}

    def start_ray():
        # The local cluster `raylm train` starts for itself (a cluster of our own even when
        # another `ray start` cluster runs on this machine; Ray's processes as raylm
        # tunes them, raylm.runtime.cluster.start_local).
        start_local(num_cpus=2, log_to_driver=False)

    try:
        # The model raylm will build, resolved by raylm itself; the baselines build the same
        # config (same seed) from its config.json.
        spec = resolve_model(TrainConfig(model_type="gpt2",
                                         config_overrides=config_overrides(args)))
        config_dir = os.path.join(work, "config")
        spec.config.save_pretrained(config_dir)
        files = [os.path.abspath(f) for f in (args.train_file or builtin_sample_files())]
        args.train_file = files

        start_ray()
        t0 = time.time()
        ds = build_tokenized_dataset(files, spec.tokenizer_dir, args.block_size,
                                     cache_root=cache)
        stop_ray_data_actors()  # as `raylm train` does on its own cluster, data ready
        print(f"data: {ds.num_samples} blocks of {ds.block_size} tokens "
              f"({'cached' if ds.reused else f'tokenized in {time.time() - t0:.1f} s'}); "
              f"vocab {spec.vocab_size}; model gpt2 {config_overrides(args)}; "
              f"global batch {args.global_batch}; {args.warmup} warm-up + {args.steps} "
              f"timed steps; {args.repeat} round(s)", flush=True)

        for rnd in range(args.repeat):
            if not ray.is_initialized() and any(r.startswith("raylm") for r in rows):
                start_ray()
            for name in rows:
                if name.startswith("raylm"):
                    workers = int(name.split("-")[1])
                    runs[name].append(run_raylm(args, name, workers, cache, work))
                    print(f"  round {rnd + 1} {name}: "
                          f"{runs[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
            if ray.is_initialized():
                ray.shutdown()  # the baselines get the machine to themselves
            for name in rows:
                if not name.startswith("raylm"):
                    nproc = 2 if name.endswith("-2") else 1
                    runs[name].append(run_baseline(args, name, nproc, config_dir,
                                                   ds.cache_dir))
                    print(f"  round {rnd + 1} {name}: "
                          f"{runs[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    best = {n: max(rs, key=lambda r: r["tokens_per_s"]) for n, rs in runs.items() if rs}
    med = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items() if rs}
    print()
    print("tokens/s = global batch x block size / median steady-state step time "
          f"({args.steps} timed steps per run; best and median of {args.repeat} round(s))")
    print(f"{'run':<12} {'procs':<11} {'median s/step':>13} {'mean s/step':>11} "
          f"{'tokens/s best':>13} {'tokens/s median':>15} {'loss first -> last':>19} "
          f"{'whole call s':>12}")
    for name in rows:
        r = best[name]
        loss = (f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"
                if r["first_loss"] is not None else "")
        call = statistics.median(x["run_wall_s"] for x in runs[name])
        print(f"{name:<12} {r['procs']:<11} {r['median_s']:>13.3f} {r['mean_s']:>11.3f} "
              f"{r['tokens_per_s']:>13,.0f} {med[name]:>15,.0f} {loss:>19} {call:>12.1f}")
    print()
    ratios = {}
    for a, b, goal in GOALS:
        if a in best and b in best:
            rb = best[a]["tokens_per_s"] / best[b]["tokens_per_s"]
            rm = med[a] / med[b]
            # Paired by round (the rows of a round run one after the other, so a slow
            # spell of the machine moves both): each round's ratio, and in how many
            # rounds the goal was met; a goal met in every round of 3 or more is a
            # difference the machine's drift did not make.
            paired = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b])]
            ratios[f"{a}/{b}"] = {"best": rb, "median": rm, "per_round": paired}
            met = (f", goal met in {sum(r >= goal for r in paired)} of {len(paired)} rounds"
                   if goal else "")
            print(f"{a} / {b}: {rb:.3f} (best rounds), {rm:.3f} (median rounds); per round "
                  + ", ".join(f"{r:.3f}" for r in paired)
                  + (f" (median {statistics.median(paired):.3f}{met})" if len(paired) > 1
                     else met)
                  + (f"   goal >= {goal}" if goal else
                     "   (fused AdamW on / off)" if b.endswith("-loop") else
                     "   (--huge_pages on / off)"))
    if "raylm-2" in runs and "raytrain-2" in runs and runs["raylm-2"] and runs["raytrain-2"]:
        calls = [statistics.median(x["run_wall_s"] for x in runs[n])
                 for n in ("raylm-2", "raytrain-2")]
        print(f"whole call, raylm-2 / raytrain-2: {calls[0] / calls[1]:.2f}   goal <= 0.5")
    print()
    print("where a step goes (ms per step, medians of the best round; raylm: its slowest "
          "rank, raylm.runtime.profiling; a baseline's gradient all-reduce is inside its "
          "backward; 'rest' is the step time the parts do not cover)")
    cols = (("data_wait_s", "data"), ("forward_backward_s", "fwd+bwd"),
            ("grad_sync_s", "grad sync"), ("clip_s", "clip"), ("optimizer_s", "optimizer"),
            ("boundary_idle_s", "boundary"))
    print(f"{'run':<12} " + " ".join(f"{title:>10}" for _, title in cols) + f" {'rest':>10}")
    for name in rows:
        parts = best[name].get("parts") or {}
        covered = sum(parts.get(k, 0.0) for k, _ in cols)
        cells = [f"{parts[k] * 1000:>10.1f}" if k in parts else f"{'-':>10}" for k, _ in cols]
        print(f"{name:<12} " + " ".join(cells)
              + f" {(best[name]['median_s'] - covered) * 1000:>10.1f}")
    print()
    for name in ("raylm-1", "raylm-2"):
        if name in best and "run_wall_s" in best[name]:
            r = best[name]
            print(f"{name}: mean data wait {r['data_wait_s'] * 1000:.2f} ms/step; whole "
                  f"train() call {r['run_wall_s']:.1f} s (start-up and final save included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "ratios": ratios}, f, indent=2)
    goals = {f"{a}/{b}": goal for a, b, goal in GOALS}
    figures = {
        "config": {"model": f"gpt2 {config_overrides(args)}", "block_size": args.block_size,
                   "global_batch": args.global_batch, "warmup": args.warmup,
                   "steps": args.steps, "rounds": args.repeat, "quick": args.quick},
        "rows": {name: {
            "procs": best[name]["procs"], "median_s": best[name]["median_s"],
            "mean_s": best[name]["mean_s"], "tokens_per_s_best": best[name]["tokens_per_s"],
            "tokens_per_s_median": med[name], "first_loss": best[name]["first_loss"],
            "last_loss": best[name]["last_loss"],
            "whole_call_s": statistics.median(x["run_wall_s"] for x in runs[name]),
            "parts_ms": {k: 1000 * v for k, v in (best[name].get("parts") or {}).items()}}
            for name in rows},
        "ratios": {k: dict(v, goal=goals[k]) for k, v in ratios.items()}}
    if "raylm-2" in best and "raytrain-2" in best:
        figures["whole_call"] = {"raylm-2/raytrain-2": (
            figures["rows"]["raylm-2"]["whole_call_s"]
            / figures["rows"]["raytrain-2"]["whole_call_s"]), "goal_max": 0.5}
    print(f"written to {write('bench_throughput' + ('-quick' if args.quick else ''), figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
