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

from raylm.parallel.mesh import build_mesh, sharded_axes

log = logging.getLogger("raylm")


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

        from raylm.data.reader import BlockReader, Prefetcher
        from raylm.models.loading import build_model
        from raylm.models.objectives import objective_for
        from raylm.parallel.zero import gradient_sync

        t0 = time.time()
        self.plan = plan
        self.cfg = train_cfg
        self.device = torch.device("cuda", 0) if plan.use_gpu else torch.device("cpu")
        backend = "nccl" if plan.use_gpu else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=train_cfg["collective_timeout_s"]))
        # One mesh, named dims; later parallelisms take their groups from it.
        self.mesh = build_mesh(plan.dims, self.device.type)
        self.dp_group = self.mesh["dp"].get_group()
        self.dp_rank = self.mesh["dp"].get_local_rank()

        # ZeRO-3 builds the model on the meta device: no rank ever holds all of it; the
        # weights are materialised shard by shard once the layout is applied.
        self.zero_stage = plan.zero_stage
        meta = self.zero_stage == 3
        if meta:
            self.model = build_model(spec, train_cfg["seed"], device="meta")
        else:
            self.model = build_model(spec, train_cfg["seed"]).to(self.device)
        self.spec = spec
        self.objective = objective_for(spec.config, train_cfg.get("objective"))
        self.step = None  # the optimizer step being run (objectives may draw per step)
        # The parallelisms, in a fixed order: tensor parallelism shards the whole model's
        # layers first (every rank holds the same weights, so each takes its shard), then
        # the pipeline cut keeps this rank's stages of the sharded model.
        self.tensor_parallel = None
        if plan.tp > 1:
            from raylm.parallel.tensor import apply_tensor_parallel

            self.tensor_parallel = apply_tensor_parallel(self.model, self.mesh["tp"],
                                                         plan.sequence_parallel)
        self.pipeline = None
        self.line_by_line = bool(dataset is not None and dataset.line_by_line)
        if plan.pp > 1:
            self.pipeline = self._make_pipeline(plan)
        elif self.zero_stage == 3:
            self._shard_parameters([self.model])
        from raylm.parallel.tensor import canonical_adapter

        # Checkpoints and the saved model in the model's own (layout-free) shapes.
        self.canonical = canonical_adapter(self.model, self.tensor_parallel)
        # How gradients meet over dp (by ZeRO stage; one interface for all of them).
        self.grad_sync = gradient_sync(self.zero_stage, self.model, self.dp_group)
        self.optimizer, self.stepper = self._make_optimizer()
        self.total_steps = total_steps
        self.scheduler = self._make_scheduler(total_steps)
        # Dropout differs per rank, and is reproducible per rank; tensor-parallel peers
        # share a seed (they compute the same replicated activations).
        torch.manual_seed(train_cfg["seed"] + 1 + self._seed_rank)

        self.measure_next = True  # the first step measures what the rank holds
        self.reader = BlockReader(dataset) if dataset is not None else None
        self.prefetcher = Prefetcher(self.reader) if self.reader is not None else None
        self.eval_reader = None
        return {"rank": self.rank, "setup_s": time.time() - t0,
                "parameters": sum(p.numel() for p in self.model.parameters())}

    def _make_pipeline(self, plan):
        """Cut the model to this rank's stages; tied-weight groups on every rank, in one
        order (new_group is collective over the world)."""
        import torch
        import torch.distributed as dist

        from raylm.parallel.pipeline.runtime import PipelineRuntime
        from raylm.parallel.pipeline.stages import cut
        from raylm.plan.partition import Partition, stage_ranks

        part = Partition(bounds=[tuple(b) for b in plan.stage_bounds],
                         stage_rank=stage_ranks(plan.schedule, plan.pp, plan.virtual))
        pp_rank = self.mesh["pp"].get_local_rank()
        stage_ids = part.stages_of(pp_rank)
        example = torch.zeros(plan.micro_batch_size, plan.seq_len, dtype=torch.long)
        modules, holders, self.eval_stage_modules = cut(self.model, part, stage_ids, example)
        if self.zero_stage == 3:  # before the runtime takes references to the parameters
            self._shard_parameters(list(modules))
        dims, me = plan.dims, plan.dims.coords(self.rank)
        tied_groups = {}
        for ranks in sorted({tuple(r) for r in holders.values() if len(r) > 1}):
            for d in range(plan.dp):
                for t in range(plan.tp):
                    group = dist.new_group([dims.rank(dp=d, pp=r, tp=t) for r in ranks])
                    if (d, t) == (me["dp"], me["tp"]):
                        tied_groups[ranks] = group
        self.global_tokens = 1.0
        return PipelineRuntime(self.model, modules, stage_ids, part, holders, plan.schedule,
                               plan.micro_batches_per_rank, self._pipeline_loss,
                               self.mesh["pp"].get_group(), pp_rank, self.device, tied_groups)

    def _shard_parameters(self, roots: list) -> None:
        """ZeRO-3: FSDP2 over the dp group (each rank keeps 1/dp of every tensor)."""
        from torch.distributed.tensor import DTensor

        from raylm.parallel.zero.fsdp import apply_fsdp

        # The tensor-parallel placement of each parameter, before FSDP adds the dp dim.
        tp_layout = {n: (p.device_mesh, p.placements, p.shape)
                     for n, p in self.model.named_parameters(remove_duplicate=False)
                     if isinstance(p, DTensor)}
        apply_fsdp(self.model, roots, self.mesh["dp"], self.plan.cpu_offload)
        if any((p.to_local() if isinstance(p, DTensor) else p).is_meta
               for p in self.model.parameters()):
            # Before anything takes references to the parameters (materialising makes
            # new ones): each rank fills its shards, one tensor of the model at a time.
            from raylm.parallel.tensor import canonical_adapter
            from raylm.parallel.zero.fsdp import materialize

            materialize(self.model, self.spec, self.cfg["seed"], self.device, tp_layout,
                        canonical_adapter(self.model, self.tensor_parallel))

    @property
    def _seed_rank(self) -> int:
        return self.plan.dims.seed_index(self.rank)

    def _loss_context(self):
        """Forward, loss and backward run inside this: the parallel cross-entropy over
        vocabulary-sharded logits under tensor parallelism."""
        import contextlib

        if self.tensor_parallel is None:
            return contextlib.nullcontext()
        return self.tensor_parallel.loss_context()

    def _clip(self, max_norm: float) -> float:
        """Clip to ``max_norm`` over the whole model; the norm before clipping."""
        pipe = self.pipeline
        if pipe is None:
            return self.grad_sync.clip(self.grad_sync.params, max_norm)
        return self.grad_sync.clip(pipe.norm_params, max_norm, pipe.pp_group)

    def _pipeline_loss(self, logits, labels):
        # The last stage's loss per micro-batch: summed token loss over the step's global
        # token count (1 during evaluation, which wants sums).
        return self.objective.loss_sum(logits, labels) / self.global_tokens

    def _make_optimizer(self):
        # Decay matrices only, not biases or norm weights (as HF's Trainer does).
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        c = self.cfg
        groups = [{"params": decay, "weight_decay": c["weight_decay"]},
                  {"params": no_decay, "weight_decay": 0.0}]
        hyper = dict(lr=c["learning_rate"], betas=(c["adam_beta1"], c["adam_beta2"]),
                     eps=c["adam_epsilon"])
        return self.grad_sync.make_optimizer(groups, **hyper)

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
        self.step = step
        # A middle pipeline stage reads nothing: its input arrives from the previous stage.
        reads = self.pipeline is None or self.pipeline.needs_data or self.line_by_line
        batches = self.prefetcher.get(step, micro_batch_ids) if reads else []
        if next_ids is not None and reads:
            self.prefetcher.submit(step + 1, next_ids)
        t_data = time.time() - t0
        if self.pipeline is not None:
            return self._pipeline_step(step, batches, micro_batch_ids, t0, t_data)
        if self.zero_stage == 3:
            # FSDP gathers parameters inside every forward and backward: a rank short of
            # samples (an epoch's last step) runs filler rows (no labels) to keep pace.
            batches = batches + [self._filler() for _ in
                                 range(self.plan.micro_batches_per_rank - len(batches))]

        # The loss of a step is the mean over every label token of the global batch, so
        # each rank needs the global count before its first backward: sum it over dp in
        # the background while the first forward runs.
        local_tokens = sum(self._count(b) for b in batches)
        global_tokens, count_work = all_reduce_sum_async([local_tokens], self.dp_group,
                                                         self.device)

        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        meter = self._meter()
        with self._loss_context(), meter:
            for i, b in enumerate(batches):
                mb_loss, _ = self._loss_sum(b)
                loss_sum += mb_loss.detach()
                if i == 0 and count_work is not None:
                    count_work.wait()
                if i == len(batches) - 1:
                    self.grad_sync.arm(loss_sum)  # buckets reduce as their grads are ready
                (mb_loss / global_tokens[0].to(mb_loss.dtype)).backward()
                self.grad_sync.end_round()
        if not batches:  # no samples for this rank in an epoch's short last step
            if count_work is not None:
                count_work.wait()
            self.grad_sync.arm(loss_sum)
        for _ in range(self.plan.micro_batches_per_rank - len(batches)):
            self.grad_sync.end_round(force=True)  # as many rounds as the other ranks

        global_loss = self.grad_sync.finish()  # gradients (and the loss) summed over dp
        out = self._apply(self._clip)
        self._report_memory(out, meter)
        tokens = float(global_tokens[0].item())
        out.update({"loss": float(global_loss.item()) / max(tokens, 1.0), "tokens": int(tokens),
                    "local_tokens": local_tokens, "data_wait_s": t_data,
                    "step_s": time.time() - t0})
        if self.cfg.get("log_sample_ids"):
            out["sample_ids"] = [int(i) for ids in micro_batch_ids for i in ids]
        return out

    def _apply(self, clip) -> dict:
        """Clip (``clip(max_norm)`` returns the norm before clipping), optimizer step,
        schedule step, zero the gradients."""
        import resource

        grad_norm = None
        if self.cfg["max_grad_norm"] and self.cfg["max_grad_norm"] > 0:
            grad_norm = clip(self.cfg["max_grad_norm"])
        lr = self.optimizer.param_groups[0]["lr"]
        self.stepper.step()
        self.scheduler.step()
        self.grad_sync.zero_grad()
        # Peak resident memory of this rank's process so far (Linux reports KiB).
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"learning_rate": lr, "grad_norm": grad_norm, "peak_rss_bytes": peak_rss}

    def _pipeline_step(self, step: int, batches: list, micro_batch_ids: list, t0: float,
                       t_data: float) -> dict:
        """The same step under pipeline parallelism: the schedule runs forward and backward
        over the step's micro-batches (first stage fed input ids, last stage labels), then
        the gradients are summed over dp and between tied copies, clipped over the whole
        pipeline, and applied."""
        import torch

        from raylm.parallel.data import all_reduce_sum_async

        pipe = self.pipeline
        local_tokens = sum(self._count(b) for b in batches) if pipe.has_last else 0
        global_tokens, count_work = all_reduce_sum_async([local_tokens], self.dp_group,
                                                         self.device)
        if count_work is not None:
            count_work.wait()
        self.global_tokens = float(global_tokens[0].item()) or 1.0
        ids, labels, kwargs = self._stack(batches)
        pipe.train(True)
        meter = self._meter()
        with self._loss_context(), meter:
            losses = pipe.run(ids, labels, kwargs)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb_loss in losses:
            loss_sum += mb_loss.detach().double() * self.global_tokens
        self.grad_sync.arm(loss_sum)
        global_loss = self.grad_sync.finish()  # dp sum (each stage over its own dp group)
        pipe.sync_tied_grads(self.grad_sync.grad_of)  # (ZeRO 1/2: the rows this rank owns)
        out = self._apply(self._clip)  # the norm over the whole pipeline
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

        return ActivationMeter(self.model)

    def _report_memory(self, out: dict, meter) -> None:
        """Add what this rank holds (measured from its tensors) to the step's result."""
        if not self.measure_next:
            return
        from raylm.runtime.memory import state_bytes

        self.measure_next = False
        out["memory"] = {**state_bytes(self.model, self.optimizer,
                                       self.grad_sync.held_gradients()),
                         "replica_elements": self._replica_elements(),
                         "activations": meter.peak,
                         "coords": self.plan.dims.coords(self.rank)}

    def _replica_elements(self) -> int:
        """Parameters this rank's data-parallel replica holds of what this rank holds
        (its stage, its tensor-parallel shard; before any ZeRO partition): the Psi of
        the ZeRO formulas for this rank."""
        total, seen = 0, set()
        for p in self.model.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel() // sharded_axes(p).get("tp", 1)
        return total

    def _stack(self, batches: list):
        """The step's rows as the schedule takes them: all micro-batches stacked (it splits
        them again). Each stage gets only what it uses; the attention mask only when the
        data has padding (line by line), and then every stage needs it."""
        import torch

        pipe = self.pipeline
        parts = [self.objective.split(b, self.step) for b in batches]

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
        return self.objective.count(self.objective.split(batch, self.step)["labels"])

    def _loss_sum(self, batch: dict):
        """Forward one micro-batch; its summed token loss and its labels."""
        parts = {k: v.to(self.device) for k, v in self.objective.split(batch, self.step).items()}
        labels = parts.pop("labels")
        # Packed blocks have no padding: no mask, so attention takes its causal fast path.
        if bool((batch["attention_mask"] == 0).any()):
            parts["attention_mask"] = batch["attention_mask"].to(self.device)
        logits = self.model(**parts).logits
        return self.objective.loss_sum(logits, labels), labels

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
        if self.zero_stage == 3 and self.pipeline is None:
            # As in training: every dp rank runs as many forwards (FSDP gathers in each).
            most = int(all_reduce_max(len(micro_batch_ids), self.dp_group, self.device))
            micro_batch_ids = list(micro_batch_ids) + [
                [PAD_ID] * self.plan.micro_batch_size] * (most - len(micro_batch_ids))
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        with torch.no_grad(), self._loss_context():
            if self.pipeline is not None:
                # micro_batch_ids: chunks of one step's shape (the schedule's micro-batch
                # count and size), filled up with padding ids.
                self.pipeline.train(False)
                reads = self.pipeline.needs_data or self.line_by_line
                for chunk in micro_batch_ids:
                    batches = [reader.read(ids) for ids in chunk] if reads else []
                    ids, labels, kwargs = self._stack(batches)
                    losses = self.pipeline.forward_only(ids, labels, kwargs,
                                                        self.objective.loss_sum,
                                                        self.eval_stage_modules)
                    loss_sum += sum(float(x) for x in losses)
                    if self.pipeline.has_last:
                        tokens += sum(self._count(b) for b in batches)
            else:
                for ids in micro_batch_ids:
                    batch_loss, labels = self._loss_sum(reader.read(ids))
                    loss_sum += batch_loss.item()
                    tokens += self.objective.count(labels)
        loss_sum, tokens = all_reduce_sum([loss_sum, tokens], self.dp_group, self.device)
        eval_loss = loss_sum / max(tokens, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700)),
                "eval_tokens": int(tokens),
                "has_loss": self.pipeline is None or self.pipeline.has_last}

    # -- checkpoints and output ------------------------------------------------------------
    def save_checkpoint(self, path: str) -> bool:
        from raylm.checkpoint.state import save_rank_state

        save_rank_state(path, self.model, self.optimizer, self.rank, self.canonical,
                        zero=self._zero_form())
        return True

    def load_checkpoint(self, path: str, step: int) -> bool:
        from raylm.checkpoint.state import load_rank_state

        load_rank_state(path, self.model, self.optimizer, self.rank, self.canonical,
                        fallback_seed=self.cfg["seed"] + 1 + self._seed_rank + 7919 * step,
                        zero=self._zero_form())
        self._set_schedule_step(step)
        return True

    def _zero_form(self):
        """ZeRO 1/2: the partitioned optimizer's state in checkpoint form; else None."""
        return self.grad_sync.checkpoint_form(self.model, self.mesh["dp"])

    def save_pretrained(self, output_dir: str) -> bool:
        """Rank 0 writes one ordinary Hugging Face model (safetensors).

        Without tensor or pipeline parallelism rank 0 holds the whole model and saves it.
        Otherwise the first data-parallel replica assembles it: each tensor-parallel group
        gathers its shards into full tensors in the model's own shapes (original
        vocabulary, Hugging Face orientation), the pipeline stages send theirs to rank 0
        over the pp group, and rank 0 loads them into a fresh model and saves that (it
        needs the whole model's memory for that moment)."""
        model = self.model
        if self.pipeline is not None or self.tensor_parallel is not None or \
                self.zero_stage == 3:
            model = self._assemble_model()
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per save in the driver's log is noise
            model.config.use_cache = True
            model.save_pretrained(output_dir, safe_serialization=True)
            model.config.use_cache = False
        return True

    def _assemble_model(self):
        import torch.distributed as dist

        from raylm.models.loading import build_model

        if self.dp_rank != 0 and self.zero_stage != 3:
            return None
        # Collective over the tp group (and the dp group under ZeRO-3, whose shards are
        # gathered one tensor at a time: only the saving ranks keep them).
        keep = self.dp_rank == 0 and self.mesh["tp"].get_local_rank() == 0
        state = self.canonical.hf_state_dict(self.model, keep=keep)
        if not keep:
            return None
        if self.pipeline is not None:
            parts = [None] * self.plan.pp if self.rank == 0 else None
            dist.gather_object(state, parts, dst=0, group=self.mesh["pp"].get_group())
            if self.rank != 0:
                return None
            state = {k: v for part in parts for k, v in part.items()}
        full = build_model(self.spec, self.cfg["seed"])
        full.load_state_dict(state, strict=True)
        return full

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if self.prefetcher is not None:
            self.prefetcher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
