"""HF Trainer baseline for bench_throughput.py: one process, ``transformers.Trainer``.

    python benchmarks/hf_trainer_baseline.py --config_dir D --data_dir C --global_batch 16 \
        --steps 23 --threads 2

What a Hugging Face user runs: the Trainer with its defaults (its fused AdamW, gradient
clipping at 1.0, a linear schedule), on the same model (same config, same seed), the same
tokenized blocks in the same order as raylm and the other baselines (ddp_baseline.build:
raylm's cache, BlockReader and GlobalBatchSampler), the whole global batch in one
per-device batch. The Trainer shuffles its data; here its sampler is sequential over the
sample ids in the sampler's order, and its collator reads those blocks.

Its logged loss is not the others' mean: the Trainer divides the summed token losses by
``num_items_in_batch``, which counts every label position, while a causal LM predicts
block - 1 of them per block; so it logs (block - 1) / block of the same loss (8.165 =
8.294 x 63/64 at block 64), and its gradients are scaled alike, which AdamW does not see.

A step's time is the wall time between the ends of consecutive steps (Trainer callbacks),
so the data loading, the Trainer's own bookkeeping and its per-step logging (loss every
step, as the other rows record it) are inside it. Prints one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ddp_baseline import add_args, build  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    add_args(ap)
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from torch.utils.data import Dataset, SequentialSampler
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, reader, sampler, block_size = build(args)
    order = np.concatenate([sampler.global_batch(s) for s in range(args.steps)])

    class SampleIds(Dataset):
        def __len__(self):
            return len(order)

        def __getitem__(self, i):
            return int(order[i])

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    def collate(ids):
        batch = reader.read(ids)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_times, self.losses, self.last = [], [], None

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_times.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.global_batch,
            max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0, warmup_steps=0,
            lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1,
            save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
            seed=args.seed, dataloader_num_workers=0, remove_unused_columns=False)
        trainer = InOrder(model=model, args=training_args, train_dataset=SampleIds(),
                          data_collator=collate, callbacks=[clock])
        trainer.train()
    print("RESULT " + json.dumps({
        "world_size": 1, "threads": args.threads, "global_batch": args.global_batch,
        "block_size": block_size, "step_times": clock.step_times, "losses": clock.losses,
        "optim": str(training_args.optim), "parts": [],
        "parameters": sum(p.numel() for p in model.parameters())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
