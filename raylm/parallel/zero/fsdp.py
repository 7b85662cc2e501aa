"""ZeRO stage 3: parameters, gradients and optimizer states sharded over the dp group,
with torch's FSDP2 (``fully_shard``).

Each transformer block is one FSDP unit (its parameters all-gathered just before its
forward and again for its backward, freed after each), and what is left (embeddings,
final norm, head) is one unit on the module whose forward runs: the model, or under a
pipeline each of the rank's stage modules. Gradients are reduce-scattered summed, not
averaged: raylm's loss is already divided by the step's global token count.

``--reshard_after_forward False`` (FSDP2's option): a unit keeps its gathered parameters
after its forward, and, without a pipeline, ``FSDPGradients`` keeps them after every
backward but the step's last, and accumulates the gradients unsharded until then
(FSDP2's ``set_requires_gradient_sync``): one all-gather and one reduce-scatter per unit
and step, instead of two all-gathers and a reduce-scatter per micro-batch, holding every
gathered parameter and its unsharded gradient through the step. Torch's pipeline
schedules do the same between their micro-batches themselves. Measured at dp=2 with 4
micro-batches (benchmarks/bench_zero.py): 0.54 of stage 0's speed resharding, 0.75
keeping the parameters only, 0.87 keeping both.
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.models.units import transformer_blocks
from raylm.parallel.data import GradientSync, reduce_scatter_sum
from raylm.parallel.checkpoint_form import contiguous_stride, write_rows_back


def mixed_precision(compute_dtype, reduce_dtype: str = "float32"):
    """FSDP2's MixedPrecisionPolicy for autocast's ``compute_dtype`` (None: fp32, no
    policy): parameters all-gathered in the compute dtype (half the bytes; autocast
    would cast them to it anyway), gradients reduce-scattered in ``reduce_dtype``, the
    sharded master weights and their gradients fp32."""
    if compute_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.bfloat16 if reduce_dtype == "bfloat16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce,
                                output_dtype=None, cast_forward_inputs=False)


def apply_fsdp(model: nn.Module, roots: list, dp_mesh, cpu_offload: bool = False,
               mp_policy=None, reshard_after_forward: bool = True,
               prefetch: bool = False) -> list:
    """Shard ``model`` over ``dp_mesh`` (a 1-D DeviceMesh): each block of ``model`` found
    under ``roots`` (the modules whose forward runs), then each root, with FSDP2's
    ``mp_policy`` (``mixed_precision``) when given and its ``reshard_after_forward``
    (given explicitly, FSDP2 applies it to a root too). ``prefetch`` (CPU ranks, one
    root): each unit's all-gather runs ahead, behind the compute of the unit before it.
    Returns the FSDP modules, roots last."""
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                        OffloadPolicy, fully_shard)

    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    mp = mp_policy or MixedPrecisionPolicy()
    # Which module slots share a parameter (a tied embedding and head): fully_shard
    # replaces the parameter in the slots of the modules it wraps only, and under a
    # pipeline the stage module holds one of the two (the last stage's head).
    slots: dict = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name, p))
    inside = {id(m) for r in roots for m in r.modules()}
    units = [b for b in transformer_blocks(model) if id(b) in inside]
    for block in units:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload, mp_policy=mp)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload, mp_policy=mp)
    for group in slots.values():
        # Point every slot of a shared parameter at the one FSDP now manages (stale
        # slots would hold a second, unsharded, never-trained copy).
        new = {id(m._parameters[n]): m._parameters[n] for m, n, p in group
               if m._parameters[n] is not p}
        if len(new) == 1:
            for m, n, _ in group:
                m._parameters[n] = next(iter(new.values()))
    modules = units + list(roots)
    if prefetch and len(roots) == 1 and units:
        # Each unit's all-gather started, without waiting, when the unit before it (the
        # root: the embeddings) starts its forward, and waited for at its own: on a CPU,
        # where FSDP2 has no stream to run it on, it then runs in gloo's threads during
        # the compute before it instead of blocking its forward (and, resharding, so
        # does FSDP2's own prefetch of the next unit in backward). Two units are
        # gathered at a time, as the planner counts for resharding. (FSDP2's switch for
        # async all-gathers is private in torch 2.13: _set_unshard_async_op.) Measured
        # at dp=4 with and without in the same rounds: 1.01-1.03x kept gathered,
        # 1.04-1.08x resharding (README, ZeRO stages).
        for m in modules:
            m._set_unshard_async_op(True)
        roots[0].set_modules_to_forward_prefetch([units[0]])
        for a, b in zip(units, units[1:]):
            a.set_modules_to_forward_prefetch([b])
    for m in modules:
        m.set_gradient_divide_factor(1.0)  # summed: the loss is per global token already
        # Plain SUM collectives (a custom factor otherwise means NCCL's PREMUL_SUM, which
        # gloo lacks; the factor is 1 anyway).
        m.set_force_sum_reduction_for_comms(True)
    return modules


class GlooReduceScatter:
    """FSDP2's reduce-scatter of a unit's gradients over gloo (``set_custom_reduce_scatter``):
    raylm's ``reduce_scatter_sum`` (an all-to-all and a local sum; why, there), optionally
    left running while backward goes on.

    ``defer`` (``FSDPGradients``, where it is right): the sum waits for ``wait``, so the
    all-to-all runs in gloo's threads while backward computes the next unit (on a GPU
    FSDP2 overlaps its reduce-scatters on a stream of their own; a CPU has no streams
    and each unit's reduce-scatter would block backward). Right only while FSDP2 reads
    nothing of the output before ``wait``: each sharded gradient None (FSDP2 then views
    the output rather than adding it into a gradient), the reduce dtype the gradients'
    own (no cast of the output), nothing offloaded. The works keep their tensors."""

    def __init__(self):
        self.pending: list = []
        self.defer = False
        self.reduced = False  # since the last wait

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        import torch.distributed as dist

        if op != dist.ReduceOp.SUM:  # (raylm's units sum: set_force_sum_reduction_for_comms)
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op,
                                              group=group, async_op=async_op)
        work = reduce_scatter_sum(output_tensor, input_tensor, group)
        self.reduced = True
        if work is not None:
            # (the input kept until the sum: FSDP2 drops it at the next unit's reduce)
            self.pending.append((work, input_tensor))
        if not self.defer:
            self.wait()
        return None

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class FSDPGradients(GradientSync):
    """The gradient sync under stage 3: FSDP reduce-scatters during backward itself; this
    sums the step's loss over dp and zeroes the (sharded) gradients in place (so they
    stay allocated, as the ZeRO accounting has them). ``keep_gathered`` (the model an
    FSDP root, its blocks sharded with reshard_after_forward False): the gathered
    parameters stay through the step's micro-batches and their gradients accumulate
    unsharded, both reduce-scattered and freed at its last backward.

    On CPU ranks (gloo) each reduce-scatter is an all-to-all and a sum
    (``GlooReduceScatter``). ``overlap`` (without a pipeline, gradients reduced in
    fp32, no offload): the step's first reduce-scatter of each unit runs in the
    background, summed after the micro-batch's backward; the gradients are then dropped
    after each optimizer step instead of zeroed, so that it writes them anew (as in a
    run's first step)."""

    collective_forwards = True

    def __init__(self, model: nn.Module, group, keep_gathered: bool = False,
                 overlap: bool = False, gloo: bool = False):
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule

        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.loss = None
        self.comm = GlooReduceScatter() if gloo and self.size > 1 else None
        self.overlap = overlap and self.comm is not None
        if self.comm is not None:
            self.comm.defer = self.overlap
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_reduce_scatter(self.comm)
        # Every FSDP unit (under a pipeline the roots are the stage modules, and torch's
        # schedule keeps them gathered between its micro-batches itself); the model,
        # when it is the root, is told when to reshard after backward.
        self.units = ([m for m in model.modules() if isinstance(m, FSDPModule)]
                      if keep_gathered else [])
        self.root = model if keep_gathered and isinstance(model, FSDPModule) else None
        self._keep(True)

    def release(self) -> None:
        """Free what a forward without backward (evaluation) left gathered."""
        for m in self.units:
            m.reshard()

    def reset(self) -> None:
        """A step dropped half-way: its gathered parameters and the gradients it
        accumulated unsharded freed too."""
        if self.comm is not None:
            self.comm.pending.clear()  # (not waited for: each work holds its tensors)
        super().reset()  # (zero_grad: the next step's first reduce deferred again)
        self.release()
        for m in self.units:
            # FSDP2 has no public call that drops the gradients a no-sync backward left
            # on its unsharded parameters (or, under mixed precision, in its accumulator)
            # short of reducing them: cleared on its FSDPParams.
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group is not None else ()):
                fp.unsharded_accumulated_grad = None
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
        self._keep(True)

    def _keep(self, keep: bool) -> None:
        """Whether the coming backwards leave every unit's parameters gathered and its
        gradients unsharded (accumulated, not reduce-scattered)."""
        if self.root is not None:
            self.root.set_reshard_after_backward(not keep, recurse=True)
            self.root.set_requires_gradient_sync(not keep, recurse=True)

    def arm(self, loss_sum: torch.Tensor) -> None:
        self.loss = loss_sum
        self._keep(False)  # the step's last backward frees them

    def end_round(self, force: bool = False) -> None:
        if self.overlap:
            self.comm.wait()
            if self.comm.reduced:  # a next backward would add into these gradients
                self.comm.defer = False

    def finish(self) -> torch.Tensor:
        import torch.distributed as dist

        if self.overlap:
            self.comm.wait()
        self._keep(True)  # (for the next step: its first forward gathers them again)
        t = self.loss.detach().reshape(1).to(torch.float64).clone()
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def zero_grad(self) -> None:
        for p in self.params:
            if self.overlap:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        if self.overlap:
            self.comm.defer, self.comm.reduced = True, False


@torch.no_grad()
def materialize(model: nn.Module, spec, seed: int, device, tp_layout: dict,
                adapter=None) -> None:
    """Give a model built on the meta device (and sharded: FSDP, tensor parallelism,
    pipeline cut) its initial weights, one tensor at a time, keeping only this rank's
    shard of each: ``raylm.models.materialize.initial_state`` yields each full tensor
    (one module's worth at a time, the values ``build_model`` would give); each is cut
    to the rank's tensor-parallel shard (through the canonical adapter, which knows
    padded vocabularies and GPT-2's fused and transposed layers), then to its FSDP rows,
    and dropped. Buffers (real on the meta skeleton) are kept across ``to_empty``."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from raylm.models.materialize import initial_state

    buffers = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}
    # to_empty gives each module its own new tensor: note which (module, name) slots
    # share a parameter (tied embeddings) to share the new one again.
    slots: dict = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    for group in slots.values():
        first = group[0][0]._parameters[group[0][1]]
        for module, name in group[1:]:
            module._parameters[name] = first
    for n, b in model.named_buffers(remove_duplicate=False):
        b.copy_(buffers[n])
    del buffers
    targets = dict(model.named_parameters(remove_duplicate=False))
    for name, full in initial_state(spec, seed, names=set(targets)):
        p = targets[name]
        value = full
        if name in tp_layout:  # the rank's tensor-parallel shard, in the runtime form
            mesh, placements, shape = tp_layout[name]
            local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
            # On the mesh's device: DTensor.from_local moves a tensor of another device
            # there, so a CPU tensor would not be the one written below (GPU ranks).
            local = torch.zeros(local_shape, dtype=full.dtype, device=mesh.device_type)
            tmp = DTensor.from_local(local, mesh, placements, shape=shape,
                                     stride=contiguous_stride(shape), run_check=False)
            rule = adapter.rule(name, tmp) if adapter is not None else None
            view = rule.canonical(tmp) if rule is not None else tmp
            # (the canonical form may be a view of the HF tensor: GPT-2's c_attn [H, 3, H])
            src = distribute_tensor(full.reshape(view.shape), mesh, view.placements,
                                    src_data_rank=None)
            view.to_local().copy_(src.to_local())
            value = tmp.to_local()
        dest = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor) and dest.shape != value.shape:
            write_rows_back(p, value)  # the rank's FSDP rows (of its tp shard)
        else:
            dest.copy_(value)
