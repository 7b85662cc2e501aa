"""What layout-independent dropout masks cost: a step's forward and backward with raylm's
per-sample masks (raylm.models.dropout) against torch's own dropout, on the whole model
(a data-parallel rank), with its blocks compiled (--torch_compile: the graph breaks at
each per-sample dropout) and on each stage of a pp=2 cut (a pipeline rank's share).

    python benchmarks/bench_dropout.py            # ~4 min on a 2-core machine
    python benchmarks/bench_dropout.py --quick    # a check of the script

In process, one torch thread: each "step" runs the micro-batches a rank runs (forward
and backward of a GPT-2 with dropout 0.1 on embeddings, residuals and attention, eager
attention either way), the two variants alternated step by step so that they see the
same machine; the table holds the medians and their ratio. The pipeline's communication
is left out: it is the same with either mask. A tensor-parallel rank (which needs a
process group) is timed at its masks alone: its share of the attention probabilities
(half the heads), drawn as its slice of the whole mask, against torch's dropout on it.

Written to benchmarks/results/bench_dropout-<date>.json (-quick with --quick).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def model(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                        vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"  # (what per-sample attention dropout runs)
    return GPT2LMHeadModel(config).train()


def parts(args) -> dict:
    """name -> [modules run in order]: the whole model, and each stage of a pp=2 cut."""
    from raylm.models.dropout import name_sites
    from raylm.parallel.compile import apply_compile
    from raylm.parallel.pipeline.stages import _stage_factory
    from raylm.plan.partition import Partition

    whole = model(args)
    name_sites(whole)
    cut = model(args)
    name_sites(cut)
    half = args.layers // 2
    make, _ = _stage_factory(cut, Partition(bounds=[(0, half), (half, args.layers)],
                                            stage_rank=[0, 1]), None)
    # (--torch_compile, its default scope: per-sample masks break each block's graph
    # at each dropout, torch's own are drawn inside it; one compiled module holds both
    # variants' graphs)
    compiled = model(args)
    name_sites(compiled)
    apply_compile(compiled)
    return {"whole model (dp rank)": ["whole", whole],
            "compiled blocks (dp rank)": ["whole", compiled],
            "pp=2 stage 0": ["stage", make(0), None],
            "pp=2 stage 1": ["stage", make(1), make(0)]}


def step_s(kind, mod, before, x, step: int, per_sample: bool, sites, m: int) -> float:
    """Seconds of one rank's step: ``m`` micro-batches' forward and backward."""
    import torch

    from raylm.models.dropout import SampleDropout

    t = 0.0
    for i in range(m):
        ids = list(range(i * len(x), (i + 1) * len(x)))
        inp = x
        if kind == "stage" and before is not None:  # (the received activation)
            with torch.no_grad():
                inp = before.stage(x).detach()
            inp.requires_grad_(True)
        ctx = SampleDropout(0, step, ids, sites) if per_sample else contextlib.nullcontext()
        t0 = time.perf_counter()
        with ctx:
            out = mod(input_ids=x).logits if kind == "whole" else mod.stage(inp)
        out.float().square().mean().backward()
        t += time.perf_counter() - t0
    return t


def shard_mask_s(args, x_shape, step: int, per_sample: bool, m: int) -> float:
    """Seconds of a tp=2 rank's attention-probability dropouts in one step: its half of
    the heads, ``m`` micro-batches times ``layers`` calls."""
    import torch
    import torch.nn.functional as F

    from raylm.models.dropout import SampleDropout, Shards, ShardView

    whole = (args.heads, args.seq, args.seq)
    probs = torch.rand(x_shape[0], args.heads // 2, args.seq, args.seq)
    view = ShardView(Shards(None, 0, 2), {i: whole for i in range(args.layers)})
    t = 0.0
    for i in range(m):
        ids = list(range(i * len(probs), (i + 1) * len(probs)))
        ctx = (SampleDropout(0, step, ids, shards=view) if per_sample
               else contextlib.nullcontext())
        t0 = time.perf_counter()
        with ctx:
            for _ in range(args.layers):
                F.dropout(probs, 0.1)
        t += time.perf_counter() - t0
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size")
    ap.add_argument("--micro_batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.seq, args.vocab, args.steps = 64, 64, 1000, 3

    import torch

    from raylm.models.dropout import DropoutSites

    torch.set_num_threads(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    rows = {}
    for name, (kind, mod, *rest) in parts(args).items():
        before = rest[0] if rest else None
        sites = DropoutSites()  # (as a rank's engine: one per model or stage module)
        times = {True: [], False: []}
        for step in range(args.steps + 2):  # (two warm-up steps, the first the probe)
            for per_sample in (False, True):
                s = step_s(kind, mod, before, x, step, per_sample, sites, args.micro_batches)
                if step >= 2:
                    times[per_sample].append(s)
        torch_ms = 1000 * statistics.median(times[False])
        mine_ms = 1000 * statistics.median(times[True])
        rows[name] = {"torch_dropout_ms": torch_ms, "per_sample_ms": mine_ms,
                      "per_sample_vs_torch": mine_ms / torch_ms}
        print(f"{name:<24} torch {torch_ms:8.1f} ms   per-sample {mine_ms:8.1f} ms   "
              f"ratio {mine_ms / torch_ms:5.3f}")
    times = {True: [], False: []}
    for step in range(args.steps + 2):
        for per_sample in (False, True):
            s = shard_mask_s(args, x.shape, step, per_sample, args.micro_batches)
            if step >= 2:
                times[per_sample].append(s)
    torch_ms = 1000 * statistics.median(times[False])
    mine_ms = 1000 * statistics.median(times[True])
    name = "tp=2 rank: attention masks"
    rows[name] = {"torch_dropout_ms": torch_ms, "per_sample_ms": mine_ms,
                  "per_sample_vs_torch": mine_ms / torch_ms}
    print(f"{name:<24} torch {torch_ms:8.1f} ms   per-sample {mine_ms:8.1f} ms   "
          f"ratio {mine_ms / torch_ms:5.3f}")
    from benchmarks.results import write

    figures = {"config": {"model": f"GPT-2 {args.layers} layers, hidden {args.hidden}, "
                                   f"{args.heads} heads, vocabulary {args.vocab}",
                          "seq_len": args.seq, "micro_batch": args.batch,
                          "micro_batches": args.micro_batches, "steps": args.steps,
                          "dropout": 0.1, "threads": 1},
               "rows": rows}
    print(f"written to {write('bench_dropout' + ('-quick' if args.quick else ''), figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
