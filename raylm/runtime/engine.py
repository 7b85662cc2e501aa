"""A rank's engine: its share of the model and of the training state, built by one factory.

``build_engine`` applies the model transforms in one order (as torchtitan's
``parallelize_*`` does), each a step of its own below:

1. tensor parallelism: the whole model's layers (every rank built the same weights, each
   keeps its shard; raylm.parallel.tensor);
2. activation checkpointing: a slot, not built yet;
3. the pipeline cut: this rank's stages of the sharded model (raylm.parallel.pipeline);
4. ZeRO-3: FSDP2 over the dp group on the model or the stage roots, then meta-device
   weights materialised shard by shard (raylm.parallel.zero.fsdp);
5. compile: a slot, not built yet;

then the gradient sync of the ZeRO stage (raylm.parallel.zero.gradient_sync: one
interface for all of them), AdamW through it, and the LR schedule.

The engine answers what the rank's loop needs from the layout: the loss context, the
global gradient norm and update, the checkpoint state, the Hugging Face model to save.
It is built after the process group and the mesh exist (RankWorker.join), and from the
plan, the model spec and the settings only.
"""

from __future__ import annotations

import contextlib
import resource
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from raylm.checkpoint.state import load_rank_state, save_rank_state
from raylm.models.loading import build_model
from raylm.models.objectives import objective_for
from raylm.parallel.mesh import sharded_axes
from raylm.parallel.pipeline.runtime import PipelineRuntime
from raylm.parallel.pipeline.stages import cut
from raylm.parallel.tensor import apply_tensor_parallel, canonical_adapter
from raylm.parallel.zero import gradient_sync
from raylm.parallel.zero.fsdp import apply_fsdp, materialize
from raylm.plan.partition import Partition, stage_ranks


class Engine:
    """What ``build_engine`` made for one rank (read its docstring for the order)."""

    def __init__(self, plan, rank: int, mesh, device, spec, cfg: dict):
        self.plan, self.rank, self.mesh, self.device = plan, rank, mesh, device
        self.spec, self.cfg = spec, cfg
        self.dp_group = mesh["dp"].get_group()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.zero_stage = plan.zero_stage
        self.objective = objective_for(spec.config, cfg.get("objective"))
        self.model = None
        self.tensor_parallel = None  # TPState when tp > 1
        self.pipeline: Optional[PipelineRuntime] = None  # when pp > 1
        self.eval_stage_modules = None
        self.canonical = None  # the layout-free checkpoint form
        self.grad_sync = None
        self.optimizer = self.stepper = self.scheduler = None
        # Under a pipeline the last stage's loss is divided by the step's global token
        # count (1 when evaluating, which wants sums).
        self.global_tokens = 1.0

    # -- what the loop asks ------------------------------------------------------------------
    def loss_context(self):
        """Forward, loss and backward run inside this: the parallel cross-entropy over
        vocabulary-sharded logits under tensor parallelism."""
        if self.tensor_parallel is None:
            return contextlib.nullcontext()
        return self.tensor_parallel.loss_context()

    def pipeline_loss(self, logits, labels):
        return self.objective.loss_sum(logits, labels) / self.global_tokens

    def clip(self, max_norm: float) -> float:
        """Clip to ``max_norm`` over the whole model; the norm before clipping."""
        pipe = self.pipeline
        if pipe is None:
            return self.grad_sync.clip(self.grad_sync.params, max_norm)
        return self.grad_sync.clip(pipe.norm_params, max_norm, pipe.pp_group)

    def update(self) -> dict:
        """After the gradients are synced: clip, optimizer step, schedule step, zero the
        gradients. Returns the learning rate used, the norm before clipping and the
        process's peak resident memory."""
        grad_norm = None
        if self.cfg["max_grad_norm"] and self.cfg["max_grad_norm"] > 0:
            grad_norm = self.clip(self.cfg["max_grad_norm"])
        lr = self.optimizer.param_groups[0]["lr"]
        self.stepper.step()
        self.scheduler.step()
        self.grad_sync.zero_grad()
        # Peak resident memory of this rank's process so far (Linux reports KiB).
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"learning_rate": lr, "grad_norm": grad_norm, "peak_rss_bytes": peak_rss}

    def set_schedule_step(self, step: int) -> None:
        # The LR schedule is a function of the step: move it there without stepping.
        self.scheduler.last_epoch = step
        lrs = [base * lam(step) for base, lam in
               zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs

    def replica_elements(self) -> int:
        """Parameters this rank's data-parallel replica holds of what this rank holds
        (its stage, its tensor-parallel shard; before any ZeRO partition): the Psi of the
        ZeRO formulas for this rank."""
        total, seen = 0, set()
        for p in self.model.parameters():
            if id(p) not in seen:
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


def build_engine(plan, rank: int, mesh, device, spec, cfg: dict, total_steps: int) -> Engine:
    """The rank's engine for ``plan`` (see the module docstring for the order)."""
    e = Engine(plan, rank, mesh, device, spec, cfg)
    # ZeRO-3 builds the model on the meta device: no rank ever holds all of it; the
    # weights are materialised shard by shard once the layout is applied (step 4).
    if e.zero_stage == 3:
        e.model = build_model(spec, cfg["seed"], device="meta")
    else:
        e.model = build_model(spec, cfg["seed"]).to(device)
    # 1. tensor parallelism
    if plan.tp > 1:
        e.tensor_parallel = apply_tensor_parallel(e.model, mesh["tp"], plan.sequence_parallel)
    # 2. activation checkpointing: not built yet
    # 3. the pipeline cut (4. ZeRO-3 on its stage roots, before the runtime takes
    #    references to the parameters)
    if plan.pp > 1:
        e.pipeline = _pipeline(e)
    # 4. ZeRO-3 without a pipeline: the model is the root
    elif e.zero_stage == 3:
        _shard(e, [e.model])
    # 5. compile: not built yet
    # Checkpoints and the saved model in the model's own (layout-free) shapes.
    e.canonical = canonical_adapter(e.model, e.tensor_parallel)
    e.grad_sync = gradient_sync(e.zero_stage, e.model, e.dp_group)
    groups, hyper = _adamw(e.model, cfg)
    e.optimizer, e.stepper = e.grad_sync.make_optimizer(groups, **hyper)
    e.scheduler = get_scheduler(cfg["lr_scheduler_type"], e.optimizer,
                                num_warmup_steps=cfg["warmup_steps"],
                                num_training_steps=max(1, total_steps))
    return e


def _adamw(model, cfg: dict) -> tuple:
    """AdamW's parameter groups and settings: decay matrices only, not biases or norm
    weights (as HF's Trainer does)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    hyper = dict(lr=cfg["learning_rate"], betas=(cfg["adam_beta1"], cfg["adam_beta2"]),
                 eps=cfg["adam_epsilon"])
    return groups, hyper


def _pipeline(e: Engine) -> PipelineRuntime:
    """Cut the model to this rank's stages; tied-weight groups on every rank, in one
    order (new_group is collective over the world)."""
    plan = e.plan
    part = Partition(bounds=[tuple(b) for b in plan.stage_bounds],
                     stage_rank=stage_ranks(plan.schedule, plan.pp, plan.virtual))
    pp_rank = e.mesh["pp"].get_local_rank()
    stage_ids = part.stages_of(pp_rank)
    example = torch.zeros(plan.micro_batch_size, plan.seq_len, dtype=torch.long)
    modules, holders, e.eval_stage_modules = cut(e.model, part, stage_ids, example)
    if e.zero_stage == 3:
        _shard(e, list(modules))
    dims, me = plan.dims, plan.dims.coords(e.rank)
    tied_groups = {}
    for ranks in sorted({tuple(r) for r in holders.values() if len(r) > 1}):
        for d in range(plan.dp):
            for t in range(plan.tp):
                group = dist.new_group([dims.rank(dp=d, pp=r, tp=t) for r in ranks])
                if (d, t) == (me["dp"], me["tp"]):
                    tied_groups[ranks] = group
    return PipelineRuntime(e.model, modules, stage_ids, part, holders, plan.schedule,
                           plan.micro_batches_per_rank, e.pipeline_loss,
                           e.mesh["pp"].get_group(), pp_rank, e.device, tied_groups)


def _shard(e: Engine, roots: list) -> None:
    """ZeRO-3: FSDP2 over the dp group (each rank keeps 1/dp of every tensor)."""
    # The tensor-parallel placement of each parameter, before FSDP adds the dp dim.
    tp_layout = {n: (p.device_mesh, p.placements, p.shape)
                 for n, p in e.model.named_parameters(remove_duplicate=False)
                 if isinstance(p, DTensor)}
    apply_fsdp(e.model, roots, e.mesh["dp"], e.plan.cpu_offload)
    if any((p.to_local() if isinstance(p, DTensor) else p).is_meta
           for p in e.model.parameters()):
        # Before anything takes references to the parameters (materialising makes new
        # ones): each rank fills its shards, one tensor of the model at a time.
        materialize(e.model, e.spec, e.cfg["seed"], e.device, tp_layout,
                    canonical_adapter(e.model, e.tensor_parallel))
