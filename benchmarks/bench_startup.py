"""Where a `raylm train` call's start-up goes, part by part (Driver.startup, written to
all_results.json as startup_s and logged as "started in ...").

    python benchmarks/bench_startup.py              # 3 runs of each row (~2 min here)
    python benchmarks/bench_startup.py --runs 5

Rows, a tiny GPT-2 (2 x 32) on one play for 2 steps, so that the start-up is nearly all of
the call:

  cold-1, cold-2   `raylm train` as a command, 1 and 2 ranks: it starts Ray itself
  eval-1, eval-2   the same command evaluating the model the cold-N run saved
                   (--do_eval without --do_train, the play as --validation_file)
  warm-1, warm-2   `raylm.train(...)` in a driver that has Ray running and has trained once
                   (the data cached), as a script or a notebook running several trainings
  kept-1, kept-2   the same inside `raylm.keep_ranks()`: each run takes the rank processes
                   the last run of its shape left up (the first run of each shape starts
                   them and is not counted)

Prints the median seconds of each part over the runs, and the whole call's wall time;
writes them to benchmarks/results/bench_startup-<date>.json.
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
VENV_BIN = os.path.dirname(sys.executable)
TINY = ("n_layer=2,n_embd=32,n_head=2,n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,"
        "attn_pdrop=0.0")


def flags(out: str, cache: str, play: str, workers: int) -> dict:
    return dict(model_type="gpt2", config_overrides=TINY, train_file=[play], block_size=32,
                data_cache_dir=cache, output_dir=out, overwrite_output_dir=True, max_steps=2,
                save_steps=10**6, logging_steps=1, disable_tqdm=True, do_eval=False,
                per_device_train_batch_size=2, num_workers=workers,
                cpus_per_worker=1 / workers)


def command(args: dict, out: str) -> dict:
    """Run `raylm train` with ``args``: its all_results.json's startup_s and the call's wall
    time."""
    argv = []
    for k, v in args.items():
        if v is True:
            argv.append(f"--{k}")
        elif v is not False:
            argv += [f"--{k}", *(map(str, v) if isinstance(v, list) else [str(v)])]
    t0 = time.time()
    subprocess.run([os.path.join(VENV_BIN, "raylm"), "train", *argv], check=True,
                   capture_output=True, text=True)
    wall = time.time() - t0
    return {**json.load(open(os.path.join(out, "all_results.json")))["startup_s"],
            "call": wall}


def cold(out: str, cache: str, play: str, workers: int) -> dict:
    return command(flags(out, cache, play, workers), out)


def evaluate(model: str, out: str, cache: str, play: str, workers: int) -> dict:
    """An eval-only run of the saved ``model`` on ``play``."""
    return command(dict(model_name_or_path=model, validation_file=[play], block_size=32,
                        data_cache_dir=cache, output_dir=out, do_train=False, do_eval=True,
                        per_device_eval_batch_size=2, num_workers=workers,
                        cpus_per_worker=1 / workers), out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each row (default 3)")
    args = ap.parse_args(argv)

    import ray

    from raylm import TrainConfig, keep_ranks, train
    from raylm.data.sources import builtin_sample_files
    from raylm.runtime.cluster import start_local
    from raylm.runtime.driver import STARTUP_PARTS

    play = [f for f in builtin_sample_files() if f.endswith("macbeth.txt")][0]
    work = tempfile.mkdtemp(prefix="raylm-startup-")
    cache = os.path.join(work, "cache")
    rows: dict[str, list[dict]] = {}
    try:
        for workers in (1, 2):
            rows[f"cold-{workers}"] = [cold(os.path.join(work, f"c{workers}-{i}"), cache, play,
                                            workers) for i in range(args.runs)]
        for workers in (1, 2):
            rows[f"eval-{workers}"] = [evaluate(os.path.join(work, "c1-0"),
                                                os.path.join(work, f"e{workers}-{i}"), cache,
                                                play, workers) for i in range(args.runs)]
        start_local(num_cpus=2, log_to_driver=False)  # as `raylm train` starts Ray
        train(TrainConfig(**flags(os.path.join(work, "first"), cache, play, 1)))
        for workers in (1, 2):
            runs = []
            for i in range(args.runs):
                t0 = time.time()
                r = train(TrainConfig(**flags(os.path.join(work, f"w{workers}-{i}"), cache,
                                              play, workers)))
                runs.append({**r.metrics["startup_s"], "call": time.time() - t0})
            rows[f"warm-{workers}"] = runs
        for workers in (1, 2):
            with keep_ranks():
                runs = []
                for i in range(args.runs + 1):
                    t0 = time.time()
                    r = train(TrainConfig(**flags(os.path.join(work, f"k{workers}-{i}"),
                                                  cache, play, workers)))
                    runs.append({**r.metrics["startup_s"], "call": time.time() - t0})
            rows[f"kept-{workers}"] = runs[1:]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    cols = [(k, t) for k, t in STARTUP_PARTS if k != "restore"] + [
        ("first_step", "1st step"), ("call", "whole call")]
    print(f"median seconds over {args.runs} run(s); 'whole call' includes the final save "
          "and Ray's shutdown (cold rows)")
    print(f"{'row':<8}" + "".join(f"{t:>15}" for _, t in cols))
    for name, runs in rows.items():
        cells = [statistics.median(r.get(k, 0.0) for r in runs) for k, _ in cols]
        print(f"{name:<8}" + "".join(f"{c:>15.2f}" for c in cells))
    from benchmarks.results import write

    figures = {"config": {"runs": args.runs, "model": f"gpt2 {TINY}", "steps": 2},
               "rows": {name: {"parts_s": {t: statistics.median(r.get(k, 0.0) for r in runs)
                                           for k, t in cols if k != "call"},
                               "whole_call_s": statistics.median(r["call"] for r in runs)}
                        for name, runs in rows.items()}}
    print(f"written to {write('bench_startup', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
