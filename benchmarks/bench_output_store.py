"""Checkpoints and the model into a bucket against a local disk: save and load times.

    python benchmarks/bench_output_store.py                  # GPT-2 12 x 768, ~1 GB state
    python benchmarks/bench_output_store.py --layers 4 --repeats 2

A rank's checkpoint path, as a run takes it: the model's and the AdamW optimizer's state
(one step taken, so the moments exist) written by torch.distributed.checkpoint through
raylm.storage's writer (``dcp_writer``: DCP's file-system writer on a local directory, or
on pyarrow's S3 file system for an ``s3://`` URI) and read back through its reader into
a fresh model; then the final model as ``save_pretrained`` writes it (for a bucket, into
a temporary directory that is uploaded: ``storage.written_dir``). The bucket is moto's
S3 server on this machine (loopback, in memory): it measures raylm's path and pyarrow's
client against a Python server, not a cloud's network; moto serves each ranged read by
copying the whole object, so a load's time here is mostly moto's. Each figure is the
median of ``--repeats``.

raylm has no asynchronous checkpoint save (on disk or in a bucket): a save holds the
step, and its time here is what a run waits for at each --save_steps.

The figures are written to benchmarks/results/bench_output_store-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def build(layers: int, width: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                       vocab_size=4096, n_positions=256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 4096, (1, 32)), labels=torch.randint(0, 4096, (1, 32))
          ).loss.backward()
    optimizer.step()
    return model, optimizer


def state_of(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(where: str, model, optimizer, fresh, repeats: int) -> dict:
    """Median seconds to save the checkpoint, load it, and save the model at ``where``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from raylm import storage

    state = state_of(model, optimizer)
    saves, loads, models = [], [], []
    for i in range(repeats):
        path = storage.join(where, f"step-{i}")
        saves.append(timed(lambda: dcp.save(state, storage_writer=storage.dcp_writer(path),
                                            no_dist=True)))
        target = state_of(*fresh)
        loads.append(timed(lambda: dcp.load(target, storage_reader=storage.dcp_reader(path),
                                            no_dist=True)))
        for k, v in state["model"].items():  # (the load is checked, not only timed)
            torch.testing.assert_close(target["model"][k], v)

        def save_model():
            with storage.written_dir(storage.join(where, f"model-{i}")) as out:
                model.save_pretrained(out, safe_serialization=True)
        models.append(timed(save_model))
        storage.delete(path)
        storage.delete(storage.join(where, f"model-{i}"))
    return {"checkpoint_save_s": statistics.median(saves),
            "checkpoint_load_s": statistics.median(loads),
            "model_save_s": statistics.median(models)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import warnings

    import torch

    from benchmarks.results import write
    from raylm.compat import watch_torchvision
    from object_store import s3_endpoint

    watch_torchvision()  # (transformers imports torchvision where installed: raylm.compat)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    torch.set_num_threads(1)
    model, optimizer = build(args.layers, args.width)
    fresh = build(args.layers, args.width)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in
                      [*model.state_dict().values(),
                       *(v for s in optimizer.state.values() for v in s.values()
                         if torch.is_tensor(v))])
    rows = {}
    disk = tempfile.mkdtemp(prefix="bench-output-store-")
    try:
        rows["local disk"] = measure(disk, model, optimizer, fresh, args.repeats)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    with s3_endpoint() as s3:
        rows["s3 (moto, loopback)"] = measure(s3.uri("bench"), model, optimizer, fresh,
                                              args.repeats)
    mb = state_bytes / 2**20
    for row in rows.values():
        row["checkpoint_save_mb_per_s"] = mb / row["checkpoint_save_s"]
        row["checkpoint_load_mb_per_s"] = mb / row["checkpoint_load_s"]
    base = rows["local disk"]
    for row in rows.values():
        row["save_vs_disk"] = row["checkpoint_save_s"] / base["checkpoint_save_s"]
    figures = {"config": {"model": f"GPT-2 {args.layers} x {args.width}, vocab 4096",
                          "parameters": params, "checkpoint_mb": round(mb, 1),
                          "repeats": args.repeats, "async_save": "not built"},
               "rows": rows}
    for name, row in rows.items():
        print(f"{name:>22}: save {row['checkpoint_save_s']:.2f} s, load "
              f"{row['checkpoint_load_s']:.2f} s, model {row['model_save_s']:.2f} s "
              f"({row['save_vs_disk']:.2f}x the disk's save)")
    print(f"wrote {write('bench_output_store', figures)}")
    os._exit(0)  # (moto's server threads)


if __name__ == "__main__":
    main()
