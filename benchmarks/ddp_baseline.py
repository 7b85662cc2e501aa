"""Baselines for bench_throughput.py: a plain PyTorch training loop, or the same under DDP.

    python benchmarks/ddp_baseline.py --config_dir D --data_dir C ...          # 1 process
    torchrun --nproc_per_node 2 benchmarks/ddp_baseline.py --config_dir D ...  # DDP, gloo

What a user would write without raylm: build the model from the same config with the same
seed, AdamW, gradient clipping, a linear schedule, Hugging Face's own loss
(``model(input_ids, labels=...)``), and ``DistributedDataParallel`` when launched by
torchrun. It trains on the same tokenized blocks as raylm (raylm's cache, read with
raylm's BlockReader) in the same order (raylm's GlobalBatchSampler, same seed), with the
same global batch split evenly across the ranks.

Rank 0 prints one line ``RESULT {json}`` with per-step wall times; bench_throughput.py
excludes the warm-up steps. ``run_loop`` is also Ray Train's row (raytrain_baseline.py),
and ``build`` the HF Trainer's (hf_trainer_baseline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raylm.compat import watch_torchvision  # noqa: E402

# transformers imports torchvision where it is installed (raylm[vision], the test extras):
# raylm's fix for a torchvision whose C++ operators do not load with this torch, as in
# every raylm process (the baseline itself uses no raylm code to train).
watch_torchvision()


def add_args(ap: argparse.ArgumentParser) -> None:
    """The flags every baseline takes (bench_throughput.py passes the same to each)."""
    ap.add_argument("--config_dir", required=True, help="model config (config.json)")
    ap.add_argument("--data_dir", required=True, help="raylm token cache directory")
    ap.add_argument("--global_batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="all steps, warm-up included")
    ap.add_argument("--threads", type=int, required=True, help="torch threads per process")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the loop on this process's GPU (bench_gpu.py)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="bf16: the forward under torch.autocast(bfloat16), fp32 weights "
                    "and optimizer, as raylm's --bf16")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model)")
    ap.add_argument("--profile_dir", default=None,
                    help="trace steps 2-4 with torch.profiler into DIR/plain.json")


def build(args):
    """The model (same config, same seed as raylm's), and the blocks' reader and order."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from raylm.data.reader import BlockReader
    from raylm.data.sampler import GlobalBatchSampler
    from raylm.data.tokenized import TokenizedDataset

    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    dataset = TokenizedDataset.load(args.data_dir)
    sampler = GlobalBatchSampler(np.arange(dataset.num_samples, dtype=np.int64),
                                 args.global_batch, args.seed)
    return model, BlockReader(dataset), sampler, dataset.block_size


def run_loop(args, rank: int, world: int) -> dict:
    """The loop itself, on rank ``rank`` of ``world`` (a process group of ``world`` > 1
    already joined: torchrun's, or Ray Train's); returns its timings and losses."""
    import torch
    from transformers import get_scheduler

    from raylm.data.sampler import rank_share

    torch.set_num_threads(args.threads)
    model, reader, sampler, block_size = build(args)
    parameters = sum(p.numel() for p in model.parameters())
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model.to(device)
    bf16 = args.precision == "bf16"
    if args.compile:
        model = torch.compile(model)
    prof = None
    if args.profile_dir:  # steps 2-4, as raylm's --profile traces
        os.makedirs(args.profile_dir, exist_ok=True)
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
            + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(
                os.path.join(args.profile_dir, "plain.json")))
        prof.start()

    def mark():
        # On a GPU the clock reads when the queued kernels have run, not when they were
        # queued (a plain loop syncs once a step at loss.item(); these syncs cost ~10 us).
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0,
                              num_training_steps=args.steps)

    step_times, losses, parts, grad_norms = [], [], [], []
    for step in range(args.steps):
        t0 = mark()
        ids = rank_share(sampler.global_batch(step), rank, world)
        batch = reader.read(ids)
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        t1 = mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()  # (DDP's all-reduce overlaps it; what it does not hide is in here)
        t2 = mark()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t3 = mark()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = mark()
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
        step_times.append(time.perf_counter() - t0)
        # The step's parts, named as raylm's breakdown (raylm.runtime.profiling).
        parts.append({"data_wait_s": t1 - t0, "forward_backward_s": t2 - t1,
                      "clip_s": t3 - t2, "optimizer_s": t4 - t3})
        if prof is not None:
            prof.step()
            if step == 4:
                prof.stop()
                prof = None
    return {"world_size": world, "threads": args.threads, "global_batch": args.global_batch,
            "block_size": block_size, "step_times": step_times, "losses": losses,
            "parts": parts, "parameters": parameters, "grad_norms": grad_norms}


def main() -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    if args.global_batch % world:
        raise SystemExit(f"--global_batch {args.global_batch} does not split over {world} ranks")
    result = run_loop(args, rank, world)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
