"""A rank's engine: its share of the model and of the training state, built by one factory.

``build_engine`` assembles the rank's parts (``Parts``) in one order, as torchtitan's
``parallelize_*`` applies its transforms, then makes the engine from them once:

0. the model: whole, with its initial weights, where every rank holds all of it (data
   parallelism) or where it must be traced whole (a pipeline of the generic export
   split); otherwise (ZeRO-3, tensor parallelism, raylm's own pipeline stages) its
   skeleton on the meta device, so that no rank ever allocates the whole model, the
   weights being filled once the layout is applied (``builds_on_meta``, which also
   keeps the whole build where a skeleton would save nothing);
1. tensor parallelism: the model's layers (each rank keeps its shard;
   raylm.parallel.tensor);
2. compile (--torch_compile): each block's forward through torch.compile
   (raylm.parallel.compile);
3. activation checkpointing: each block's forward checkpointed (raylm.parallel.recompute),
   before the cut and FSDP so that their hooks sit around it;
4. the pipeline cut: this rank's stages of the sharded model (raylm.parallel.pipeline);
5. ZeRO-3: FSDP2 over the dp group on the model or the stage roots;
6. a skeleton's weights materialised, each rank filling its own shards and stages one
   tensor of the model at a time (raylm.parallel.zero.fsdp.materialize);

then the gradient sync of the ZeRO stage (raylm.parallel.zero.gradient_sync: one
interface for all of them), AdamW through it, and the LR schedule.

The engine is what the rank's loop (RankWorker.train_step) calls, whatever the layout:
``forward_backward`` (the step's micro-batches, gradients summed over dp: a loop over
micro-batches, or under a pipeline the schedule: ``PipelineEngine``), ``prepare_update``
(clip with the global gradient norm) and ``apply_update`` (optimizer, schedule: the
step's commit), ``evaluate``, ``save``/``load`` (the layout-free checkpoint state) and
``hf_model`` (the Hugging Face model to save). It is built after the process group and
the mesh exist (RankWorker.join), from the plan, the model spec and the settings only;
a data-parallel ZeRO-0 engine can leave its group and ``regroup`` in another keeping its
state, and ``broadcast_state`` gives a newcomer a live replica's.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylm.checkpoint.memory import ExportPlanner, ObjectStoreReader
from raylm.checkpoint.state import (checkpoint_state, export_rank_state, import_rank_state,
                                    load_rank_state, save_rank_state)
from raylm.data.reader import PAD_ID
from raylm.models.dropout import (DropoutSites, SampleDropout, Shards, name_sites,
                                  per_sample_dropout)
from raylm.models.loading import build_model
from raylm.models.materialize import built_whole, reads_tensor_by_tensor
from raylm.models.objectives import objective_for, with_loss
from raylm.models.units import has_own_stages
from raylm.parallel.data import all_reduce_max, all_reduce_sum, all_reduce_sum_async
from raylm.parallel.checkpoint_form import canonical_adapter, init_optimizer_state
from raylm.parallel.mesh import sharded_axes
from raylm.parallel.pipeline.runtime import PipelineRuntime
from raylm.parallel.compile import apply_compile, apply_compile_model
from raylm.parallel.recompute import apply_activation_checkpointing
from raylm.parallel.pipeline.stages import cut
from raylm.parallel.tensor import apply_tensor_parallel
from raylm.parallel.zero import gradient_sync
from raylm.parallel.zero.fsdp import apply_fsdp, materialize, mixed_precision
from raylm.plan.partition import Partition, stage_ranks
from raylm.runtime.precision import autocast_dtype, reduce_dtype
from raylm.runtime.schedule import make_scheduler


class Sums(NamedTuple):
    """A step's forward and backward, from every engine alike."""
    loss: torch.Tensor  # 0-d: the loss summed over dp's label tokens
    tokens: torch.Tensor  # 0-d: the global batch's label tokens
    local_tokens: int  # this rank's


class Prepared(NamedTuple):
    """A step prepared (clipped), not applied."""
    learning_rate: float  # the step will use
    grad_norm: float  # before clipping (on a GPU a 0-d device tensor: raylm.parallel.clip)
    overflow: bool  # fp16: not finite anywhere, so skipped everywhere
    peak_rss_bytes: int  # the process's peak resident memory so far


class EvalSums(NamedTuple):
    """This rank's evaluation sums, not reduced over dp."""
    loss_sum: float
    tokens: int
    correct: Optional[int]  # top-1 hits, where the objective counts them


@dataclass
class Parts:
    """What ``build_engine`` assembles for one rank, in its order; an engine is made from
    them once."""
    objective: Any  # raylm.models.objectives, with the user's loss if any
    model: torch.nn.Module  # this rank's share, its layout applied
    model_input: str  # what the first stage is fed: main_input_name (ids or pixels)
    canonical: Any  # the layout-free checkpoint form's adapter
    grad_sync: Any  # the ZeRO stage's (raylm.parallel.zero.gradient_sync)
    optimizer: Any
    stepper: Any  # what steps the optimizer (ZeRO 1/2: with the all-gather)
    scheduler: Any
    tensor_parallel: Any = None  # TPState when tp > 1
    pipeline: Optional[PipelineRuntime] = None  # when pp > 1
    pipeline_loss: Optional["PipelineLoss"] = None  # the last stage's, the schedule calls
    eval_stage_modules: Any = None  # a traced pipeline's stages for evaluation
    compiled: Optional[str] = None  # what --torch_compile compiled: model or blocks
    loss_fn: Any = None  # the objective's loss compiled (--torch_compile_scope model)
    sample_dropout: bool = False  # per-sample masks (raylm.models.dropout)
    dropout_sites: Any = None  # the modules that call dropout (DropoutSites)
    dropout_shards: Any = None  # a tensor-parallel rank's whole-model row shapes (Shards)


class PipelineLoss:
    """The last stage's loss of a micro-batch as the schedule calls it: summed over its
    label tokens, over the step's global token count (set each step; evaluation sums
    plain token losses), times fp16's loss scale."""

    def __init__(self, objective):
        self.objective, self.global_tokens, self.scale = objective, 1.0, 1.0

    def __call__(self, logits, labels):
        loss = self.objective.loss_sum(logits, labels) / self.global_tokens
        return loss * self.scale if self.scale != 1.0 else loss


class Engine:
    """What ``build_engine`` made for one rank (read its docstring for the order)."""

    def __init__(self, plan, rank: int, mesh, device, spec, cfg: dict, line_by_line: bool,
                 parts: Parts):
        self.plan, self.rank, self.mesh, self.device = plan, rank, mesh, device
        self.spec, self.cfg = spec, cfg
        self.line_by_line = line_by_line  # padded samples: the attention mask matters
        self.dp_group = mesh["dp"].get_group()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.zero_stage = plan.zero_stage
        p = parts
        self.objective, self.model, self.model_input = p.objective, p.model, p.model_input
        self.canonical, self.grad_sync = p.canonical, p.grad_sync
        self.optimizer, self.stepper, self.scheduler = p.optimizer, p.stepper, p.scheduler
        self.tensor_parallel, self.pipeline = p.tensor_parallel, p.pipeline
        self.pipeline_loss, self.eval_stage_modules = p.pipeline_loss, p.eval_stage_modules
        self.compiled, self.loss_fn = p.compiled, p.loss_fn
        self.sample_dropout, self.dropout_sites = p.sample_dropout, p.dropout_sites
        self.dropout_shards = p.dropout_shards
        # The epoch of a step, for objectives that draw per (epoch, sample): the global
        # batch is fixed across layouts, so this is too (the driver's sampler's).
        self.steps_per_epoch = int(cfg.get("steps_per_epoch") or 1)
        self.export_planner = None  # kept between exports
        # Mixed precision (raylm.runtime.precision): autocast's dtype (None: fp32); the
        # step's loss scale (fp16; the driver's) and whether its gradients overflowed.
        self.autocast = autocast_dtype(cfg)
        self.reduce_dtype = reduce_dtype(cfg)  # gradients on the wire (None: fp32)
        self.loss_scale = 1.0
        self.overflow = False
        self.sync_s = 0.0  # the last step's exposed gradient sync (finish_sync)
        self.count_wait_s = 0.0  # the last step's wait for the global token count

    # -- what the loop asks ------------------------------------------------------------------
    # Whether this rank reads samples (a middle pipeline stage does not: its input comes
    # from the previous stage), computes the loss, and sees the step's first stage.
    needs_data = has_loss = has_first = True

    @property
    def speaks_for_replica(self) -> bool:
        """Whether this rank reports its replica's samples: the first stage's first
        tensor-parallel rank (each sample logged once per data-parallel replica)."""
        return self.has_first and self.plan.dims.coords(self.rank)["tp"] == 0

    def pad_rounds(self, items: list, rounds: int, make=lambda ids: ids) -> list:
        """``items`` (micro-batches, or their sample ids) and, where every dp rank must
        run as many micro-batches (FSDP gathers in each forward), filler ones up to
        ``rounds`` for a rank short of samples (an epoch's last step): ``make(ids)`` of
        a row of PAD ids, whose labels are all ignored, so it adds nothing."""
        items = list(items)
        if self.grad_sync.collective_forwards:
            filler = [PAD_ID] * self.plan.micro_batch_size
            items += [make(filler) for _ in range(rounds - len(items))]
        return items

    def forward_backward(self, batches: list, step: int, rounds: int, meter) -> Sums:
        """Forward and backward over the step's micro-batches, gradients summed over dp.
        The loss of a step is the mean over every label token of the global batch, so
        each rank needs the global count before its first backward: it is summed over
        dp in the background while the first forward runs."""
        local_tokens = sum(self.count(b, step) for b in batches)
        self.count_wait_s = 0.0
        global_tokens, count_work = all_reduce_sum_async([local_tokens], self.dp_group,
                                                         self.device)
        sync = self.grad_sync
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.loss_context(), meter:
            for i, b in enumerate(batches):
                mb_loss, _ = self.loss_sum(b, step)
                loss_sum += mb_loss.detach()
                if i == 0 and count_work is not None:
                    self._wait_count(count_work)
                if i == len(batches) - 1:
                    sync.arm(loss_sum)  # buckets reduce as their grads are ready
                scaled = mb_loss / global_tokens[0].to(mb_loss.dtype)
                (scaled * self.loss_scale if self.loss_scale != 1.0 else scaled).backward()
                sync.end_round()
        if not batches:  # no samples for this rank in an epoch's short last step
            if count_work is not None:
                self._wait_count(count_work)
            sync.arm(loss_sum)
        for _ in range(rounds - len(batches)):
            sync.end_round(force=True)  # as many rounds as the other ranks
        global_loss = self.finish_sync()  # gradients (and the loss) summed over dp
        # (0-d tensors: read by the caller once the step's work is launched, so that on
        # a GPU the clip's kernels queue behind backward's with no host sync between.)
        return Sums(global_loss, global_tokens[0], local_tokens)

    def _wait_count(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.count_wait_s = time.perf_counter() - t0

    def finish_sync(self):
        """The gradient sync's end (what backward did not hide of it), timed: sync_s."""
        t0 = time.perf_counter()
        out = self.grad_sync.finish()
        self.sync_s = time.perf_counter() - t0
        return out

    @property
    def counts_correct(self) -> bool:
        """Whether evaluation counts top-1 hits (image classification's accuracy)."""
        return hasattr(self.objective, "correct")

    def evaluate(self, micro_batch_ids: list, read) -> EvalSums:
        """The sums over this rank's eval micro-batches (``read(ids)`` gives a batch)."""
        if self.grad_sync.collective_forwards:  # as many forwards as the other dp ranks
            most = int(all_reduce_max(len(micro_batch_ids), self.dp_group, self.device))
            micro_batch_ids = self.pad_rounds(micro_batch_ids, most)
        self.model.eval()
        loss_sum, tokens, correct = 0.0, 0, 0
        try:
            with torch.no_grad(), self.loss_context():
                for ids in micro_batch_ids:
                    logits, labels = self.forward(read(ids), None)
                    loss_sum += self.objective.loss_sum(logits, labels).item()
                    tokens += self.objective.count(labels)
                    if self.counts_correct:
                        correct += self.objective.correct(logits, labels)
        finally:
            self.grad_sync.release()
        return EvalSums(loss_sum, tokens, correct if self.counts_correct else None)

    def count(self, batch: dict, step) -> int:
        """Label tokens of a micro-batch under the objective."""
        return self.objective.count(self.split(batch, step)["labels"])

    def epoch_of(self, step):
        """The epoch of optimizer step ``step`` (None, evaluating: None)."""
        return None if step is None else step // self.steps_per_epoch

    def split(self, batch: dict, step) -> dict:
        """The objective's model inputs and labels of a micro-batch at ``step``, computed
        once and kept in the batch: a step counts its label tokens before its forward,
        and masked LM's and span corruption's per-sample draws cost milliseconds. The
        worker's prefetch thread calls this for the next step's batches (``prepare``)."""
        epoch = self.epoch_of(step)
        kept = batch.get("objective_parts")
        if kept is None or kept[0] != epoch:
            kept = batch["objective_parts"] = (epoch, self.objective.split(batch, epoch))
        return kept[1]

    def loss_sum(self, batch: dict, step):
        """Forward one micro-batch; its summed token loss and its labels."""
        logits, labels = self.forward(batch, step)
        return (self.loss_fn or self.objective.loss_sum)(logits, labels), labels

    def model_inputs(self, batch: dict, step) -> dict:
        """The whole model's inputs of a micro-batch (on the device), its labels among
        them. Packed blocks have no padding: no mask, so attention takes its causal fast
        path. (Images have no mask at all.)"""
        parts = {k: v.to(self.device) for k, v in self.split(batch, step).items()}
        mask = batch.get("attention_mask")
        if mask is not None and bool((mask == 0).any()):
            parts["attention_mask"] = mask.to(self.device)
        return parts

    def forward(self, batch: dict, step):
        """The logits of one micro-batch, and its labels."""
        parts = self.model_inputs(batch, step)
        labels = parts.pop("labels")
        if step is not None and self.sample_dropout:
            # Dropout masks drawn per sample from (seed, step, sample id, call): the same
            # whatever the layout, so a resized run computes an unchanged run's losses.
            shards = self.dropout_shards and self.dropout_shards.view(parts)
            with SampleDropout(self.cfg["seed"], step, batch["sample_ids"].tolist(),
                               self.dropout_sites, shards):
                logits = self.model(**parts).logits
        else:
            logits = self.model(**parts).logits
        return logits, labels

    def loss_context(self):
        """Forward, loss and backward run inside this: autocast under mixed precision,
        the parallel cross-entropy over vocabulary-sharded logits under tensor
        parallelism."""
        stack = contextlib.ExitStack()
        if self.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
        if self.tensor_parallel is not None:
            stack.enter_context(self.tensor_parallel.loss_context())
        return stack

    def clip(self, max_norm: float) -> float:
        """Clip to ``max_norm`` over the whole model, unscaling fp16's gradients; the
        norm before clipping."""
        pipe = self.pipeline
        if pipe is None:
            return self.grad_sync.clip(self.grad_sync.params, max_norm,
                                       loss_scale=self.loss_scale)
        return self.grad_sync.clip(pipe.norm_params, max_norm, pipe.pp_group,
                                   loss_scale=self.loss_scale)

    def prepare_update(self) -> Prepared:
        """After the gradients are synced: clip (the last collective of a step). Nothing
        the step changes is touched yet; ``apply_update`` commits the step, ``leave_group``
        drops it."""
        # The norm is logged whether or not it clips (--max_grad_norm 0: an infinite
        # bound, which leaves the gradients as they are).
        max_norm = self.cfg["max_grad_norm"]
        grad_norm = self.clip(max_norm if max_norm and max_norm > 0 else math.inf)
        # fp16: an overflow anywhere makes the global norm not finite on every rank.
        self.overflow = self.loss_scale != 1.0 and not math.isfinite(grad_norm)
        # Peak resident memory of this rank's process so far (Linux reports KiB).
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return Prepared(self.optimizer.param_groups[0]["lr"], grad_norm, self.overflow,
                        peak_rss)

    def apply_update(self) -> None:
        """Commit a prepared step: optimizer step, schedule step, zero the gradients.
        (ZeRO 1/2's optimizer step all-gathers the updated rows over dp.) A step whose
        fp16 gradients overflowed skips the optimizer (on every rank alike)."""
        if not self.overflow:
            self.stepper.step()
        self.overflow = False
        self.scheduler.step()
        self.grad_sync.zero_grad()

    # -- a new group around the same state -------------------------------------------------
    @torch.no_grad()
    def broadcast_state(self, src: int) -> None:
        """Every rank of the dp group takes rank ``src``'s parameters and optimizer state
        (a rank that joined a running data-parallel group receives a live replica's state
        over the network, not from disk; its LR schedule is a function of the step:
        ``set_schedule_step``). Collective over the dp group; data parallelism at ZeRO
        stage 0 only (every rank a full replica)."""
        if not self.plan.full_replica_per_rank:
            raise RuntimeError("broadcast_state: data parallelism at ZeRO stage 0 only")
        init_optimizer_state(self.optimizer)  # state tensors to receive into
        group = self.dp_group
        for p in self.model.parameters():
            dist.broadcast(p.data, group_src=src, group=group)
        for group_params in self.optimizer.param_groups:
            for p in group_params["params"]:
                for _, v in sorted(self.optimizer.state[p].items()):
                    if isinstance(v, torch.Tensor):
                        # (torch's AdamW loop keeps its step count on the CPU, which NCCL
                        # cannot send: through the rank's device)
                        buf = v if v.device == self.device else v.to(self.device)
                        dist.broadcast(buf, group_src=src, group=group)
                        if buf is not v:
                            v.copy_(buf)

    def leave_group(self) -> None:
        """Drop the step under way and every reference this engine holds to the process
        groups (RankWorker.leave_group); ``regroup`` gives it new ones."""
        if self.grad_sync is not None:
            self.grad_sync.reset()
            self.grad_sync.close()
            self.grad_sync.group = None
        self.mesh = self.dp_group = None

    def regroup(self, plan, rank: int, mesh) -> None:
        """Carry on under ``plan`` (the same model-parallel shape, another dp) as
        ``rank`` of a new process group: the model and the optimizer state stay as they
        are; the gradient sync is rebuilt over the new dp group."""
        if not (self.plan.full_replica_per_rank and plan.full_replica_per_rank):
            raise RuntimeError("regroup in memory: data parallelism at ZeRO stage 0 only")
        self.plan, self.rank, self.mesh = plan, rank, mesh
        self.dp_group = mesh["dp"].get_group()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.grad_sync = gradient_sync(0, self.model, self.dp_group, self.reduce_dtype)

    def set_schedule_step(self, step: int) -> None:
        # The LR schedule is a function of the step: move it there without stepping.
        self.scheduler.last_epoch = step
        lrs = [base * lam(step) for base, lam in
               zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs

    def replica_elements(self, trained: bool = False) -> int:
        """Parameters this rank's data-parallel replica holds of what this rank holds
        (its stage, its tensor-parallel shard; before any ZeRO partition): the Psi of the
        ZeRO formulas for this rank. ``trained``: only those that train (not a LoRA
        run's frozen base)."""
        total, seen = 0, set()
        for p in self.model.parameters():
            if id(p) not in seen and (p.requires_grad or not trained):
                seen.add(id(p))
                total += p.numel() // sharded_axes(p).get("tp", 1)
        return total

    # -- state ---------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        save_rank_state(path, self.model, self.optimizer, self.rank, self.canonical,
                        zero=self._zero_form())

    def load(self, path: str, step: int, seed_rank: int) -> None:
        load_rank_state(path, self.model, self.optimizer, self.rank, self.canonical,
                        fallback_seed=self.cfg["seed"] + 1 + seed_rank + 7919 * step,
                        zero=self._zero_form())
        self.set_schedule_step(step)

    def checkpoint_state(self) -> dict:
        """This rank's state in checkpoint form (raylm.checkpoint.state), views of the
        live tensors where the form is the runtime's own; what a snapshot copies."""
        return checkpoint_state(self.model, self.optimizer, self.canonical,
                                zero=self._zero_form())

    def snapshot_state(self) -> dict:
        """``checkpoint_state`` less what another data-parallel rank of the same
        snapshot writes: each key the dp replicas hold alike (every key at ZeRO-0, the
        model's at ZeRO-1 and 2) is kept by one of them, spread by key, as DCP's own
        collective save deduplicates replicas. A snapshot is used only whole (every
        rank's of one step), so every key is in it once."""
        state = self.checkpoint_state()
        shared = {0: ("model", "optim"), 1: ("model",), 2: ("model",)}.get(self.zero_stage, ())
        dp = self.plan.dp
        for part in shared if dp > 1 else ():
            state[part] = {k: state[part][k] for i, k in enumerate(sorted(state[part]))
                           if i % dp == self.dp_rank}
        return state

    def export_state(self):
        """This rank's state in Ray's object store, in checkpoint form, written alone (no
        collective): DCP metadata whose storage data are ObjectRefs
        (raylm.checkpoint.memory). Before ``leave_group``: the form needs the mesh."""
        if self.export_planner is None:
            self.export_planner = ExportPlanner()
        return export_rank_state(self.checkpoint_state(), self.export_planner)

    def import_state(self, state, node_id: str, seed_rank: int) -> dict:
        """Collective over the world: take this layout's shards of a run's state in
        memory (``state``: raylm.checkpoint.memory.MemoryState, written by the ranks of
        another layout), each chunk from a holder on this node when there is one; the LR
        schedule at its step. Returns how many chunks were read locally and remotely."""
        reader = ObjectStoreReader(state, node_id, spread=self.rank)
        import_rank_state(reader, self.model, self.optimizer, self.canonical,
                          zero=self._zero_form())
        self.set_schedule_step(state.step)
        torch.manual_seed(self.cfg["seed"] + 1 + seed_rank + 7919 * state.step)
        return reader.fetched

    def _zero_form(self):
        """ZeRO 1/2: the partitioned optimizer's state in checkpoint form; else None."""
        return self.grad_sync.checkpoint_form(self.model, self.mesh["dp"])

    def hf_model(self):
        """The whole model as one ordinary Hugging Face model on rank 0 (None elsewhere).

        Without tensor or pipeline parallelism (or ZeRO-3) every rank holds the whole
        model. Otherwise the first data-parallel replica assembles it: each tensor-parallel
        group gathers its shards into full tensors in the model's own shapes (original
        vocabulary, Hugging Face orientation), the pipeline stages send theirs to rank 0
        over the pp group, and rank 0 loads them into a fresh model (it needs the whole
        model's memory for that moment). Collective over the ranks that hold shards."""
        if self.pipeline is None and self.tensor_parallel is None and self.zero_stage != 3:
            return self.model
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


class PipelineEngine(Engine):
    """The engine of a pipeline stage rank: the schedule runs forward and backward over
    the step's micro-batches (the first stage fed input ids, the last labels)."""

    def pad_rounds(self, items: list, rounds: int, make=None) -> list:
        return list(items)  # the driver fills a pipeline's steps and evaluations up itself

    # (a middle stage reads its micro-batches for their sample ids alone: its masks')
    needs_data = property(lambda self: self.pipeline.needs_data or self.line_by_line
                          or self.sample_dropout)
    has_loss = property(lambda self: self.pipeline.has_last)
    has_first = property(lambda self: self.pipeline.has_first)

    def forward_backward(self, batches: list, step: int, rounds: int, meter) -> Sums:
        """As Engine.forward_backward; then the gradients of weights several stages hold
        (tied embeddings) are summed between them. The global token count is needed
        before the schedule runs (the last stage divides each micro-batch's loss by it)."""
        pipe, sync = self.pipeline, self.grad_sync
        local_tokens = sum(self.count(b, step) for b in batches) if pipe.has_last else 0
        t0 = time.perf_counter()
        global_tokens = all_reduce_sum([local_tokens], self.dp_group, self.device)[0]
        self.count_wait_s = time.perf_counter() - t0
        loss = self.pipeline_loss
        loss.global_tokens, loss.scale = float(global_tokens) or 1.0, self.loss_scale
        ids, labels, kwargs = self.stack(batches, step)
        pipe.train(True)
        shards = None
        if self.dropout_shards is not None and batches:  # (the whole model's inputs)
            shards = self.dropout_shards.view(self.model_inputs(batches[0], step))
        with self.loss_context(), meter:
            losses = pipe.run(ids, labels, kwargs, step, shards)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb_loss in losses:  # (each the scaled loss of PipelineLoss)
            loss_sum += mb_loss.detach().double() * (loss.global_tokens / self.loss_scale)
        sync.arm(loss_sum)
        global_loss = self.finish_sync()  # dp sum (each stage over its own dp group)
        pipe.sync_tied_grads(sync.grad_of)  # (ZeRO 1/2: the rows this rank owns)
        return Sums(global_loss, torch.tensor(global_tokens, dtype=torch.float64),
                    local_tokens)

    def evaluate(self, micro_batch_ids: list, read) -> EvalSums:
        """``micro_batch_ids``: chunks of one step's shape (the schedule's micro-batch
        count and size), filled up with padding ids."""
        pipe = self.pipeline
        loss_sum, tokens, correct = 0.0, 0, 0

        def scored(logits, labels):  # (the last stage's loss, and its top-1 hits)
            nonlocal correct
            if self.counts_correct:
                correct += self.objective.correct(logits, labels)
            return self.objective.loss_sum(logits, labels)

        try:
            with torch.no_grad(), self.loss_context():
                pipe.train(False)
                for chunk in micro_batch_ids:
                    batches = [read(ids) for ids in chunk] if self.needs_data else []
                    ids, labels, kwargs = self.stack(batches, None)
                    losses = pipe.forward_only(ids, labels, kwargs, scored,
                                               self.eval_stage_modules)
                    loss_sum += sum(float(x) for x in losses)
                    if pipe.has_last:
                        tokens += sum(self.count(b, None) for b in batches)
        finally:
            self.grad_sync.release()
        return EvalSums(loss_sum, tokens, correct if self.counts_correct else None)

    def stack(self, batches: list, step):
        """The step's rows as the schedule takes them: all micro-batches stacked (it
        splits them again). Each stage gets only what it uses; the attention mask only
        when the data has padding (line by line), and then every stage needs it."""
        pipe = self.pipeline
        parts = [self.split(b, step) for b in batches]

        def stacked(key):
            return torch.cat([p[key] for p in parts]).to(self.device)

        ids = stacked(self.model_input) if pipe.has_first else None
        labels = stacked("labels") if pipe.has_last else None
        kwargs = {}
        if pipe.needs_decoder_inputs:  # the stage that embeds the decoder's input (T5)
            kwargs["decoder_input_ids"] = stacked("decoder_input_ids")
        if self.line_by_line:
            kwargs["attention_mask"] = torch.cat(
                [b["attention_mask"] for b in batches]).to(self.device)
        if self.sample_dropout and step is not None:  # (each micro-batch's ids: the masks')
            kwargs["sample_ids"] = torch.cat([b["sample_ids"] for b in batches])
        return ids, labels, kwargs


def builds_on_meta(plan, spec) -> bool:
    """Whether a rank of ``plan`` starts from the model's meta-device skeleton rather than
    the whole model (step 0 of ``build_engine``): under ZeRO-3, unless pretrained weights
    cannot be read a tensor at a time (``reads_tensor_by_tensor``: transformers'
    from_pretrained loads those, whole, and FSDP shards the loaded model); else where the
    layout splits the model (tensor parallelism, a pipeline cut by raylm's own stages)
    and the skeleton saves memory: not a model that raylm.models.materialize builds whole
    anyway (a model of your own, an image classifier), nor such pretrained weights."""
    if plan.zero_stage == 3:
        # (pretrained weights it cannot read a tensor at a time: loaded whole, as
        # transformers' from_pretrained loads them, then sharded by FSDP)
        return getattr(spec, "new_head", False) or reads_tensor_by_tensor(spec)
    traced = plan.pp > 1 and not has_own_stages(spec.config)
    return ((plan.pp > 1 or plan.tp > 1) and not traced and not built_whole(spec)
            and reads_tensor_by_tensor(spec))


def initial_model(spec, seed: int, on_meta: bool):
    """The model an engine starts from, the same on every rank (``seed``), on the CPU:
    ``on_meta`` (``builds_on_meta``) its skeleton on the meta device, since no rank ever
    holds all of it (the weights are materialised shard by shard once the layout is
    applied: step 6 of ``build_engine``); else the whole model. A rank that will join a
    running group builds it while it warms up (RankWorker.warm_up), off the live ranks'
    pause."""
    if on_meta:
        return build_model(spec, seed, device="meta")
    return build_model(spec, seed)


def build_engine(plan, rank: int, mesh, device, spec, cfg: dict, total_steps: int,
                 line_by_line: bool = False, warm=(None, None)) -> Engine:
    """The rank's engine for ``plan``: its parts assembled in the module docstring's
    order, then the engine made from them. ``warm`` = (on_meta, model) when the model
    was built earlier by ``initial_model`` (a newcomer's warm-up; taken when its
    ``on_meta`` is this plan's ``builds_on_meta``: the plan may have changed since)."""
    objective = with_loss(objective_for(spec.config, spec.objective or cfg.get("objective"),
                                        spec.masking), spec.loss_fn)
    # 0. the whole model, or its skeleton
    on_meta = builds_on_meta(plan, spec)
    warm_meta, model = warm
    if model is None or warm_meta != on_meta:
        model = initial_model(spec, cfg["seed"], on_meta)
    model = model if on_meta else model.to(device)
    parts = dict(objective=objective, model=model,
                 model_input=getattr(model, "main_input_name", None) or "input_ids")
    # Dropout per sample, keyed by the whole model's module names (so that a pipeline
    # stage, raylm's own or an exported graph, draws the whole model's masks) and by
    # each element's place in the whole tensor (so that a tensor-parallel rank draws its
    # slice). A compiled forward breaks its graph at each dropout (SampleDropout._handle).
    traced = plan.pp > 1 and not has_own_stages(spec.config)
    attention_too = cfg.get("per_sample_attention_dropout", True)
    sample = per_sample_dropout(model, attention_too)
    if sample:
        name_sites(model)
    if sample and plan.tp > 1:  # (the whole model's skeleton: its row shapes)
        whole = initial_model(spec, cfg["seed"], True).train()
        per_sample_dropout(whole, attention_too)
        name_sites(whole)
        parts["dropout_shards"] = Shards(whole, mesh["tp"].get_local_rank(), plan.tp)
    # (intercepted inside the modules that call dropout, once a forward found them;
    # a pipeline's sites are per stage module: PipelineRuntime)
    parts.update(sample_dropout=sample,
                 dropout_sites=DropoutSites() if sample and plan.pp == 1 else None)
    # 1. tensor parallelism (of a model cut by the generic export split: after the cut,
    #    4., since torch.export traces the model whole)
    tp = None
    if plan.tp > 1 and not traced:
        tp = apply_tensor_parallel(model, mesh["tp"], plan.sequence_parallel)
    # 2. compile the whole forward and the loss, or each block's forward (of its
    #    DTensor parameters under tp)
    if cfg.get("torch_compile"):
        how = (cfg.get("torch_compile_backend"), cfg.get("torch_compile_mode"))
        parts["compiled"] = cfg.get("torch_compile_scope") or "blocks"  # (layout.py)
        if parts["compiled"] == "model":
            parts["loss_fn"] = apply_compile_model(model, objective.loss_sum, *how)
        else:
            apply_compile(model, *how)
    # 3. activation checkpointing (around the compiled forward)
    apply_activation_checkpointing(model, plan.recompute)
    fill = _Weights(plan, mesh, device, spec, cfg)
    # 4. the pipeline cut (5. ZeRO-3 on its stage roots and 6. the weights, before the
    #    runtime takes references to the parameters)
    if plan.pp > 1:
        loss = PipelineLoss(objective)
        pipe, eval_modules, tp = _pipeline(model, plan, rank, mesh, device, spec,
                                           parts["model_input"], tp, loss, fill, on_meta)
        if parts.get("sample_dropout"):
            pipe.sample_dropout(cfg["seed"])
        parts.update(pipeline=pipe, eval_stage_modules=eval_modules, pipeline_loss=loss)
    # 5. ZeRO-3 without a pipeline: the model is the root
    elif plan.zero_stage == 3:
        fill.shard(model, [model], tp)
    # 6. the weights of a skeleton (ZeRO-3's: in fill.shard)
    elif on_meta:
        fill.materialize(model, tp)
    # Checkpoints and the saved model in the model's own (layout-free) shapes.
    canonical = canonical_adapter(model, tp)
    reduce = reduce_dtype(cfg)
    sync = gradient_sync(plan.zero_stage, model, mesh["dp"].get_group(),
                         None if plan.zero_stage == 3 else reduce,
                         keep_gathered=not plan.reshard_after_forward,
                         overlap=plan.pp == 1 and not plan.cpu_offload and reduce is None,
                         gloo=device.type == "cpu")
    groups, hyper = _adamw(model, cfg)
    optimizer, stepper = sync.make_optimizer(groups, **hyper)
    kind = PipelineEngine if plan.pp > 1 else Engine
    return kind(plan, rank, mesh, device, spec, cfg, line_by_line, Parts(
        **parts, canonical=canonical, grad_sync=sync, optimizer=optimizer, stepper=stepper,
        scheduler=make_scheduler(optimizer, cfg, total_steps), tensor_parallel=tp))


def _adamw(model, cfg: dict) -> tuple:
    """AdamW's parameter groups and settings: decay matrices only, not biases or norm
    weights (as HF's Trainer does)."""
    # One group per (decay, kind of tensor): the fused and foreach kernels take a group's
    # tensors in one call, which cannot mix DTensors with plain tensors (tensor
    # parallelism leaves some parameters plain) or DTensors of different meshes.
    groups: dict = {}
    for p in model.parameters():
        if p.requires_grad:
            decay = p.ndim >= 2  # matrices; not biases or norm weights
            kind = (decay, id(p.device_mesh) if isinstance(p, DTensor) else None)
            groups.setdefault(kind, {"params": [], "weight_decay": cfg["weight_decay"]
                                     if decay else 0.0})["params"].append(p)
    # (Groups are never empty: torch.distributed.checkpoint cannot name an empty one, and
    # a LoRA run's trained parameters are all matrices.)
    groups = list(groups.values())
    hyper = dict(lr=cfg["learning_rate"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]),
                 eps=cfg["adam_epsilon"], fused=cfg["optim"] == "adamw_torch_fused")
    return groups, hyper


def _pipeline(model, plan, rank: int, mesh, device, spec, model_input: str, tp, loss,
              fill: "_Weights", on_meta: bool) -> tuple:
    """Cut the model to this rank's stages (of its skeleton when ``on_meta``: its weights
    then filled for those stages only); tied-weight groups on every rank, in one order
    (new_group is collective over the world). Returns (the runtime, the evaluation's
    stage modules, the tensor-parallel state: a traced model's is applied here)."""
    part = Partition(bounds=[tuple(b) for b in plan.stage_bounds],
                     stage_rank=stage_ranks(plan.schedule, plan.pp, plan.virtual))
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids = part.stages_of(pp_rank)
    # (on the model's device: torch.export traces the stages there)
    where = next(model.parameters()).device
    where = where if where.type != "meta" else "cpu"
    if model_input == "pixel_values":  # an image model: a micro-batch of its images
        from raylm.models.vision import channels, image_size

        size = image_size(spec.config)
        example = torch.zeros(plan.micro_batch_size, channels(spec.config), size, size,
                              device=where)
    else:
        example = torch.zeros(plan.micro_batch_size, plan.seq_len, dtype=torch.long,
                              device=where)
    modules, holders, eval_modules = cut(model, part, stage_ids, example)
    if plan.tp > 1 and tp is None:  # traced stage graphs (step 1)
        graphs = [m.stage for m in list(modules) + list(eval_modules or [])]
        tp = apply_tensor_parallel(model, mesh["tp"], graphs=graphs)
    if plan.zero_stage == 3:
        fill.shard(model, list(modules), tp)
    elif on_meta:
        fill.materialize(model, tp)
    dims, me = plan.dims, plan.dims.coords(rank)
    tied_groups = {}
    for ranks in sorted({tuple(r) for r in holders.values() if len(r) > 1}):
        for d in range(plan.dp):
            for t in range(plan.tp):
                group = dist.new_group([dims.rank(dp=d, pp=r, tp=t) for r in ranks])
                if (d, t) == (me["dp"], me["tp"]):
                    tied_groups[ranks] = group
    runtime = PipelineRuntime(model, modules, stage_ids, part, holders, plan.schedule,
                              plan.micro_batches_per_rank, loss, mesh["pp"].get_group(),
                              pp_rank, device, tied_groups)
    return runtime, eval_modules, tp


class _Weights:
    """Steps 5 and 6: ZeRO-3's sharding and a skeleton's weights, each rank filling only
    its own shards and stages."""

    def __init__(self, plan, mesh, device, spec, cfg: dict):
        self.plan, self.mesh, self.device, self.spec, self.cfg = plan, mesh, device, spec, cfg

    def shard(self, model, roots: list, tp) -> None:
        """ZeRO-3: FSDP2 over the dp group (each rank keeps 1/dp of every tensor)."""
        plan = self.plan
        # The tensor-parallel placement of each parameter, before FSDP adds the dp dim.
        tp_layout = _tp_layout(model)
        apply_fsdp(model, roots, self.mesh["dp"], plan.cpu_offload,
                   mixed_precision(autocast_dtype(self.cfg), self.cfg.get("reduce_dtype")),
                   reshard_after_forward=plan.reshard_after_forward,
                   prefetch=self.device.type == "cpu" and plan.pp == 1)
        self.materialize(model, tp, tp_layout)

    def materialize(self, model, tp, tp_layout: Optional[dict] = None) -> None:
        """A skeleton's weights (nothing to do for a model built whole), before anything
        takes references to the parameters (materialising makes new ones): each rank
        fills its shards of the tensors its stages hold, one tensor of the model at a
        time."""
        if any((p.to_local() if isinstance(p, DTensor) else p).is_meta
               for p in model.parameters()):
            materialize(model, self.spec, self.cfg["seed"], self.device,
                        _tp_layout(model) if tp_layout is None else tp_layout,
                        canonical_adapter(model, tp))


def _tp_layout(model) -> dict:
    """Each tensor-parallel parameter's (mesh, placements, global shape)."""
    return {n: (p.device_mesh, p.placements, p.shape)
            for n, p in model.named_parameters(remove_duplicate=False)
            if isinstance(p, DTensor)}
