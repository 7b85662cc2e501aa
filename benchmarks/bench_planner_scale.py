"""The planner at cluster scale: `raylm plan` for Llama 3 70B and 405B on 1,024 to 16,384
GPUs, timed, with the layout it picks beside the one published for such a run.

    python benchmarks/bench_planner_scale.py            # every row, ~1 min here
    python benchmarks/bench_planner_scale.py --runs 3   # median of 3 timings a row

Each row runs what `raylm plan` runs (raylm.report.plan_report.build_plan_report, no
Ray, the model on the meta device) for bf16 on H100-class GPUs, 8 to a node, sequences
of 8,192 tokens, one sequence per GPU (raylm's global batch is
--per_device_train_batch_size x --num_workers, whatever the layout). Published layouts:
torchtitan's Llama 3 70B preset (train_configs/llama3_70b.toml: tp=8, FSDP over the
rest, pp=1; 64 GPUs) and Llama 3's 405B runs (The Llama 3 Herd of Models, table 4:
tp=8, cp=1, pp=16, dp=64 on 8,192 GPUs and dp=128 on 16,384, 16M tokens a batch).
Prints the wall time of each plan, the planner's own search time, the layouts it
weighed, its choice and its predicted memory and step; writes them to
benchmarks/results/bench_planner_scale-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAMA3 = {
    "70B": "hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,"
           "num_attention_heads=64,num_key_value_heads=8",
    "405B": "hidden_size=16384,intermediate_size=53248,num_hidden_layers=126,"
            "num_attention_heads=128,num_key_value_heads=8",
}
COMMON = ",vocab_size=128256,max_position_embeddings=8192"
# (model, GPUs, the published layout for that model at that scale: its words, its
# (dp, tp, pp), where it is from)
ROWS = [
    ("70B", 1024, "tp=8, FSDP (ZeRO-3) over the rest, pp=1", (128, 8, 1),
     "torchtitan llama3_70b.toml"),
    ("70B", 16384, "tp=8, FSDP (ZeRO-3) over the rest, pp=1", (2048, 8, 1),
     "torchtitan llama3_70b.toml"),
    ("405B", 8192, "dp=64 x tp=8 x pp=16, cp=1", (64, 8, 16), "Llama 3 paper, table 4"),
    ("405B", 16384, "dp=128 x tp=8 x pp=16, cp=1", (128, 8, 16), "Llama 3 paper, table 4"),
]


def plan_once(size: str, gpus: int, train_file: str, layout=(0, 0, 0), **flags) -> tuple:
    """(wall seconds, the report) of one `raylm plan`; ``layout`` (dp, tp, pp): fixed by
    the flags (0, 0, 0: the planner's choice); ``flags``: more of them."""
    from raylm.config import TrainConfig
    from raylm.report.plan_report import build_plan_report

    cfg = TrainConfig(model_type="llama", config_overrides=LLAMA3[size] + COMMON,
                      block_size=8192, use_gpu=True, bf16=True, workers_per_node=8,
                      per_device_train_batch_size=1, num_workers=gpus,
                      train_file=[train_file], output_dir=os.devnull,
                      # a fixed layout's global batch is dp x per-device x accumulation:
                      # the planner's (one sequence per GPU) through accumulation
                      gradient_accumulation_steps=gpus // layout[0] if layout[0] else 1,
                      **dict(zip(("dp", "tp", "pp"), layout)), **flags)
    t0 = time.perf_counter()
    report = build_plan_report(cfg)
    return time.perf_counter() - t0, report


def figures_of(chosen: dict) -> dict:
    """What the table shows of a planned layout (a report's "chosen")."""
    return {"zero_stage": chosen["zero_stage"], "recompute": chosen["recompute"],
            "fits": chosen["fits"], "memory_per_worker_gib": chosen["memory"]["total"] / 2**30,
            "workspace_gib": chosen["memory"]["workspace"] / 2**30,
            "predicted_step_s": chosen["time"]["step"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="timings of each row (median)")
    args = ap.parse_args(argv)

    from raylm.data.sources import builtin_sample_files
    from raylm.errors import ConfigError

    play = builtin_sample_files()[0]  # (the plan reads no data; the flag must name a file)
    plan_once("70B", 1024, play)  # imports and caches outside the timings
    rows = {}

    for size, gpus, published, fixed, source in ROWS:
        times, report = [], None
        for _ in range(args.runs):
            wall, report = plan_once(size, gpus, play)
            times.append(wall)
        chosen, planner = report["chosen"], report["planner"]
        rows[f"llama3-{size}-{gpus}"] = {
            "model": f"Llama 3 {size}", "gpus": gpus,
            "parameters": report["model"]["parameters"],
            "plan_s": statistics.median(times),
            "search_s": planner["elapsed_s"], "layouts_weighed": planner["evaluated"],
            "global_batch": planner["global_batch"],
            "layout": {k: chosen[k] for k in ("dp", "tp", "pp")},
            "schedule": chosen["schedule"] if chosen["pp"] > 1 else None,
            "sequence_parallel": chosen["sequence_parallel"], **figures_of(chosen),
            "published": published, "published_source": source}
        try:  # the published layout, in raylm's cost model: the settings the planner
            # gives it, or where none fits, its least memory (ZeRO-3, full recompute)
            mine = plan_once(size, gpus, play, fixed)[1]["chosen"]
            if not mine["fits"]:
                mine = plan_once(size, gpus, play, fixed, zero_stage=3,
                                 activation_checkpointing="full")[1]["chosen"]
            rows[f"llama3-{size}-{gpus}"]["published_in_raylm"] = figures_of(mine)
        except ConfigError as e:
            rows[f"llama3-{size}-{gpus}"]["published_in_raylm"] = {"error": str(e)}
        r = rows[f"llama3-{size}-{gpus}"]
        print(f"Llama 3 {size:>4} on {gpus:>6,} GPUs: plan {r['plan_s']:.2f} s (search "
              f"{r['search_s'] * 1000:.0f} ms, {r['layouts_weighed']} layouts); chosen "
              f"dp={r['layout']['dp']} x tp={r['layout']['tp']} x pp={r['layout']['pp']} "
              f"ZeRO-{r['zero_stage']} {r['recompute']} recompute, "
              f"{r['memory_per_worker_gib']:.1f} GiB/GPU, step {r['predicted_step_s']:.1f} s"
              f"; published: {published} ({source})")
        p = r["published_in_raylm"]
        print("    the published layout in raylm's cost model: " + (
            p["error"] if "error" in p else
            f"ZeRO-{p['zero_stage']} {p['recompute']} recompute, "
            f"{p['memory_per_worker_gib']:.1f} GiB/GPU"
            + ("" if p["fits"] else " (does not fit)")
            + f", step {p['predicted_step_s']:.1f} s"))
    from benchmarks.results import write

    figures = {"config": {"runs": args.runs, "seq_len": 8192, "precision": "bf16",
                          "gpus_per_node": 8, "per_device_train_batch_size": 1,
                          "cost_model": "raylm's GPU defaults (--use_gpu)"},
               "rows": rows}
    print(f"written to {write('bench_planner_scale', figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
