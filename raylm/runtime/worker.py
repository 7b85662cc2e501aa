"""RankWorker: the Ray actor that owns one rank of the layout.

It joins the torch.distributed world the driver arranged (``join``), has its engine built
(``build``: the model, its layout and optimizer, raylm.runtime.engine), reads its own
samples from the tokenized cache, and runs the steps the driver hands it. Gradients and
losses move between ranks over the process groups; the driver only sees scalars.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from datetime import timedelta

from raylm.parallel.mesh import build_mesh

log = logging.getLogger("raylm")


class RankWorker:
    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.engine = None  # raylm.runtime.engine.Engine, once built
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

    def join(self, master: str, plan, collective_timeout_s: float) -> bool:
        """Join the world's process group at ``master`` and build the mesh of
        ``plan.dims``. Separate from ``build``: a rank can join a new group (another
        world size) and keep what it holds."""
        import torch
        import torch.distributed as dist

        self.plan = plan
        self.device = torch.device("cuda", 0) if plan.use_gpu else torch.device("cpu")
        dist.init_process_group("nccl" if plan.use_gpu else "gloo",
                                init_method=f"tcp://{master}", rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        # One mesh, named dims; every parallelism takes its groups from it.
        self.mesh = build_mesh(plan.dims, self.device.type)
        return True

    def build(self, spec, dataset, train_cfg: dict, total_steps: int) -> dict:
        """Build this rank's engine (model, layout, optimizer: raylm.runtime.engine) and
        open the data."""
        import torch

        from raylm.data.reader import BlockReader, Prefetcher
        from raylm.runtime.engine import build_engine

        t0 = time.time()
        self.cfg = train_cfg
        self.engine = build_engine(self.plan, self.rank, self.mesh, self.device, spec,
                                   train_cfg, total_steps)
        self.step = None  # the optimizer step being run (objectives may draw per step)
        self.line_by_line = bool(dataset is not None and dataset.line_by_line)
        # Dropout differs per rank, and is reproducible per rank; tensor-parallel peers
        # share a seed (they compute the same replicated activations).
        torch.manual_seed(train_cfg["seed"] + 1 + self._seed_rank)
        self.measure_next = True  # the first step measures what the rank holds
        self.reader = BlockReader(dataset) if dataset is not None else None
        self.prefetcher = Prefetcher(self.reader) if self.reader is not None else None
        self.eval_reader = None
        return {"rank": self.rank, "setup_s": time.time() - t0,
                "parameters": sum(p.numel() for p in self.engine.model.parameters())}

    @property
    def _seed_rank(self) -> int:
        return self.plan.dims.seed_index(self.rank)

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
        self.step = step
        e = self.engine
        # A middle pipeline stage reads nothing: its input arrives from the previous stage.
        reads = e.pipeline is None or e.pipeline.needs_data or self.line_by_line
        batches = self.prefetcher.get(step, micro_batch_ids) if reads else []
        if next_ids is not None and reads:
            self.prefetcher.submit(step + 1, next_ids)
        t_data = time.time() - t0
        if e.pipeline is not None:
            return self._pipeline_step(step, batches, micro_batch_ids, t0, t_data)
        if e.grad_sync.collective_forwards:
            # FSDP gathers parameters inside every forward and backward: a rank short of
            # samples (an epoch's last step) runs filler rows (no labels) to keep pace.
            batches = batches + [self._filler() for _ in
                                 range(self.plan.micro_batches_per_rank - len(batches))]

        # The loss of a step is the mean over every label token of the global batch, so
        # each rank needs the global count before its first backward: sum it over dp in
        # the background while the first forward runs.
        local_tokens = sum(self._count(b) for b in batches)
        global_tokens, count_work = all_reduce_sum_async([local_tokens], e.dp_group,
                                                         self.device)

        e.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        meter = self._meter()
        with e.loss_context(), meter:
            for i, b in enumerate(batches):
                mb_loss, _ = self._loss_sum(b)
                loss_sum += mb_loss.detach()
                if i == 0 and count_work is not None:
                    count_work.wait()
                if i == len(batches) - 1:
                    e.grad_sync.arm(loss_sum)  # buckets reduce as their grads are ready
                (mb_loss / global_tokens[0].to(mb_loss.dtype)).backward()
                e.grad_sync.end_round()
        if not batches:  # no samples for this rank in an epoch's short last step
            if count_work is not None:
                count_work.wait()
            e.grad_sync.arm(loss_sum)
        for _ in range(self.plan.micro_batches_per_rank - len(batches)):
            e.grad_sync.end_round(force=True)  # as many rounds as the other ranks

        global_loss = e.grad_sync.finish()  # gradients (and the loss) summed over dp
        out = e.update()  # clip, optimizer, schedule
        self._report_memory(out, meter)
        tokens = float(global_tokens[0].item())
        out.update({"loss": float(global_loss.item()) / max(tokens, 1.0), "tokens": int(tokens),
                    "local_tokens": local_tokens, "data_wait_s": t_data,
                    "step_s": time.time() - t0})
        if self.cfg.get("log_sample_ids"):
            out["sample_ids"] = [int(i) for ids in micro_batch_ids for i in ids]
        return out

    def _pipeline_step(self, step: int, batches: list, micro_batch_ids: list, t0: float,
                       t_data: float) -> dict:
        """The same step under pipeline parallelism: the schedule runs forward and backward
        over the step's micro-batches (first stage fed input ids, last stage labels), then
        the gradients are summed over dp and between tied copies, clipped over the whole
        pipeline, and applied."""
        import torch

        from raylm.parallel.data import all_reduce_sum_async

        e = self.engine
        pipe = e.pipeline
        local_tokens = sum(self._count(b) for b in batches) if pipe.has_last else 0
        global_tokens, count_work = all_reduce_sum_async([local_tokens], e.dp_group,
                                                         self.device)
        if count_work is not None:
            count_work.wait()
        e.global_tokens = float(global_tokens[0].item()) or 1.0
        ids, labels, kwargs = self._stack(batches)
        pipe.train(True)
        meter = self._meter()
        with e.loss_context(), meter:
            losses = pipe.run(ids, labels, kwargs)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb_loss in losses:
            loss_sum += mb_loss.detach().double() * e.global_tokens
        e.grad_sync.arm(loss_sum)
        global_loss = e.grad_sync.finish()  # dp sum (each stage over its own dp group)
        pipe.sync_tied_grads(e.grad_sync.grad_of)  # (ZeRO 1/2: the rows this rank owns)
        out = e.update()  # the norm over the whole pipeline
        self._report_memory(out, meter)
        tokens = float(global_tokens[0].item())
        out.update({"loss": float(global_loss.item()) / max(tokens, 1.0), "tokens": int(tokens),
                    "has_loss": pipe.has_last, "local_tokens": local_tokens,
                    "data_wait_s": t_data, "step_s": time.time() - t0})
        if self.cfg.get("log_sample_ids") and pipe.has_first:
            out["sample_ids"] = [int(i) for ids_ in micro_batch_ids for i in ids_ if i >= 0]
        return out

    def _meter(self):
        """On the first step after set-up: count the activations autograd saves (their
        peak over the step); otherwise nothing."""
        import contextlib

        if not self.measure_next:
            return contextlib.nullcontext()
        from raylm.runtime.memory import ActivationMeter

        return ActivationMeter(self.engine.model)

    def _report_memory(self, out: dict, meter) -> None:
        """Add what this rank holds (measured from its tensors) to the step's result."""
        if not self.measure_next:
            return
        from raylm.runtime.memory import state_bytes

        self.measure_next = False
        out["memory"] = {**state_bytes(self.engine.model, self.engine.optimizer,
                                       self.engine.grad_sync.held_gradients()),
                         "replica_elements": self.engine.replica_elements(),
                         "activations": meter.peak,
                         "coords": self.plan.dims.coords(self.rank)}

    def _stack(self, batches: list):
        """The step's rows as the schedule takes them: all micro-batches stacked (it splits
        them again). Each stage gets only what it uses; the attention mask only when the
        data has padding (line by line), and then every stage needs it."""
        import torch

        pipe = self.engine.pipeline
        parts = [self.engine.objective.split(b, self.step) for b in batches]

        def stacked(key):
            return torch.cat([p[key] for p in parts]).to(self.device)

        ids = stacked("input_ids") if pipe.has_first else None
        labels = stacked("labels") if pipe.has_last else None
        kwargs = {}
        if pipe.needs_decoder_inputs:  # the stage that embeds the decoder's input (T5)
            kwargs["decoder_input_ids"] = stacked("decoder_input_ids")
        if self.line_by_line:
            kwargs["attention_mask"] = torch.cat(
                [b["attention_mask"] for b in batches]).to(self.device)
        return ids, labels, kwargs

    def _filler(self) -> dict:
        """A micro-batch of filler rows: every label ignored, so it adds nothing."""
        from raylm.data.reader import PAD_ID

        return self.reader.read([PAD_ID] * self.plan.micro_batch_size)

    def _count(self, batch: dict) -> int:
        """Label tokens of a micro-batch under the objective."""
        return self.engine.objective.count(self.engine.objective.split(batch, self.step)["labels"])

    def _loss_sum(self, batch: dict):
        """Forward one micro-batch; its summed token loss and its labels."""
        split = self.engine.objective.split(batch, self.step)
        parts = {k: v.to(self.device) for k, v in split.items()}
        labels = parts.pop("labels")
        # Packed blocks have no padding: no mask, so attention takes its causal fast path.
        if bool((batch["attention_mask"] == 0).any()):
            parts["attention_mask"] = batch["attention_mask"].to(self.device)
        logits = self.engine.model(**parts).logits
        return self.engine.objective.loss_sum(logits, labels), labels

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, micro_batch_ids: list, eval_dataset=None) -> dict:
        """Summed loss and token count over this rank's eval batches, reduced over dp."""
        import torch

        from raylm.data.reader import PAD_ID, BlockReader
        from raylm.parallel.data import all_reduce_max, all_reduce_sum

        reader = self.reader
        self.step = None  # evaluating: objectives draw nothing per step
        if eval_dataset is not None:
            if self.eval_reader is None:
                self.eval_reader = BlockReader(eval_dataset)
            reader = self.eval_reader
        e = self.engine
        if e.grad_sync.collective_forwards and e.pipeline is None:
            # As in training: every dp rank runs as many forwards (FSDP gathers in each).
            most = int(all_reduce_max(len(micro_batch_ids), e.dp_group, self.device))
            micro_batch_ids = list(micro_batch_ids) + [
                [PAD_ID] * self.plan.micro_batch_size] * (most - len(micro_batch_ids))
        e.model.eval()
        loss_sum, tokens = 0.0, 0
        with torch.no_grad(), e.loss_context():
            if e.pipeline is not None:
                # micro_batch_ids: chunks of one step's shape (the schedule's micro-batch
                # count and size), filled up with padding ids.
                e.pipeline.train(False)
                reads = e.pipeline.needs_data or self.line_by_line
                for chunk in micro_batch_ids:
                    batches = [reader.read(ids) for ids in chunk] if reads else []
                    ids, labels, kwargs = self._stack(batches)
                    losses = e.pipeline.forward_only(ids, labels, kwargs,
                                                     e.objective.loss_sum,
                                                     e.eval_stage_modules)
                    loss_sum += sum(float(x) for x in losses)
                    if e.pipeline.has_last:
                        tokens += sum(self._count(b) for b in batches)
            else:
                for ids in micro_batch_ids:
                    batch_loss, labels = self._loss_sum(reader.read(ids))
                    loss_sum += batch_loss.item()
                    tokens += e.objective.count(labels)
        loss_sum, tokens = all_reduce_sum([loss_sum, tokens], e.dp_group, self.device)
        eval_loss = loss_sum / max(tokens, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700)),
                "eval_tokens": int(tokens),
                "has_loss": e.pipeline is None or e.pipeline.has_last}

    # -- checkpoints and output ------------------------------------------------------------
    def save_checkpoint(self, path: str) -> bool:
        self.engine.save(path)
        return True

    def load_checkpoint(self, path: str, step: int) -> bool:
        self.engine.load(path, step, self._seed_rank)
        return True

    def save_pretrained(self, output_dir: str) -> bool:
        """Rank 0 writes one ordinary Hugging Face model (safetensors), assembled by the
        engine from the ranks' shards and stages where the layout splits it."""
        model = self.engine.hf_model()  # collective over the ranks that hold shards
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per save in the driver's log is noise
            model.config.use_cache = True
            model.save_pretrained(output_dir, safe_serialization=True)
            model.config.use_cache = False
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if self.prefetcher is not None:
            self.prefetcher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
