"""Tables and plots made from the result files in benchmarks/results/, never by hand.

    python benchmarks/report.py                    # every benchmark's tables
    python benchmarks/report.py bench_throughput   # one benchmark's (and its variants')

A benchmark script writes its figures with ``benchmarks.results.write(NAME, figures)`` to
``benchmarks/results/NAME-<date>.json`` (with the date, the commit and the machine); every
dated file is kept. ``NAME-VARIANT`` is the same script run another way (``-quick``: its
small preset, ``-cpu``: a GPU script on CPU, ...), shown under the main result.

- ``tables(name)``: markdown of the newest file of ``name`` and of each variant, each
  stating the date, commit and machine it came from, with the pictures of it
  (``figures/<file>.png``: the docs pages that hold the markers live in docs/benchmarks/);
  a benchmark with no file yet gets a line saying so, and the command that makes one.
- ``plots()``: ``{"file.png": PNG bytes}`` for every picture ``tables`` links (matplotlib,
  Agg); docs/hooks.py adds them to the site as ``benchmarks/figures/file.png``.

The figures are nested dicts, rendered generically (a dict of dicts is a table, a row
each); the benchmarks whose generic table reads badly have a small spec below.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks.results import files, names  # noqa: E402 -- the naming is results.py's
RATE = re.compile(r"per_s(_|$)")  # tokens/s, rows/s: thousands
UNIT = re.compile(r"_(s|ms|mib|kib)$")
RATIO_WORDS = ("ratio", "vs_", "/", "_over_", "share", "goodput", "mfu")

# The command that writes each result (variants: the base's command with these flags).
COMMANDS = {
    "bench_throughput": "python benchmarks/bench_throughput.py",
    "bench_boundary": "python benchmarks/bench_boundary.py",
    "bench_ray_idle": "python benchmarks/bench_ray_idle.py",
    "bench_startup": "python benchmarks/bench_startup.py",
    "bench_planner_scale": "python benchmarks/bench_planner_scale.py",
    "bench_control_plane": "python benchmarks/bench_control_plane.py",
    "bench_pipeline": "python benchmarks/bench_pipeline.py",
    "bench_layouts": "python benchmarks/bench_layouts.py",
    "bench_zero": "python benchmarks/bench_zero.py",
    "bench_collectives": "python benchmarks/bench_collectives.py",
    "bench_precision": "python benchmarks/bench_precision.py",
    "bench_data": "python benchmarks/bench_data.py",
    "bench_given": "python benchmarks/bench_given.py",
    "bench_image_cache": "python benchmarks/bench_image_cache.py",
    "bench_output_store": "python benchmarks/bench_output_store.py",
    "bench_elastic": "python benchmarks/bench_elastic.py",
    "bench_elastic_quiet": "python benchmarks/bench_elastic.py --quiet_only",
    "bench_elastic_two_nodes": "python benchmarks/bench_elastic.py --two_nodes_only",
    "bench_elastic_soak": "python benchmarks/bench_elastic.py --soak_only --soak_minutes 10",
    "bench_elastic_raytrain": "python benchmarks/bench_elastic.py",
    "bench_gpu": "python benchmarks/bench_gpu.py",
    "bench_swin": "python benchmarks/bench_swin.py",
    "bench_dropout": "python benchmarks/bench_dropout.py",
    "gpu_recovery": "python benchmarks/gpu_recovery.py",
}
VARIANTS = {"quick": ("--quick", "the small preset: a check of the script, not a measurement"),
            "cpu": ("--cpu", "on CPU: a check of the script where there is no GPU"),
            "mmap": ("--malloc_mmap_threshold 1048576",
                     "glibc's mmap threshold fixed at 1 MiB"),
            "no_data": ("--no_data", "no Ray Data pipeline before the window"),
            "dropout": ("--dropout 0.1", "dropout 0.1 everywhere: raylm's per-sample masks "
                        "against torch's own dropout"),
            "sdpa": ("--per_sample_attention_dropout false",
                     "attention dropout left in sdpa's fused kernel, drawn per rank")}
CPU_FLAGS = {"bench_gpu": "--device cpu", "bench_swin": "--device cpu"}  # their "-cpu"


# ---------------------------------------------------------------------------------------
# Result files

def variants(name: str) -> list:
    return [n for n in names() if n.startswith(name + "-")]


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def command(name: str) -> str:
    base, *rest = name.split("-")
    cmd = COMMANDS.get(base, f"python benchmarks/{base}.py")
    for v in rest:
        flag = CPU_FLAGS.get(base) if v == "cpu" and base in CPU_FLAGS else (
            VARIANTS.get(v, (f"(variant {v})",))[0])
        if flag and flag not in cmd:
            cmd += " " + flag
    return cmd


# ---------------------------------------------------------------------------------------
# Formatting

LABELS = {  # keys whose generic title reads badly
    "step_s_watched": "fault-free step, watched (s)",
    "step_s_unwatched": "fault-free step, heartbeats never due (s)",
    "watch_overhead": "watched / unwatched - 1",
    "step_s_runs": "fault-free step of each run (s)",
    "worker_health_check_timeout_s_default": "worker health check timeout, Ray's default (s)",
    "kill_imports_model_ckpt_ddp_s": "kill: imports, model, checkpoint, DDP (s)",
    "max_rel_loss_diff": "max rel. loss diff",
    "step_s": "fault-free step, median (s)",
    "boundary_idle_s": "of it, the step boundary, median (s)",
    "boundary_share": "boundary / step",
    "step_s_world3_median": "fault-free step at 3 workers, median (s)",
}


def label(key: str) -> str:
    """A figure's key as a column title: units out of the suffix."""
    if key in LABELS:
        return LABELS[key]
    key = re.sub(r"_per_s(?=_|$)", "/s", key)
    for suffix, unit in (("_ms", "ms"), ("_s", "s"), ("_mib", "MiB"), ("_kib", "KiB")):
        if key.endswith(suffix):
            return f"{key[:-len(suffix)].replace('_', ' ')} ({unit})"
    return key.replace("_", " ")


def num(v: float, key: str = "") -> str:
    """A number as a table shows it: thousands for rates, 3 decimals for ratios, two
    significant decimals where small, scientific where tiny."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    k = key.lower()
    if RATE.search(k):
        return f"{v:,.0f}"
    if "diff" in k or (v != 0 and abs(v) < 1e-3):
        return f"{v:.1e}"
    if not UNIT.search(k) and any(w in k for w in RATIO_WORDS):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    a = abs(v)
    return f"{v:,.0f}" if a >= 1000 else f"{v:.1f}" if a >= 100 else f"{v:.2f}" if a >= 1 \
        else f"{v:.3f}" if a >= 0.1 or a == 0 else f"{v:.4f}"


def cell(v, key: str = "") -> str:
    if isinstance(v, dict):
        return "; ".join(f"{label(k)} {cell(x, k)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(cell(x, key) for x in v) if len(v) <= 8 else f"{len(v)} values"
    if isinstance(v, str):
        return v.replace("|", "\\|").replace("\n", " ")
    return num(v, key)


def table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def columns(rows: dict, first: str, spec: list) -> list:
    """A table with a row per entry of ``rows`` (name -> dict): the name, then for each
    (title, how) of ``spec`` the row's value: ``how`` is a key (shown by num) or a
    function of the row."""
    return table([first] + [title for title, _ in spec],
                 [[f"`{k}`"] + [how(r) if callable(how) else num(r.get(how), how)
                                for _, how in spec] for k, r in rows.items()])


def losses(r: dict) -> str:
    """A run's first and last loss."""
    if r.get("first_loss") is None:
        return ""
    return f"{num(r['first_loss'])} -> {num(r['last_loss'])}"


def rows_table(rows: dict) -> list:
    cols = list(dict.fromkeys(c for x in rows.values() for c in x))
    return table([""] + [label(c) for c in cols],
                 [[f"`{r}`"] + [cell(x.get(c), c) for c in cols] for r, x in rows.items()])


def generic(fig: dict, skip=()) -> list:
    """Markdown of a figures dict: its scalars in a figure | value table, each dict of
    dicts a table of its own (a row each), each other dict a figure | value table."""
    if fig and all(isinstance(v, dict) and not any(isinstance(x, dict) for x in v.values())
                   for v in fig.values()):
        return rows_table(fig)
    out = []
    scalars = [(k, v) for k, v in fig.items() if not isinstance(v, dict) and k not in skip]
    if scalars:
        out += table(["figure", "value"], [[label(k), cell(v, k)] for k, v in scalars])
    for k, v in fig.items():
        if not isinstance(v, dict) or k in skip or k == "config" or not v:
            continue
        if k not in ("rows", "runs"):
            out += [f"**{label(k)}**", ""]
        out += rows_table(v) if all(isinstance(x, dict) for x in v.values()) else generic(v)
    return out


def config_line(cfg: dict) -> list:
    if not cfg:
        return []
    parts = []
    for k, v in cfg.items():
        if v is None or v is False or v == []:
            continue
        shown = (f"`{v}`" if isinstance(v, str) else "yes" if v is True else
                 f"{v:g}" if isinstance(v, float) else cell(v, k))
        parts.append(f"{label(k)} {shown}")
    return ["Settings: " + "; ".join(parts) + ".", ""]


def provenance(name: str, date: str, doc: dict, dates: list) -> str:
    m = doc.get("machine", {})
    commit = doc.get("commit", "unknown")
    note = " (with uncommitted changes)" if commit.endswith("+changes") else ""
    earlier = [d for d in dates if d != date]
    more = (f" Earlier files: {', '.join(earlier)}." if earlier else "")
    when = str(doc.get("date", date)).replace("T", " ")
    when = re.sub(r":\d\d\+00:00$", " UTC", when)
    return (f"*From `benchmarks/results/{name}-{date}.json`: {when}, "
            f"commit `{commit}`{note}, {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
            f"{m.get('system', '?')}.{more}*")


def ratio_met(r: dict) -> str:
    goal, rounds = r.get("goal"), r.get("per_round") or []
    if goal is None:
        return "(a default on / off)"
    met = sum(x >= goal for x in rounds)
    return f">= {goal:g}: met in {met} of {len(rounds)} round(s)"


PARTS = ("data_wait_s", "forward_backward_s", "grad_sync_s", "clip_s", "optimizer_s",
         "boundary_idle_s")  # raylm.runtime.profiling.BREAKDOWN's order


def parts_table(rows: dict, key: str = "parts_ms", step: str = "median_s") -> list:
    """ms per step of each row's parts (raylm.runtime.profiling), and the rest."""
    cols = list(dict.fromkeys(c for r in rows.values() for c in (r.get(key) or {})))
    if not cols:
        return []
    cols.sort(key=lambda c: PARTS.index(c) if c in PARTS else len(PARTS))
    out = []
    for name, r in rows.items():
        parts = r.get(key) or {}
        rest = 1000 * r[step] - sum(parts.values()) if step in r else None
        out.append([f"`{name}`"] + [f"{parts[c]:.1f}" if c in parts else "-" for c in cols]
                   + ["n/a" if rest is None else f"{rest:.1f}"])
    return table([""] + [c.removesuffix("_s").replace("_", " ") for c in cols] + ["rest"],
                 out)


# ---------------------------------------------------------------------------------------
# Per-benchmark tables (the rest: generic)

def t_throughput(f: dict) -> list:
    rows = f["rows"]
    out = ["tokens/s = global batch x block size / median steady-state step time; best "
           "and median of the rounds.", ""]
    out += columns(rows, "run", [
        ("processes x threads", lambda r: r["procs"]), ("tokens/s best", "tokens_per_s_best"),
        ("tokens/s median", "tokens_per_s_median"), ("s/step (best round)", "median_s"),
        ("loss first -> last", losses), ("whole call (s)", "whole_call_s")])
    if f.get("ratios"):
        out += table(["ratio of tokens/s", "best rounds", "median rounds", "per round",
                      "goal"],
                     [[f"`{k}`", num(r["best"], "ratio"), num(r["median"], "ratio"),
                       cell(r["per_round"], "ratio"), ratio_met(r)]
                      for k, r in f["ratios"].items()])
    if f.get("whole_call"):
        w = f["whole_call"]
        out += [f"Whole call, `raylm-2` / `raytrain-2`: "
                f"{num(w['raylm-2/raytrain-2'], 'ratio')} (goal <= {w['goal_max']:g}).", ""]
    out += ["Where a step goes, ms (medians of the best round; raylm: its slowest rank; a "
            "baseline's all-reduce is inside its backward):", ""]
    return out + parts_table(rows)


def t_boundary(f: dict) -> list:
    return columns({k.removeprefix("ranks_"): r for k, r in f.items()}, "ranks", [
        ("bare actor (ms)", "bare_ms"), ("raylm (ms)", "raylm_ms"),
        ("raylm - bare (ms)", lambda r: num(r["raylm_ms"] - r["bare_ms"])),
        ("raylm step (ms)", "step_ms"),
        ("steps sent ahead", lambda r: f"{r['sent_ahead']} of {r['steps']}")])


def t_pipeline(f: dict) -> list:
    s = f["schedules"]
    out = columns(s, "schedule", [
        ("v", "v"), ("measured (s)", "measured_s"), ("formula (s)", "formula_s"),
        ("sim (s)", "sim_s"), ("sim' (s)", "own_sim_s"), ("/formula", "ratio_formula"),
        ("/sim", "ratio_sim"), ("/sim, median round", "ratio_sim_median_rounds"),
        ("/sim'", "ratio_own_sim"), ("overhead/mb (ms)", "overhead_per_mb_ms"),
        ("overhead/op (ms)", "overhead_per_op_ms"),
        ("overhead/op vs sim' (ms)", "overhead_per_op_own_ms")])
    goal = f.get("goal")
    if goal and goal["schedule"] in s:
        out += [f"Goal: `{goal['schedule']}` measured / sim <= {goal['max_ratio_sim']:g}.", ""]
    br = {k: r["breakdown"] for k, r in s.items() if r.get("breakdown")}
    if br:
        out += ["Where the overhead goes (mean wait per op, and occurrences per step over "
                "all ranks; sleep+: a sleep's overshoot, the OS's):", ""]
        out += columns(br, "schedule", [
            ("handoff (ms)", "handoff_ms"), ("handoffs", "handoffs"), ("local (ms)", "local_ms"),
            ("locals", "locals"), ("sleep+ (ms)", "sleep_over_ms")])
    own = {k: r for k, r in s.items() if "own_f_ms" in r}
    if own:
        out += ["The synthetic stage's own cost per op (a plain loop, no pipeline):", ""]
        out += columns(own, "schedule", [("F own (ms)", "own_f_ms"),
                                          ("B own (ms)", "own_b_ms")])
    peaks = f.get("peak_activation_kib") or {}
    if peaks:
        out += ["Peak saved activation per stage, KiB, measured / expected from the action "
                "order:", ""]
        out += table(["schedule", "per stage"],
                     [[f"`{k}`", ", ".join(f"{st} {m}/{e}" for st, (m, e) in p.items())]
                      for k, p in peaks.items()])
    return out


def t_zero(f: dict) -> list:
    runs = f["runs"]
    out = columns(runs, "run", [
        ("stage", "stage"), ("dp", "dp"), ("s/step", "median_s"), ("tokens/s", "tokens_per_s"),
        ("vs stage 0", "vs_stage0"), ("peak RSS max (MiB)", "rss_max_mib"),
        ("mean (MiB)", "rss_mean_mib"), ("loss first -> last", losses),
        ("max abs loss diff vs stage 0", "max_loss_diff_vs_stage0")])
    psi = f.get("psi")
    out += [("State per rank, MiB, measured (largest rank) / the ZeRO paper's figure"
             + (f" for Psi = {psi:,} parameters" if psi else "") + ":"), ""]
    kinds = ("parameters", "gradients", "optimizer")
    out += table(["run"] + list(kinds) + ["state", "measured / theory", "activations (MiB)"],
                 [[f"`{k}`"] + [f"{num(r['state_mib'][x][0])} / {num(r['state_mib'][x][1])}"
                                for x in kinds]
                  + [f"{num(r['held_mib'])} / {num(r['theory_mib'])}",
                     "-".join(f"{x:.3f}" for x in r["measured_over_theory"]),
                     num(r["activations_mib"])] for k, r in runs.items()])
    out += ["Where a step goes, ms (medians; each step's slowest rank):", ""]
    return out + parts_table(runs)


def t_layouts(f: dict) -> list:
    return columns(f["layouts"], "layout", [
        ("dp x pp x tp", lambda r: f"{r['dp']} x {r['pp']} x {r['tp']}"),
        ("s/step", "median_s"), ("tokens/s", "tokens_per_s"), ("vs dp4", "vs_dp4"),
        ("peak RSS max (MiB)", "rss_max_mib"), ("mean (MiB)", "rss_mean_mib"),
        ("held/rank (MiB)", "held_mib"), ("predicted (MiB)", "predicted_mib"),
        ("loss first -> last", losses)])


def mfu(r: dict) -> str:
    return f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"


def t_precision(f: dict) -> list:
    return columns(f["runs"], "run", [
        ("s/step", "median_s"), ("tokens/s", "tokens_per_s"), ("vs fp32", "vs_fp32"),
        ("kept for backward (MiB)", "activations_mib"),
        ("predicted (MiB)", "predicted_activations_mib"),
        ("weight copies (MiB)", "weight_copies_mib"),
        ("predicted (MiB)", "predicted_weight_copies_mib"),
        ("peak RSS max (MiB)", "rss_max_mib"),
        ("max abs loss diff vs fp32", "max_loss_diff_vs_fp32"), ("MFU", mfu)])


def t_startup(f: dict) -> list:
    rows = f["rows"]
    cols = list(dict.fromkeys(c for r in rows.values() for c in r["parts_s"]))
    return ["Medians in seconds; the whole call includes the final save (and, cold, Ray's "
            "start and shutdown).", ""] + table(
        ["row"] + cols + ["whole call"],
        [[f"`{k}`"] + [f"{r['parts_s'].get(c, 0.0):.2f}" for c in cols]
         + [f"{r['whole_call_s']:.2f}"] for k, r in rows.items()])


def t_data(f: dict) -> list:
    out = columns(f["rows"], "row", [("first (s)", "first_s"), ("pass (s)", "pass_s"),
                                     ("tokens", "tokens"), ("tokens/s", "tokens_per_s")])
    t = f.get("train_streaming")
    if t:
        out += table(["`raylm.train --streaming`", ""],
                     [["time to the first step (s)", num(t["first_step_s"])],
                      ["data wait, share of step time", f"{100 * t['wait_share']:.2f}%"],
                      ["steps measured", num(t["steps"])],
                      ["tokens/s", num(t["tokens_per_second"], "per_s")],
                      ["whole call (s)", num(t["wall_s"])]])
    return out


def t_ray_idle(f: dict) -> list:
    procs = f["percent_of_one_core"]
    modes = list(f["total_percent_of_one_core"])
    return ["% of one core over the window, median of the rounds:", ""] + table(
        ["process"] + [f"`{m}`" for m in modes],
        [[k] + [f"{v.get(m, 0.0):.2f}" for m in modes] for k, v in procs.items()]
        + [["**total**"] + [f"**{f['total_percent_of_one_core'][m]:.2f}**" for m in modes]])


def t_collectives(f: dict) -> list:
    rows = f["rows"]
    kinds = list(dict.fromkeys(k for r in rows.values() for k in r["ms"]))
    return ["Median ms per call, rank 0's:", ""] + table(
        ["processes", "MiB"] + kinds,
        [[r["procs"], f"{r['mib']:g}"] + [f"{r['ms'][k]:.1f}" for k in kinds]
         for r in rows.values()])


def t_gpu(f: dict) -> list:
    rows = f["rows"]
    out = columns(rows, "row", [
        ("s/step", "median_s"), ("tokens/s", "tokens_per_s"), ("MFU", mfu),
        ("vs plain", "vs_plain"), ("max abs loss diff", "max_loss_diff"),
        ("max rel. grad-norm diff", "max_rel_grad_norm_diff"),
        ("loss first -> last", losses), ("whole call (s)", "whole_call_s")])
    if f.get("failed"):
        out += ["Failed rows: " + ", ".join(f"`{x}`" for x in f["failed"]) + ".", ""]
    out += ["Where a step goes, ms (medians):", ""] + parts_table(rows)
    for note in f.get("notes") or []:
        out += ["- " + note.splitlines()[0].replace("|", "\\|")]
    return out + [""]


def t_control_plane(f: dict) -> list:
    rows = sorted(f["rows"].values(), key=lambda r: (r.get("protocol", "driver"), r["ranks"]))
    models = f["models"]
    out = table(["protocol", "ranks", "driver CPU a step (ms)", "step (ms)",
                 "boundary idle (ms)", "driver peak RSS (MiB)",
                 "a rank lost: detect and settle (s)", "regroup (s)",
                 "a rank joins: pause (s)"],
                [[r.get("protocol", "driver"), r["ranks"], f"{r['driver_cpu_ms']:.2f}",
                  f"{r['step_ms']:.2f}", num(r["boundary_idle_ms"]),
                  f"{r['driver_peak_rss_bytes'] / 2**20:.0f}",
                  num(r.get("detect_settle_s")), num(r.get("regroup_s")),
                  num(r.get("join_pause_s"))] for r in rows])
    split = [r for r in rows if "per_step_cpu_ms" in r]
    if split:
        sleep = f["config"].get("sleep_ms", 0)
        out += ["", f"The driver's CPU a step split, from a second run whose steps sleep "
                f"{sleep:.0f} ms longer (c = a + b x step time), and the function calls its "
                "thread makes a step:", ""]
        out += table(["protocol", "ranks", "step (ms)", f"step + {sleep:.0f} ms (ms)",
                      "driver CPU a step (ms)", "the same, longer steps (ms)",
                      "part a step (ms)", "part a second (ms)", "driver's calls a step"],
                     [[r["protocol"], r["ranks"], f"{r['step_ms']:.1f}",
                       f"{r['slow_step_ms']:.1f}", f"{r['driver_cpu_ms']:.2f}",
                       f"{r['slow_driver_cpu_ms']:.2f}", f"{r['per_step_cpu_ms']:.2f}",
                       f"{r['per_second_cpu_ms']:.2f}",
                       num(r.get("driver_calls_a_step"))] for r in split])
    out.append("")

    def fits(title: str, m: dict) -> list:
        fitted = ", ".join(str(n) for n in m["fitted_on"])
        return [f"**{title}**, fitted on {fitted} ranks; {m['held_back']} ranks held "
                f"back, measured {m['held_back_measured_ms']:.2f} ms "
                f"(assumed: {m['assumption']}):", ""] + table(
            ["shape", "a (ms)", "b (ms)", f"predicted at {m['held_back']} (ms)",
             "extrapolated to 1,000 ranks (ms)", "to 10,000 (ms)"],
            [[form["shape"] + (" (nearer)" if name == m["better"] else ""),
              f"{form['intercept_ms']:.3f}", f"{form['slope_ms']:.4f}",
              f"{form['held_back_predicted_ms']:.2f}",
              f"{form['extrapolated_ms']['1000']:,.1f}",
              f"{form['extrapolated_ms']['10000']:,.1f}"]
             for name, form in m["forms"].items()]) + [""]

    for protocol, m in models.items():
        out += fits(f"{protocol}, driver CPU a step", m)
        for key, words in (("per_step_cpu_ms", "its part a step"),
                           ("per_second_cpu_ms", "its part a second")):
            if key in m.get("split", {}):
                out += fits(f"{protocol}, {words}", m["split"][key])
    sim = f.get("simulated")
    if sim:
        left = sim["measured_over_simulated_ms"]
        out += ["The driver's own work a step under the ranks' protocol, simulated without "
                "Ray (rank 0's answer unpickled, the real Reporter, the step deadline); "
                "Ray's receipt of that answer, measured alone (an actor's streaming "
                "generator); and what the measured part a step holds over the two (the "
                "driver's other Ray calls, and what the cores' other processes cost each "
                "call):", ""]
        out += table(["ranks", "simulated CPU a step (ms)", "calls a step",
                      "history a step (bytes)", "rank 0's answer (bytes)",
                      "its receipt (ms)", "measured over the two (ms)"],
                     [[r["ranks"], f"{r['cpu_ms']:.3f}", f"{r['calls_a_step']:,.0f}",
                       f"{r['history_bytes_a_step']:,.0f}", f"{r['answer_bytes']:,}",
                       num(r.get("receipt_ms")), num(left.get(n))]
                      for n, r in sim["rows"].items()]) + [""]
        at = sim.get("at_1000_ranks_1s_step")
        if at:
            out += [f"**At 1,000 ranks and a step of 1 s: {at['total_ms']:.1f} ms of the "
                    f"driver's CPU a step**, the sum of the simulated part a step at 1,000 "
                    f"({at['simulated_a_step_ms']:.2f} ms), the answer's receipt at 1,000 "
                    f"({at['receipt_ms']:.2f} ms), the most a measured part a step held "
                    f"over the two ({at['most_left_over_ms']:.2f} ms) and the largest part a "
                    f"second measured ({at['largest_part_a_second_ms']:.2f} ms, which did not "
                    "grow with the ranks measured). Measured parts and a simulation, not a "
                    "run of 1,000 ranks.", ""]
    return out


def t_planner_scale(f: dict) -> list:
    def layout(r):
        d = r["layout"]
        return f"dp={d['dp']} x tp={d['tp']} x pp={d['pp']}"

    def settings(r):
        return f"ZeRO-{r['zero_stage']}, {r['recompute']} recompute"

    def published(r):
        p = r["published_in_raylm"]
        if "error" in p:
            return p["error"]
        return (f"{settings(p)}: {p['memory_per_worker_gib']:.1f} GiB/GPU"
                + ("" if p["fits"] else " (does not fit)")
                + f", {p['predicted_step_s']:.1f} s")

    rows = f["rows"]
    return ["Planned on this machine, no Ray, no GPU: the layouts and steps are raylm's "
            "cost model's predictions, not measurements.", ""] + table(
        ["model", "GPUs", "plan (s)", "search (ms)", "layouts weighed", "chosen",
         "memory/GPU (GiB)", "step (s)", "published layout", "published, in raylm's model"],
        [[r["model"], f"{r['gpus']:,}", f"{r['plan_s']:.2f}", f"{r['search_s'] * 1000:.0f}",
          r["layouts_weighed"], f"{layout(r)}, {settings(r)}",
          f"{r['memory_per_worker_gib']:.1f}", f"{r['predicted_step_s']:.1f}",
          f"{r['published']} ({r['published_source']})", published(r)]
         for r in rows.values()])


SPECS = {"bench_throughput": t_throughput, "bench_boundary": t_boundary,
         "bench_pipeline": t_pipeline, "bench_zero": t_zero, "bench_layouts": t_layouts,
         "bench_precision": t_precision, "bench_startup": t_startup, "bench_data": t_data,
         "bench_ray_idle": t_ray_idle, "bench_collectives": t_collectives,
         "bench_gpu": t_gpu, "bench_planner_scale": t_planner_scale,
         "bench_control_plane": t_control_plane}


def render(name: str, figures: dict) -> list:
    spec = SPECS.get(name.split("-")[0])
    cfg = figures.get("config") if isinstance(figures.get("config"), dict) else {}
    try:
        body = spec(figures) if spec else generic(figures)
    except (KeyError, TypeError, AttributeError, ValueError):
        body = generic(figures)  # a file of another shape: shown as it is
    return config_line(cfg) + body


# ---------------------------------------------------------------------------------------
# Plots

def _png(draw, title: str = "", size=(8.5, 3.6)) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size, dpi=100)
    try:
        draw(ax)
        ax.set_title(title, fontsize="medium")
        rows = getattr(ax, "raylm_rows", None)  # horizontal bars: height by their count
        if rows:
            fig.set_size_inches(size[0], max(2.4, 1.1 + 0.3 * rows))
        if ax.get_legend() is not None:  # beside the plot, not over it
            handles, labels = ax.get_legend_handles_labels()
            ax.legend(handles, labels, fontsize="small", loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
        return buf.getvalue()
    finally:
        plt.close(fig)


def _barh(ax, labels, series: dict, xlabel: str, goal=None, goal_label=None):
    """Horizontal bars, one group per label, a bar per series."""
    n = max(1, len(series))
    h = 0.8 / n
    ys = range(len(labels))
    for i, (sname, vals) in enumerate(series.items()):
        ax.barh([y - 0.4 + h * (i + 0.5) for y in ys],
                [0 if v is None or (isinstance(v, float) and math.isnan(v)) else v
                 for v in vals], height=h, label=sname)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.raylm_rows = len(labels) * max(1, n / 2)
    if goal is not None:
        ax.axvline(goal, color="black", linestyle="--", linewidth=1, label=goal_label)
    if n > 1 or goal is not None:
        ax.legend(fontsize="small")
    ax.grid(axis="x", alpha=0.3)


def _dots(ax, labels, series: dict, xlabel: str, ref=1.0, ref_label="1.0", goal=None):
    """Ratios as markers, one row per label, a marker per series, a line at ``ref`` (and
    at ``goal``): differences of a few percent stay visible, unlike bars from 0."""
    markers = "os^Dv"
    for i, (sname, vals) in enumerate(series.items()):
        pts = [(v, y) for y, v in enumerate(vals)
               if v is not None and not (isinstance(v, float) and math.isnan(v))]
        ax.scatter([v for v, _ in pts], [y for _, y in pts], marker=markers[i % 5],
                   label=sname, zorder=3)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.axvline(ref, color="black", linewidth=1, label=ref_label)
    if goal is not None and goal != ref:
        ax.axvline(goal, color="black", linestyle="--", linewidth=1, label=f"goal {goal:g}")
    ax.set_xlabel(xlabel)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    ax.raylm_rows = len(labels)


def p_throughput(f):
    rows = f["rows"]
    out = [("tokens/s of each row, best and median round", lambda ax: _barh(
        ax, list(rows), {"best round": [r["tokens_per_s_best"] for r in rows.values()],
                         "median round": [r["tokens_per_s_median"] for r in rows.values()]},
        "tokens/s"))]
    ratios = f.get("ratios") or {}
    if ratios:
        def draw(ax):
            _dots(ax, list(ratios), {"best rounds": [r["best"] for r in ratios.values()],
                                     "median rounds": [r["median"] for r in ratios.values()]},
                  "ratio of tokens/s")
        out.append(("raylm's tokens/s against each baseline and with a default off", draw))
    return out


def p_boundary(f):
    keys = list(f)
    return [("the step boundary: bare Ray actor against raylm, ms", lambda ax: _barh(
        ax, [k.replace("_", " ") for k in keys],
        {"bare actor": [f[k]["bare_ms"] for k in keys],
         "raylm": [f[k]["raylm_ms"] for k in keys]}, "ms"))]


def p_pipeline(f):
    s = f["schedules"]
    goal = (f.get("goal") or {}).get("max_ratio_sim")
    out = [("a step over its ideals, per schedule", lambda ax: _dots(
        ax, list(s), {"measured / formula": [r["ratio_formula"] for r in s.values()],
                      "measured / sim": [r["ratio_sim"] for r in s.values()],
                      "measured / sim'": [r.get("ratio_own_sim") for r in s.values()]},
        "measured step / ideal step", ref_label="the ideal", goal=goal))]
    peaks = f.get("peak_activation_kib") or {}
    if peaks:
        def draw(ax):
            for k, p in peaks.items():
                st = list(p)
                ax.plot(range(len(st)), [m for m, _ in p.values()], marker="o", label=k)
                ax.plot(range(len(st)), [e for _, e in p.values()], linestyle=":",
                        color=ax.lines[-1].get_color())
            ax.set_xlabel("stage")
            ax.set_ylabel("peak saved activation (KiB)")
            ax.legend(fontsize="small")
            ax.grid(alpha=0.3)
        out.append(("peak saved activation per stage: measured (solid) and expected "
                    "(dotted)", draw))
    return out


def _stacked(ax, labels, parts, marks, mark_label, xlabel, **legend):
    """Horizontal stacked bars (parts: {name: values per label}) with a mark per label."""
    left = [0.0] * len(labels)
    for name, vals in parts.items():
        ax.barh(labels, vals, left=left, label=name)
        left = [a + b for a, b in zip(left, vals)]
    ax.scatter(marks, labels, color="black", marker="|", s=200, label=mark_label, zorder=3)
    ax.invert_yaxis()
    ax.raylm_rows = len(labels)
    ax.set_xlabel(xlabel)
    ax.legend(**legend)
    ax.grid(axis="x", alpha=0.3)


def p_zero(f):
    runs = f["runs"]

    def state(ax):
        _stacked(ax, list(runs),
                 {kind + " (measured)": [r["state_mib"][kind][0] for r in runs.values()]
                  for kind in ("parameters", "gradients", "optimizer")},
                 [r["theory_mib"] for r in runs.values()], "ZeRO theory",
                 "MiB a rank holds", fontsize="small")
    return [("training state per rank, measured against the ZeRO paper", state),
            ("tokens/s against stage 0 at the same dp", lambda ax: _barh(
                ax, list(runs), {"vs stage 0": [r["vs_stage0"] for r in runs.values()]},
                "ratio of tokens/s", goal=1.0, goal_label="stage 0"))]


def p_layouts(f):
    lay = f["layouts"]
    return [("tokens/s against dp4, per layout", lambda ax: _barh(
                ax, list(lay), {"vs dp4": [r["vs_dp4"] for r in lay.values()]},
                "ratio of tokens/s", goal=1.0, goal_label="dp4")),
            ("training state the busiest rank holds, measured and predicted",
             lambda ax: _barh(ax, list(lay),
                              {"measured": [r["held_mib"] for r in lay.values()],
                               "planner's prediction": [r["predicted_mib"]
                                                        for r in lay.values()]}, "MiB"))]


def p_precision(f):
    runs = f["runs"]
    return [("activations kept for backward, measured and predicted", lambda ax: _barh(
        ax, list(runs), {"measured": [r["activations_mib"] for r in runs.values()],
                         "predicted": [r["predicted_activations_mib"]
                                       for r in runs.values()]}, "MiB a rank keeps"))]


def p_startup(f):
    rows = f["rows"]

    def draw(ax):
        cols = list(dict.fromkeys(c for r in rows.values() for c in r["parts_s"]))
        _stacked(ax, list(rows),
                 {c: [r["parts_s"].get(c, 0.0) for r in rows.values()] for c in cols},
                 [r["whole_call_s"] for r in rows.values()], "whole call", "seconds",
                 fontsize="x-small", ncol=2)
    return [("where the start-up goes, per row", draw)]


def p_data(f):
    rows = f["rows"]
    return [("time to the first batch and to the end of one pass", lambda ax: _barh(
        ax, list(rows), {"first": [r["first_s"] for r in rows.values()],
                         "pass": [r["pass_s"] for r in rows.values()]}, "seconds"))]


def p_ray_idle(f):
    procs = f["percent_of_one_core"]
    modes = list(f["total_percent_of_one_core"])
    return [("CPU of Ray's processes, % of one core", lambda ax: _barh(
        ax, list(procs), {m: [v.get(m, 0.0) for v in procs.values()] for m in modes},
        "% of one core"))]


def p_collectives(f):
    rows = f["rows"]
    kinds = list(dict.fromkeys(k for r in rows.values() for k in r["ms"]))
    return [("gloo's collectives, ms per call", lambda ax: _barh(
        ax, kinds, {k: [r["ms"].get(c) for c in kinds] for k, r in rows.items()}, "ms"))]


def p_image_cache(f):
    rows = f["rows"]
    return [("a rank's memory after reading every image", lambda ax: _barh(
        ax, list(rows), {"anonymous": [r["anon_per_proc_mib"] for r in rows.values()],
                         "file pages": [r["file_per_proc_mib"] for r in rows.values()]},
        "MiB per process"))]


def _split(ax, bars: dict, xlabel="seconds"):
    """Stacked horizontal bars: {label: {part: seconds}}."""
    labels = list(bars)
    parts = list(dict.fromkeys(p for b in bars.values() for p in b))
    parts.sort(key=lambda p: p == "first step" or p.startswith("first step"))  # (last)
    left = [0.0] * len(labels)
    for p in parts:
        vals = [bars[k].get(p) or 0.0 for k in labels]
        ax.barh(labels, vals, left=left, label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.raylm_rows = len(labels)
    ax.set_xlabel(xlabel)
    ax.legend(fontsize="x-small")
    ax.grid(axis="x", alpha=0.3)


def p_elastic_quiet(f):
    bars = {"raylm, rank frozen": {
        "detect": f.get("detect_s"), "release and settle": f.get("release_and_settle_s"),
        "regroup": f.get("regroup_s"), "first step": f.get("first_step_s")}}
    n = f.get("node_cut_off") or {}
    if n:
        bars["raylm, node cut off"] = {
            "detect": n.get("detect_s"), "release and settle": n.get("release_and_settle_s"),
            "regroup": n.get("regroup_s"), "first step": n.get("first_step_s")}
    r = f.get("ray_train_frozen") or {}
    if r.get("kill_to_step_s") is not None:
        bars["Ray Train v2, worker frozen"] = {
            "detect": r.get("kill_detect_s"), "restart the group": r.get("kill_restart_group_s"),
            "imports, model, checkpoint": r.get("kill_imports_model_ckpt_ddp_s"),
            "first step": r.get("kill_first_step_s")}
    return [("a frozen rank: fault to the next committed step, part by part",
             lambda ax: _split(ax, bars))]


def p_elastic(f):
    return [("a killed rank: kill to the next committed step", lambda ax: _split(ax, {
        "kill -> next step": {"detect and settle": f["detect_and_settle_s"],
                              "regroup": f["regroup_s"],
                              "first step at dp=2": f["kill_to_next_step_s"]
                              - f["detect_and_settle_s"] - f["regroup_s"]}}))]


def p_recovery(f):
    return [("fault to the next committed step, per layout and fault", lambda ax: _barh(
        ax, list(f), {"fault -> next step": [r.get("fault_to_next_step_s")
                                             for r in f.values()]}, "seconds"))]


def p_gpu(f):
    rows = f["rows"]
    return [("tokens/s per row", lambda ax: _barh(
        ax, list(rows), {"tokens/s": [r["tokens_per_s"] for r in rows.values()]},
        "tokens/s"))]


def p_swin(f):
    rows = f["rows"]
    return [("ms a step", lambda ax: _barh(
        ax, list(rows), {"ms a step": [r["ms_per_step"] for r in rows.values()]}, "ms"))]


PLOTS = {"bench_throughput": p_throughput, "bench_boundary": p_boundary,
         "bench_pipeline": p_pipeline, "bench_zero": p_zero, "bench_layouts": p_layouts,
         "bench_precision": p_precision, "bench_startup": p_startup, "bench_data": p_data,
         "bench_ray_idle": p_ray_idle, "bench_collectives": p_collectives,
         "bench_image_cache": p_image_cache, "bench_elastic_quiet": p_elastic_quiet,
         "bench_elastic": p_elastic, "gpu_recovery": p_recovery, "bench_gpu": p_gpu,
         "bench_swin": p_swin}

# A figure followed across dated files: name -> (title, y label, figures -> {series: value}).
HISTORY = {
    "bench_throughput": ("ratios of tokens/s (median rounds) by date", "ratio",
                         lambda f: {k: r["median"] for k, r in f["ratios"].items()
                                    if r.get("goal")}),
    "bench_boundary": ("raylm's step boundary less a bare actor's, by date", "ms",
                       lambda f: {k: r["raylm_ms"] - r["bare_ms"] for k, r in f.items()}),
    "bench_pipeline": ("measured / sim by date", "ratio",
                       lambda f: {k: r["ratio_sim"] for k, r in f["schedules"].items()}),
    "bench_zero": ("tokens/s against stage 0 by date", "ratio",
                   lambda f: {k: r["vs_stage0"] for k, r in f["runs"].items()}),
    "bench_layouts": ("tokens/s against dp4 by date", "ratio",
                      lambda f: {k: r["vs_dp4"] for k, r in f["layouts"].items()}),
    "bench_startup": ("whole call by date", "seconds",
                      lambda f: {k: r["whole_call_s"] for k, r in f["rows"].items()}),
    "bench_data": ("tokens/s of one pass by date", "tokens/s",
                   lambda f: {k: r["tokens_per_s"] for k, r in f["rows"].items()}),
    "bench_elastic_quiet": ("fault to the next committed step by date", "seconds",
                            lambda f: {"rank frozen": f["freeze_to_next_step_s"],
                                       "node cut off": (f.get("node_cut_off") or {}).get(
                                           "freeze_to_next_step_s")}),
}


def _history(dated: list, series_of):
    """A line per series over the dated files (those it can be read from)."""
    points = {}
    for date, path in dated:
        try:
            got = series_of(load(path)["figures"])
        except (KeyError, TypeError, AttributeError, ValueError):
            continue
        for k, v in got.items():
            if v is not None:
                points.setdefault(k, []).append((date, v))

    def draw(ax):
        import datetime

        for k, pts in points.items():
            ax.plot([datetime.date.fromisoformat(d) for d, _ in pts], [v for _, v in pts],
                    marker="o", label=k)
        ax.legend(fontsize="x-small")
        ax.grid(alpha=0.3)
        ax.tick_params(axis="x", labelrotation=30)
    return draw, sum(len(p) for p in points.values())


def pictures(name: str) -> list:
    """(file name, alt text, draw) of every picture of ``name``'s newest file and its
    history; the same list for tables (the links) and plots (the PNGs)."""
    dated = files(name)
    if not dated:
        return []
    base = name.split("-")[0]
    figures = load(dated[-1][1])["figures"]
    out = []
    spec = PLOTS.get(base)
    if spec:
        try:
            made = spec(figures)
        except (KeyError, TypeError, AttributeError, ValueError):
            made = []
        for i, (alt, draw) in enumerate(made):
            out.append((f"{name}{'' if i == 0 else f'-{i + 1}'}.png", alt, draw))
    if base in HISTORY and len(dated) > 1:
        title, ylabel, series_of = HISTORY[base]
        draw, count = _history(dated, series_of)
        if count > 1:
            def with_label(ax, draw=draw):
                draw(ax)
                ax.set_ylabel(ylabel)
            out.append((f"{name}-history.png", title, with_label))
    return out


# ---------------------------------------------------------------------------------------
# The two entry points

def section(name: str, images: bool = True) -> list:
    dated = files(name)
    if not dated:
        return [f"*No result file yet: `{command(name)}` makes one "
                f"(`benchmarks/results/{name}-<date>.json`).*", ""]
    date, path = dated[-1]
    doc = load(path)
    out = [provenance(name, date, doc, [d for d, _ in dated]), ""]
    out += render(name, doc.get("figures", {}))
    if images:
        for png, alt, draw in pictures(name):
            if render_png(png, alt, draw) is not None:
                out += [f"![{alt}](figures/{png})", ""]
    return out


def tables(name: str, images: bool = True) -> str:
    """Markdown: the newest result of ``name`` and of each variant (NAME-VARIANT), each
    with its date, commit and machine; with ``images``, links to its pictures."""
    out = section(name, images)
    for v in variants(name):
        flag = v[len(name) + 1:]
        why = "; ".join(VARIANTS.get(x, (None, x))[1] for x in flag.split("-"))
        out += [f"**`{command(v)}`** ({why}):", ""] + section(v, images)
    return "\n" + "\n".join(out) + "\n"


_RENDERED: dict = {}


def render_png(png: str, alt: str, draw):
    """The PNG of a picture, or None where drawing it failed (then it is neither linked
    nor made: a missing picture, not a broken page)."""
    if png not in _RENDERED:
        try:
            _RENDERED[png] = _png(draw, alt)
        except Exception as e:  # noqa: BLE001 -- a picture that fails is left out
            print(f"report.py: {png}: {e!r}", file=sys.stderr)
            _RENDERED[png] = None
    return _RENDERED[png]


def plots() -> dict:
    """{"file.png": PNG bytes} of every picture the tables link."""
    out = {}
    for name in names():
        for png, alt, draw in pictures(name):
            data = render_png(png, alt, draw)
            if data is not None:
                out[png] = data
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    shown = argv or sorted({n.split("-")[0] for n in names()} | set(COMMANDS))
    for name in shown:
        print(f"## {name}")
        print(tables(name, images=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
