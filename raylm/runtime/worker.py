"""RankWorker: the Ray actor that owns one rank of the layout.

It joins the torch.distributed world the driver arranged, builds its part of the model,
reads its own samples from the tokenized cache, and runs the steps the driver hands it.
Gradients and losses move between ranks over the process groups; the driver only sees
scalars.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from datetime import timedelta

log = logging.getLogger("raylm")


def causal_lm_loss_sum(logits, labels):
    """Summed next-token cross-entropy (labels shifted by one, -100 ignored).

    Summed, not averaged: the step divides by the token count of the whole global batch,
    so that every layout computes the same loss as one process would.
    """
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")


def count_label_tokens(labels) -> int:
    return int((labels[:, 1:] != -100).sum())


class RankWorker:
    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.model = None
        self.prefetcher = None

    # -- set-up ----------------------------------------------------------------------------
    def info(self) -> dict:
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master: str, plan, spec, dataset, train_cfg: dict, total_steps: int) -> dict:
        """Join the process groups, build model and optimizer, open the data."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from raylm.data.reader import BlockReader, Prefetcher
        from raylm.models.loading import build_model
        from raylm.parallel.data import GradientAllReduce
        from raylm.plan.layout import MESH_DIMS

        t0 = time.time()
        self.plan = plan
        self.cfg = train_cfg
        self.device = torch.device("cuda", 0) if plan.use_gpu else torch.device("cpu")
        backend = "nccl" if plan.use_gpu else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=train_cfg["collective_timeout_s"]))
        # One mesh, named dims; later parallelisms take their groups from it.
        self.mesh = init_device_mesh(self.device.type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_rank = self.mesh["dp"].get_local_rank()

        self.model = build_model(spec, train_cfg["seed"]).to(self.device)
        self.optimizer = self._make_optimizer()
        self.total_steps = total_steps
        self.scheduler = self._make_scheduler(total_steps)
        self.grad_sync = GradientAllReduce(self.model.parameters(), self.dp_group)
        # Dropout differs per rank, and is reproducible per rank.
        torch.manual_seed(train_cfg["seed"] + 1 + self.rank)

        self.reader = BlockReader(dataset) if dataset is not None else None
        self.prefetcher = Prefetcher(self.reader) if self.reader is not None else None
        self.eval_reader = None
        return {"rank": self.rank, "setup_s": time.time() - t0,
                "parameters": sum(p.numel() for p in self.model.parameters())}

    def _make_optimizer(self):
        import torch

        # Decay matrices only, not biases or norm weights (as HF's Trainer does).
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        c = self.cfg
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": c["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=c["learning_rate"], betas=(c["adam_beta1"], c["adam_beta2"]),
            eps=c["adam_epsilon"])

    def _make_scheduler(self, total_steps: int):
        from transformers import get_scheduler

        return get_scheduler(self.cfg["lr_scheduler_type"], self.optimizer,
                             num_warmup_steps=self.cfg["warmup_steps"],
                             num_training_steps=max(1, total_steps))

    def _set_schedule_step(self, step: int) -> None:
        # The LR schedule is a function of the step: move it there without stepping.
        self.scheduler.last_epoch = step
        lrs = [base * lam(step) for base, lam in
               zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs

    # -- the training step -----------------------------------------------------------------
    def train_step(self, step: int, micro_batch_ids: list, next_ids: list | None = None) -> dict:
        """One optimizer step over this rank's micro-batches (sample ids from the driver).

        Read top to bottom: data, token count, forward/backward per micro-batch (the
        gradient all-reduce starts during the last backward), gradient sync, clip,
        optimizer, schedule. Returns scalars only.
        """
        import torch

        from raylm.parallel.data import all_reduce_sum_async

        t0 = time.time()
        batches = self.prefetcher.get(step, micro_batch_ids)
        if next_ids is not None:
            self.prefetcher.submit(step + 1, next_ids)
        t_data = time.time() - t0

        # The loss of a step is the mean over every label token of the global batch, so
        # each rank needs the global count before its first backward: sum it over dp in
        # the background while the first forward runs.
        local_tokens = sum(count_label_tokens(b["labels"]) for b in batches)
        global_tokens, count_work = all_reduce_sum_async([local_tokens], self.dp_group,
                                                         self.device)

        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, b in enumerate(batches):
            mb_loss, _ = self._loss_sum(b)
            loss_sum += mb_loss.detach()
            if i == 0 and count_work is not None:
                count_work.wait()
            if i == len(batches) - 1:
                self.grad_sync.arm(loss_sum)  # buckets reduce as their grads are ready
            (mb_loss / global_tokens[0].to(mb_loss.dtype)).backward()
        if not batches:  # no samples for this rank in an epoch's short last step
            if count_work is not None:
                count_work.wait()
            self.grad_sync.arm(loss_sum)

        global_loss = self.grad_sync.finish()  # gradients (and the loss) summed over dp
        grad_norm = None
        if self.cfg["max_grad_norm"] and self.cfg["max_grad_norm"] > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                             self.cfg["max_grad_norm"]))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.grad_sync.zero_grad()

        tokens = float(global_tokens[0].item())
        out = {"loss": float(global_loss.item()) / max(tokens, 1.0), "tokens": int(tokens),
               "local_tokens": local_tokens, "learning_rate": lr, "grad_norm": grad_norm,
               "data_wait_s": t_data, "step_s": time.time() - t0}
        if self.cfg.get("log_sample_ids"):
            out["sample_ids"] = [int(i) for ids in micro_batch_ids for i in ids]
        return out

    def _loss_sum(self, batch: dict):
        """Forward one micro-batch; its summed token loss and its labels."""
        labels = batch["labels"].to(self.device)
        # Packed blocks have no padding: no mask, so attention takes its causal fast path.
        padded = bool((batch["attention_mask"] == 0).any())
        mask = batch["attention_mask"].to(self.device) if padded else None
        logits = self.model(input_ids=batch["input_ids"].to(self.device),
                            attention_mask=mask).logits
        return causal_lm_loss_sum(logits, labels), labels

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, micro_batch_ids: list, eval_dataset=None) -> dict:
        """Summed loss and token count over this rank's eval batches, reduced over dp."""
        import torch

        from raylm.data.reader import BlockReader
        from raylm.parallel.data import all_reduce_sum

        reader = self.reader
        if eval_dataset is not None:
            if self.eval_reader is None:
                self.eval_reader = BlockReader(eval_dataset)
            reader = self.eval_reader
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        with torch.no_grad():
            for ids in micro_batch_ids:
                batch_loss, labels = self._loss_sum(reader.read(ids))
                loss_sum += batch_loss.item()
                tokens += count_label_tokens(labels)
        loss_sum, tokens = all_reduce_sum([loss_sum, tokens], self.dp_group, self.device)
        eval_loss = loss_sum / max(tokens, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700)),
                "eval_tokens": int(tokens)}

    # -- checkpoints and output ------------------------------------------------------------
    def save_checkpoint(self, path: str) -> bool:
        from raylm.checkpoint.state import save_rank_state

        save_rank_state(path, self.model, self.optimizer, self.rank)
        return True

    def load_checkpoint(self, path: str, step: int) -> bool:
        from raylm.checkpoint.state import load_rank_state

        load_rank_state(path, self.model, self.optimizer, self.rank,
                        fallback_seed=self.cfg["seed"] + 1 + self.rank + 7919 * step)
        self._set_schedule_step(step)
        return True

    def save_pretrained(self, output_dir: str) -> bool:
        """Rank 0 writes one ordinary Hugging Face model (safetensors)."""
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per save in the driver's log is noise
            self.model.config.use_cache = True
            self.model.save_pretrained(output_dir, safe_serialization=True)
            self.model.config.use_cache = False
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if self.prefetcher is not None:
            self.prefetcher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
