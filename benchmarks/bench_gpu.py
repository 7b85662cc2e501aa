"""raylm on one GPU against the plain PyTorch loop on the same GPU, in one run: fp32, bf16,
fp16 and bf16 with --torch_compile, tokens/s and model FLOPs utilisation (MFU).

    python benchmarks/bench_gpu.py                 # GPT-2 12 x 768, block 1024 (~4 min)
    python benchmarks/bench_gpu.py --quick         # GPT-2 2 x 128, block 128 (~2 min)
    python benchmarks/bench_gpu.py --only plain-bf16 raylm-bf16 --json gpu.json

Rows (one GPU; raylm: one rank actor holding it, NCCL as its process group):

  plain-fp32, plain-bf16, plain-bf16-compile
                           a plain PyTorch loop on the GPU (ddp_baseline.py --device cuda):
                           the same model, seed, blocks and order as raylm; bf16 under
                           torch.autocast with fp32 weights, as raylm's --bf16; the compile
                           row wraps the whole model in torch.compile
  raylm-fp32, raylm-bf16, raylm-fp16, raylm-bf16-compile, raylm-bf16-compile-model
                           raylm train(..., use_gpu=True) with the default fused AdamW;
                           the compile rows: --torch_compile (each block's forward), and
                           with --torch_compile_scope model (the whole forward and loss)

Per row: tokens/s from the median steady-state step time (raylm: the driver's wall time
of a step, from sending it to having the rank's answer, so raylm's per-step round trip is
in it), MFU (training FLOPs of raylm's shape model, 6N plus attention, over the GPU's
dense peak in that precision: plan/hardware.py), the ratio to the plain loop in the same
precision, and where the step goes (raylm.runtime.profiling's parts). The loss columns
check that raylm trains what the plain loop trains (dropout off): the largest per-step
loss and gradient-norm differences from the plain loop in the same precision (a GPU's
kernels are not bit-reproducible across processes: atomics in backward, autotuned
algorithms).

It also loads the bf16 row's saved model with plain transformers on the GPU and checks
its logits against the rank's own, and asks raylm for 2 GPU ranks on a 1-GPU cluster,
which must be one clear error before any actor starts.

Asserts nothing; prints a table (and --json) and writes the rows to
benchmarks/results/bench_gpu-<date>.json (-quick, -dropout, -sdpa, -cpu for those runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_throughput import config_overrides, median_parts, summarize  # noqa: E402

ROWS = ("plain-fp32", "raylm-fp32", "plain-bf16", "raylm-bf16", "raylm-fp16",
        "plain-bf16-compile", "raylm-bf16-compile", "raylm-bf16-compile-model")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 5)")
    ap.add_argument("--n_layer", type=int, default=None, help="default 12 (quick 2)")
    ap.add_argument("--n_embd", type=int, default=None, help="default 768 (quick 128)")
    ap.add_argument("--n_head", type=int, default=None, help="default 12 (quick 2)")
    ap.add_argument("--block_size", type=int, default=None, help="default 1024 (quick 128)")
    ap.add_argument("--global_batch", type=int, default=None, help="default 16 (quick 8)")
    ap.add_argument("--train_file", nargs="*", default=None,
                    help="text files (default: raylm's built-in sample)")
    ap.add_argument("--only", nargs="*", choices=ROWS, default=None)
    ap.add_argument("--profile", action="store_true",
                    help="trace steps 2-4 of every row with torch.profiler (raylm: "
                    "--profile) and print each row's GPU kernel time per step by kernel, "
                    "next to the plain loop's in the same precision, and where the GPU "
                    "sits idle (the CPU work it waits on)")
    ap.add_argument("--keep_traces", default=None, metavar="DIR",
                    help="with --profile: copy every row's trace to DIR/ROW.json")
    ap.add_argument("--cpus", type=int, default=8, help="CPUs of the local Ray cluster")
    ap.add_argument("--json", default=None, help="also write every row's figures here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="GPT-2's residual and embedding dropout (default 0: every row then "
                    "computes the plain loop's losses). Above 0 raylm draws per-sample "
                    "masks and the plain loop torch's own, so the loss columns are n/a")
    ap.add_argument("--attn_dropout", type=float, default=None,
                    help="attention dropout (default: --dropout); above 0 raylm runs "
                    "eager attention (its per-sample masks cannot enter sdpa's kernel)")
    ap.add_argument("--per_sample_attention_dropout", default="true",
                    choices=("true", "false"), help="raylm's flag: false keeps sdpa, whose "
                    "attention dropout is then per rank")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the same rows on CPU ranks, a dry run of this script on a "
                    "machine without a GPU (no speed to read there)")
    ap.add_argument("--no_checks", action="store_true",
                    help="skip the checks after the rows (the export loaded with "
                    "transformers, 2 GPU ranks on 1 GPU, GPU masks against CPU masks): "
                    "for a second run on the same machine")
    args = ap.parse_args(argv)
    preset = (dict(steps=5, warmup=3, n_layer=2, n_embd=128, n_head=2, block_size=128,
                   global_batch=8) if args.quick else
              dict(steps=20, warmup=5, n_layer=12, n_embd=768, n_head=12, block_size=1024,
                   global_batch=16))
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.attn_dropout is None:
        args.attn_dropout = args.dropout
    return args


def row(name, step_times, losses, grad_norms, warmup, tokens, parts) -> dict:
    """bench_throughput's steady-state figures of one run, with its per-step losses and
    gradient norms (compared with the plain loop's) and its parts' medians."""
    r = summarize(name, "1 GPU", step_times, warmup, tokens, losses)
    r.update(losses=losses, grad_norms=grad_norms, parts=median_parts(parts, warmup))
    return r


def run_plain(args, name, config_dir, data_dir) -> dict:
    precision = name.split("-")[1]
    extra = (["--compile"] if name.endswith("-compile") else []) + (
        ["--profile_dir", os.path.join(profile_root(args), name)] if args.profile else [])
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "ddp_baseline.py"),
           "--config_dir", config_dir, "--data_dir", data_dir, "--global_batch",
           str(args.global_batch), "--steps", str(args.warmup + args.steps), "--threads", "4",
           "--device", args.device, "--precision", precision, *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    out = row(name, r["step_times"], r["losses"], r["grad_norms"], args.warmup,
              args.global_batch * r["block_size"], r["parts"])
    if args.profile:
        out["trace"] = os.path.join(profile_root(args), name, "plain.json")
    return out


def run_raylm(args, name, cache, work) -> tuple[dict, object]:
    from raylm import TrainConfig, train

    precision = name.split("-")[1]
    cfg = TrainConfig(
        model_type="gpt2", config_overrides=config_overrides(args),
        train_file=list(args.train_file or []), block_size=args.block_size,
        data_cache_dir=cache, output_dir=os.path.join(work, name), overwrite_output_dir=True,
        per_device_train_batch_size=args.global_batch, gradient_accumulation_steps=1,
        max_steps=args.warmup + args.steps, learning_rate=5e-4, seed=42, do_eval=False,
        disable_tqdm=True, validation_split_percentage=0.0, logging_steps=10**6,
        save_steps=10**6, report_to=["none"], num_workers=1, cpus_per_worker=4,
        use_gpu=args.device == "cuda", bf16=precision == "bf16", fp16=precision == "fp16",
        per_sample_attention_dropout=args.per_sample_attention_dropout == "true",
        torch_compile="-compile" in name,
        torch_compile_scope="model" if name.endswith("-model") else "blocks",
        profile=args.profile, profile_steps=3)
    t0 = time.time()
    result = train(cfg)
    wall = time.time() - t0
    hist = sorted(result.history, key=lambda h: h["step"])
    r = row(name, [h["step_time_s"] for h in hist], [h["loss"] for h in hist],
            [h.get("grad_norm") for h in hist], args.warmup,
            args.global_batch * args.block_size, [h["breakdown"] for h in hist])
    mfu = [h["mfu"] for h in hist[args.warmup:] if h.get("mfu")]
    r["mfu_logged"] = statistics.median(mfu) if mfu else None
    r["whole_call_s"] = wall
    if args.profile:
        r["trace"] = os.path.join(result.output_dir, "profile", "rank-0.json")
    return r, result


def profile_root(args) -> str:
    return os.path.join(args.work, "profile")


def kernel_times(path: str, steps: int = 3) -> tuple[dict, float]:
    """GPU time per traced step by kernel (memcpy and memset included) in a chrome trace
    of torch.profiler, and the GPU's busy time per step (the union of its intervals)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    times, spans = {}, []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            name = e["name"]
            times[name] = times.get(name, 0.0) + e["dur"] / 1000 / steps
            spans.append((e["ts"], e["ts"] + e["dur"]))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return times, busy / 1000 / steps


def print_kernels(results: dict, rows: list) -> None:
    """Each raylm row's GPU time per step against the plain loop's in the same precision:
    the totals, and the kernels whose time differs most."""
    for name in rows:
        ref_name = "plain-" + name.split("-", 1)[-1].removesuffix("-model")
        r, ref = results.get(name), results.get(ref_name)
        if not name.startswith("raylm") or not r or not ref or "trace" not in r:
            continue
        try:
            mine, busy = kernel_times(r["trace"])
            theirs, ref_busy = kernel_times(ref["trace"])
        except (OSError, ValueError, KeyError) as e:
            print(f"{name}: no trace to read ({e})")
            continue
        print(f"{name} against {ref_name}: GPU busy {busy:.2f} vs {ref_busy:.2f} ms per "
              f"step; kernel time {sum(mine.values()):.2f} vs {sum(theirs.values()):.2f} ms; "
              f"{len(mine)} vs {len(theirs)} distinct kernels")
        diff = sorted(set(mine) | set(theirs),
                      key=lambda k: -abs(mine.get(k, 0.0) - theirs.get(k, 0.0)))
        for k in diff[:12]:
            print(f"  {mine.get(k, 0.0):>8.3f} {theirs.get(k, 0.0):>8.3f} ms  {k[:110]}")


def _interval_union(spans: list) -> list:
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def idle_gaps(path: str, steps: int = 3, min_us: float = 20.0) -> dict:
    """Where the GPU sits idle in a chrome trace of torch.profiler, and on what.

    Each idle gap between kernels (of at least ``min_us``) is put on the CPU work that held
    back the kernel after it: the innermost CPU op around that kernel's launch (found by the
    launch's correlation id) and the outermost named region (a raylm.* record_function, or
    ProfilerStep) around it. A gap whose kernel was launched before the gap began is the
    GPU's own (a stream wait, a copy); it is put on 'launched early'. Returns milliseconds
    per traced step: {'total', 'by_op', 'by_region', 'count'}."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels, launches, cpu = [], {}, {}
    for e in events:
        if "dur" not in e or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            cpu.setdefault(e.get("tid"), []).append(e)
    kernels.sort(key=lambda e: e["ts"])
    busy = _interval_union([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    # the kernel that ends each gap: the first to start at the end of a busy interval
    starts = {}
    for k in kernels:
        starts.setdefault(k["ts"], k)
    by_op, by_region, total, count = {}, {}, 0.0, 0
    for (_, end), (nxt, _) in zip(busy, busy[1:]):
        gap = nxt - end
        if gap < min_us:
            continue
        k = starts.get(nxt)
        launch = launches.get((k.get("args") or {}).get("correlation")) if k else None
        op, region = "unknown (no launch found)", "-"
        if launch is not None and launch["ts"] <= end:
            op = "launched early: " + k["name"][:60]
        elif launch is not None:
            around = [e for e in cpu.get(launch.get("tid"), [])
                      if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
            ops = [e for e in around if e.get("cat") == "cpu_op"]
            named = [e for e in around if e.get("cat") == "user_annotation"
                     and not e["name"].startswith("ProfilerStep")]
            op = min(ops, key=lambda e: e["dur"])["name"] if ops else "no cpu op"
            region = max(named, key=lambda e: e["dur"])["name"] if named else "-"
        ms = gap / 1000 / steps
        by_op[op] = by_op.get(op, 0.0) + ms
        by_region[region] = by_region.get(region, 0.0) + ms
        total += ms
        count += 1
    return {"total": total, "by_op": by_op, "by_region": by_region, "count": count / steps}


def print_idle(results: dict, rows: list) -> None:
    """Each traced row's GPU idle time per step (gaps of 20 us or more between kernels),
    by the CPU op that launched the kernel after each gap, and by raylm's region."""
    for name in rows:
        r = results.get(name)
        if not r or "trace" not in r:
            continue
        try:
            g = idle_gaps(r["trace"])
        except (OSError, ValueError, KeyError) as e:
            print(f"{name}: no trace to read ({e})")
            continue
        print(f"{name}: GPU idle {g['total']:.2f} ms per step in {g['count']:.0f} gaps "
              f"of 20 us or more; by region: "
              + ", ".join(f"{k} {v:.2f}" for k, v in
                          sorted(g["by_region"].items(), key=lambda kv: -kv[1])[:6]))
        for k, v in sorted(g["by_op"].items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {v:>8.3f} ms  {k[:110]}")


def check_export(output_dir: str, device: str) -> str:
    """The saved model loads with plain transformers on the GPU and predicts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(output_dir).to(device).eval()
    ids = torch.arange(16, device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits
    finite = bool(torch.isfinite(logits).all())
    return (f"loaded {os.path.basename(output_dir)} with AutoModelForCausalLM on {device}: "
            f"logits {tuple(logits.shape)}, finite={finite}, dtype {logits.dtype}")


def two_ranks_one_gpu(args, cache, work) -> str:
    """2 GPU rank actors asked for on a 1-GPU cluster: raylm's answer (run in a child
    process with a time limit, so a wait for GPUs that never come cannot hang the run)."""
    code = (
        "import sys, ray; sys.path.insert(0, %r)\n"
        "from raylm import TrainConfig, train\n"
        "ray.init(address=%r)\n"
        "try:\n"
        "    train(TrainConfig(model_type='gpt2', config_overrides=%r, block_size=%d,"
        " data_cache_dir=%r, output_dir=%r, overwrite_output_dir=True, max_steps=2,"
        " do_eval=False, disable_tqdm=True, report_to=['none'], num_workers=2, dp=2,"
        " use_gpu=True, per_device_train_batch_size=2))\n"
        "    print('TRAINED (no error)')\n"
        "except Exception as e:\n"
        "    print('ERROR', type(e).__name__, str(e)[:600])\n"
    ) % (REPO, os.environ.get("RAY_ADDRESS", "auto"), config_overrides(args), args.block_size,
         cache, os.path.join(work, "two"))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=90)
        out = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ERROR", "TRAINED"))]
        return out[-1] if out else (proc.stdout[-800:] + proc.stderr[-800:])
    except subprocess.TimeoutExpired:
        return "HUNG: no answer in 90 s"


def check_masks(args) -> str:
    """raylm's per-sample dropout masks on the GPU (Triton's kernel) against the CPU's
    (numpy's), bit for bit, and one dropout of a residual-stream activation timed: raylm's
    per-sample dropout against torch's own on the same tensor."""
    import torch
    import torch.nn.functional as F

    from raylm.models.dropout import SampleDropout, _kernel

    ids = list(range(args.global_batch))
    shape = (args.global_batch, args.block_size, args.n_embd)
    x = torch.randn(shape, device="cuda")
    with SampleDropout(42, 7, ids):
        gpu = F.dropout(x, 0.1).cpu()
    with SampleDropout(42, 7, ids):
        cpu = F.dropout(x.cpu(), 0.1)
    same = torch.equal(gpu != 0, cpu != 0)

    def row_draws(device):  # stochastic depth's draws: 12 calls of one value per row
        with SampleDropout(42, 7, ids):
            return torch.stack([torch.empty(len(ids), 1, 1, device=device).bernoulli_(0.8)
                                .cpu() for _ in range(12)])

    first = row_draws("cuda")  # (its calls past the last context's count: a copy each)
    rows_cpu = row_draws("cpu")
    rows_same = torch.equal(first, rows_cpu) and torch.equal(row_draws("cuda"), rows_cpu)

    def timed(fn, n=50):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e3

    def ours():
        with SampleDropout(42, 7, ids):
            F.dropout(x, 0.1)

    return (f"per-sample dropout masks: GPU ({'Triton' if _kernel() else 'torch int64'}) "
            f"equal the CPU's: {same}, row draws too: {rows_same}; one dropout of {tuple(shape)} fp32: raylm "
            f"{timed(ours):.3f} ms, torch's own {timed(lambda: F.dropout(x, 0.1)):.3f} ms")


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray
    import torch

    from raylm.config import TrainConfig
    from raylm.data.sources import builtin_sample_files
    from raylm.data.tokenized import build_tokenized_dataset
    from raylm.models.loading import resolve_model
    from raylm.plan.hardware import peak_flops
    from raylm.plan.planner import shape_of

    logging.basicConfig(level=logging.WARNING)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False; "
                         "--device cpu runs the rows on CPU)")
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    rows = list(dict.fromkeys(args.only)) if args.only else list(ROWS)  # in --only's order
    work = args.work = tempfile.mkdtemp(prefix="raylm-bench-gpu-")
    cache = os.path.join(work, "cache")
    results, errors, notes = {}, {}, []
    print(f"{gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}; ray {ray.__version__}",
          flush=True)
    try:
        spec = resolve_model(TrainConfig(model_type="gpt2",
                                         config_overrides=config_overrides(args)))
        config_dir = os.path.join(work, "config")
        spec.config.save_pretrained(config_dir)
        shape = shape_of(spec, args.block_size)
        flops_per_token = 3 * sum(u.flops for u in (shape.embed, *shape.blocks, shape.head))
        files = [os.path.abspath(f) for f in (args.train_file or builtin_sample_files())]
        args.train_file = files
        from raylm.runtime.cluster import start_local  # as `raylm train` starts Ray

        start_local(num_cpus=args.cpus, num_gpus=1 if cuda else 0, log_to_driver=False)
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        ds = build_tokenized_dataset(files, spec.tokenizer_dir, args.block_size,
                                     cache_root=cache)
        params = shape.total_params
        print(f"data: {ds.num_samples} blocks of {ds.block_size} tokens; model gpt2 "
              f"{config_overrides(args)}, vocab {spec.vocab_size}"
              + (f", {params / 1e6:.1f}M parameters" if params else "")
              + f"; {flops_per_token / 1e9:.3f} GFLOP per token trained; global batch "
              f"{args.global_batch}; {args.warmup} warm-up + {args.steps} timed steps",
              flush=True)
        export_dir = None
        for name in rows:
            t0 = time.time()
            try:
                if name.startswith("plain"):
                    r = run_plain(args, name, config_dir, ds.cache_dir)
                else:
                    r, result = run_raylm(args, name, cache, work)
                    if name == "raylm-bf16":
                        export_dir = result.output_dir
                half = "bf16" in name or "fp16" in name
                peak = peak_flops(gpu, 0.0, half)
                r["mfu"] = r["tokens_per_s"] * flops_per_token / peak if peak else None
                results[name] = r
                print(f"  {name}: {r['tokens_per_s']:,.0f} tokens/s"
                      + (f", mfu {r['mfu']:.1%}" if r["mfu"] else "")
                      + f" ({time.time() - t0:.0f} s)", flush=True)
            except Exception:
                errors[name] = traceback.format_exc()
                print(f"  {name}: FAILED ({time.time() - t0:.0f} s)\n{errors[name][-3000:]}",
                      flush=True)
        if args.profile:
            print()
            print_kernels(results, rows)
            print()
            print_idle(results, rows)
            if args.keep_traces:
                os.makedirs(args.keep_traces, exist_ok=True)
                for name in rows:
                    if "trace" in results.get(name, {}):
                        shutil.copy(results[name]["trace"],
                                    os.path.join(args.keep_traces, name + ".json"))
        if export_dir and not args.no_checks:
            try:
                notes.append(check_export(export_dir, args.device))
            except Exception:
                notes.append("export check FAILED:\n" + traceback.format_exc()[-2000:])
        if cuda and not args.no_checks:
            notes.append("2 GPU ranks on 1 GPU: " + two_ranks_one_gpu(args, cache, work))
            try:
                notes.append(check_masks(args))
            except Exception:
                notes.append("mask check FAILED:\n" + traceback.format_exc()[-2000:])
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'row':<25} {'s/step':>8} {'tokens/s':>10} {'mfu':>6} {'vs plain':>8} "
          f"{'max |dloss|':>11} {'max |dgnorm|':>12} {'loss first -> last':>19} {'call s':>7}")
    written = {}  # the result file's rows
    for name in rows:
        if name not in results:
            print(f"{name:<25} FAILED")
            continue
        r = results[name]
        w = written[name] = {
            "median_s": r["median_s"], "tokens_per_s": r["tokens_per_s"], "mfu": r.get("mfu"),
            "vs_plain": None, "max_loss_diff": None, "max_rel_grad_norm_diff": None,
            "first_loss": r["losses"][0], "last_loss": r["losses"][-1],
            "whole_call_s": r.get("whole_call_s"),
            "parts_ms": {k: 1000 * v for k, v in r["parts"].items()}}
        ref = results.get("plain-" + name.split("-", 1)[-1].removesuffix("-model"))
        ratio = dl = dg = "n/a"
        if ref and ref is not r:
            w["vs_plain"] = r["tokens_per_s"] / ref["tokens_per_s"]
            ratio = f"{w['vs_plain']:.3f}"
        if ref and ref is not r and not (args.dropout or args.attn_dropout):
            n = min(len(r["losses"]), len(ref["losses"]))
            w["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"][:n],
                                                                 ref["losses"][:n]))
            dl = f"{w['max_loss_diff']:.1e}"
            pairs = [(a, b) for a, b in zip(r["grad_norms"][:n], ref["grad_norms"][:n])
                     if a is not None and b is not None]
            if pairs:
                w["max_rel_grad_norm_diff"] = max(abs(a - b) / max(abs(b), 1e-12)
                                                  for a, b in pairs)
                dg = f"{w['max_rel_grad_norm_diff']:.1e}"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        call = f"{r['whole_call_s']:.0f}" if "whole_call_s" in r else ""
        print(f"{name:<25} {r['median_s']:>8.4f} {r['tokens_per_s']:>10,.0f} {mfu:>6} "
              f"{ratio:>8} {dl:>11} {dg:>12} "
              f"{r['losses'][0]:>8.3f} -> {r['losses'][-1]:.3f} {call:>7}")
    print("(max |dgnorm|: relative to the plain loop's gradient norm)")
    print()
    print("where a step goes (ms, medians over the timed steps)")
    keys = sorted({k for r in results.values() for k in r["parts"]})
    print(f"{'row':<25} " + " ".join(f"{k[:-2]:>14}" for k in keys) + f" {'rest':>8}")
    for name in rows:
        if name in results:
            r = results[name]
            cells = [f"{r['parts'][k] * 1000:>14.2f}" if k in r["parts"] else f"{'-':>14}"
                     for k in keys]
            rest = r["median_s"] - sum(r["parts"].values())
            print(f"{name:<25} " + " ".join(cells) + f" {rest * 1000:>8.2f}")
    print()
    for line in notes:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "gpu": gpu, "torch": torch.__version__,
                       "results": results, "errors": errors, "notes": notes}, f, indent=2)
    from benchmarks.results import write

    figures = {"config": {"device": gpu, "torch": torch.__version__,
                          "model": f"gpt2 {config_overrides(args)}",
                          "block_size": args.block_size, "global_batch": args.global_batch,
                          "warmup": args.warmup, "steps": args.steps,
                          "dropout": args.dropout, "attn_dropout": args.attn_dropout,
                          "quick": args.quick},
               "rows": written, "failed": sorted(errors), "notes": notes}
    name = ("bench_gpu" + ("-quick" if args.quick else "") + ("-dropout" if args.dropout else "")
            + ("-sdpa" if args.per_sample_attention_dropout == "false" else "")
            + ("-cpu" if not cuda else ""))
    print(f"written to {write(name, figures)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
