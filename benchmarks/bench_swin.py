"""The digits Swin (``examples/digits_vit.py --model swin``, torchvision's Swin, 568k
parameters) on one device: raylm's step time against a plain PyTorch loop of the same
model and batch on the same device, with and without raylm's per-sample draws (stochastic
depth drawn per sample: raylm.models.dropout.SampleDropout), and the ratios.

    python benchmarks/bench_swin.py --device cuda              # one GPU (use_gpu=True)
    python benchmarks/bench_swin.py --device cpu --steps 30    # a dry run on the CPU

A model this small is bound by the host launching its kernels, so it shows what raylm
does per operation on the host. Needs scikit-learn (the digits) and torchvision.

The figures are written to benchmarks/results/bench_swin-<date>.json
(-cpu with --device cpu).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))

from benchmarks.bench_gpu import kernel_times, print_idle  # noqa: E402
from benchmarks.bench_throughput import median_parts  # noqa: E402


def plain_ms(device: str, steps: int, batch: int, draws: bool, bf16: bool,
             trace: str | None = None) -> float:
    """ms per step of a plain loop: forward, loss, backward, clip, fused AdamW.
    ``trace``: first trace 3 steps with torch.profiler into that file (as raylm's
    --profile traces its steps; not the timed ones; ``steps`` 0: only that)."""
    import torch

    from digits_vit import SWIN
    from raylm.models.dropout import DropoutSites, SampleDropout
    from raylm.models.torchvision_models import TorchvisionClassifier, parse_overrides

    torch.manual_seed(0)
    model = TorchvisionClassifier("swin_t", 10, parse_overrides(SWIN))().to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    sites = DropoutSites()  # (as raylm's engine: intercepted where dropout is called)

    def step(i):
        ctx = (SampleDropout(0, i, list(range(batch)), sites) if draws
               else contextlib.nullcontext())
        with ctx, torch.autocast(device, torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warm = max(3, steps // 10)
    for i in range(warm):
        step(i)
    sync()
    if trace:
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
                on_trace_ready=lambda p: p.export_chrome_trace(trace)) as prof:
            for i in range(5):
                step(warm + i)
                prof.step()
        sync()
    if not steps:
        return 0.0
    t = time.perf_counter()
    for i in range(steps):
        loss = step(warm + i)
    float(loss.detach())
    sync()
    return 1000 * (time.perf_counter() - t) / steps


def raylm_ms(device: str, steps: int, batch: int, bf16: bool, images: str,
             trace: str | None = None) -> tuple:
    """(median ms per step over the second half of the steps, {part: median ms} of the
    step's breakdown) of raylm on one rank; ``trace``: its --profile trace of steps 3-5
    copied to that file."""
    from digits_vit import SWIN
    from raylm import TrainConfig, train

    out = tempfile.mkdtemp(prefix="bench-swin-")
    result = train(TrainConfig(
        task="image-classification", model_type="swin_t", config_overrides=SWIN,
        image_size=32, train_dir=os.path.join(images, "train"), image_flip=False,
        output_dir=out, use_gpu=device == "cuda", num_workers=1,
        per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
        logging_steps=1, save_steps=10 ** 6, do_eval=False, report_to=["none"],
        disable_tqdm=True, bf16=bf16, profile=bool(trace), profile_steps=3))
    if trace:
        shutil.copy(os.path.join(result.output_dir, "profile", "rank-0.json"), trace)
    late = result.history[len(result.history) // 2:]
    step = statistics.median(h["step_time_s"] for h in late)
    parts = median_parts([h["breakdown"] for h in late if h.get("breakdown")], 0)
    return 1000 * step, {k.removesuffix("_s"): 1000 * v for k, v in parts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--images", help="the digits folder written already (its train/), "
                    "where scikit-learn is not installed")
    ap.add_argument("--profile", metavar="DIR",
                    help="trace 3 steps of the plain loop with the draws and of raylm with "
                    "torch.profiler into DIR (plain-draws.json, raylm.json) and print the "
                    "host's ops per step of each, the ops whose count differs most and, "
                    "on a GPU, where the GPU sits idle (bench_gpu.py's reading)")
    args = ap.parse_args(argv)

    import ray

    from digits_vit import write_digits

    if args.device == "cpu":
        import torch

        torch.set_num_threads(1)
    images = args.images
    if images is None:
        images = tempfile.mkdtemp(prefix="digits-")
        write_digits(images)
    traces = None
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        traces = {k: os.path.join(args.profile, k + ".json") for k in ("plain-draws", "raylm")}
    rows = {"plain": plain_ms(args.device, args.steps, args.batch, False, args.bf16),
            "plain + per-sample draws": plain_ms(args.device, args.steps, args.batch, True,
                                                 args.bf16)}
    from raylm.runtime.cluster import start_local  # as `raylm train` starts Ray

    start_local(num_gpus=1 if args.device == "cuda" else 0, log_to_driver=False)
    rows["raylm"], parts = raylm_ms(args.device, args.steps, args.batch, args.bf16, images)
    if traces:
        # Traced in runs of their own, after the timed ones: on the H200 the steps of a
        # raylm run after its traced ones took 41.4 ms where a run without tracing took
        # 24.9 (the same day, the same code).
        plain_ms(args.device, 0, args.batch, True, args.bf16, traces["plain-draws"])
        raylm_ms(args.device, 8, args.batch, args.bf16, images, traces["raylm"])
    ray.shutdown()
    base = rows["plain"]
    print(f"digits Swin, batch {args.batch}, {args.device}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {args.steps} steps")
    for name, ms in rows.items():
        print(f"  {name:<26} {ms:8.2f} ms/step   {base / ms:5.2f} of the plain loop")
    print("  raylm's step (medians, ms): " + ", ".join(f"{k} {v:.2f}"
                                                      for k, v in parts.items()))
    print(json.dumps({k: round(v, 3) for k, v in rows.items()}))
    from benchmarks.results import write

    figures = {"config": {"device": args.device, "steps": args.steps, "batch": args.batch,
                          "precision": "bf16" if args.bf16 else "fp32"},
               "rows": {name: {"ms_per_step": ms, "vs_plain": base / ms}
                        for name, ms in rows.items()},
               "raylm_parts_ms": parts}
    if args.device == "cuda":
        import torch

        figures["config"]["gpu"] = torch.cuda.get_device_name()
    name = "bench_swin" + ("-cpu" if args.device == "cpu" else "")
    print(f"written to {write(name, figures)}")
    if traces:
        print_traces(traces, args.device == "cuda")
    return 0


def host_ops(path: str, steps: int = 3) -> dict:
    """How many times each CPU op ran per traced step (every level of nesting)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    counts = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            counts[e["name"]] = counts.get(e["name"], 0.0) + 1.0 / steps
    return counts


def print_traces(traces: dict, cuda: bool) -> None:
    """raylm's traced steps against the plain loop's with the same draws: the host's ops
    per step, the ops whose count differs most, and on a GPU its busy and idle time."""
    mine, theirs = host_ops(traces["raylm"]), host_ops(traces["plain-draws"])
    print(f"host ops per step: raylm {sum(mine.values()):,.0f}, plain loop with the draws "
          f"{sum(theirs.values()):,.0f}; most different (raylm, plain):")
    for k in sorted(set(mine) | set(theirs),
                    key=lambda k: -abs(mine.get(k, 0.0) - theirs.get(k, 0.0)))[:12]:
        print(f"  {mine.get(k, 0.0):>8.1f} {theirs.get(k, 0.0):>8.1f}  {k[:100]}")
    if not cuda:
        return
    for name, path in traces.items():
        print(f"{name}: GPU busy {kernel_times(path)[1]:.2f} ms a step")
    print_idle({name: {"trace": path} for name, path in traces.items()}, list(traces))


if __name__ == "__main__":
    sys.exit(main())
