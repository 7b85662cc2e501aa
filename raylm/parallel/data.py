"""Data-parallel gradient sync: a bucketed all-reduce over the dp group, overlapped with
the last micro-batch's backward.

Not DDP: DDP's reducer hooks into autograd and, composed with pipeline stages, either
asserts or (static_graph=True) syncs wrong gradients (shared notes). This is the part of
DDP raylm needs, written so it composes with any schedule that accumulates gradients
locally:

* Gradients live in flat per-bucket buffers (each ``param.grad`` is a view), so a bucket
  is reduced in place, with no copy in or out.
* On the last micro-batch of a step, a post-accumulate-grad hook counts each bucket's
  ready gradients; full buckets are reduced asynchronously while backward goes on.
  Buckets are launched strictly in index order, the same on every rank (a rank with no
  samples in an epoch's short last step launches them all at the end, in that order).
* The step's summed loss rides in a slot of the last bucket, so reporting it costs no
  collective of its own.

Gradients are summed, not averaged: the loss is already normalised by the global token
count of the step.

Tensor-parallel parameters (DTensors) are bucketed by their local shard: the gradient is
a DTensor over the bucket view with the parameter's mesh and placements, so dp peers (which
hold the same shard) reduce it like any other, and autograd accumulates into it in place
(a DTensor ``+=``). A replicated parameter whose incoming gradient is Partial (a norm on
sequence shards) is summed over tp by that ``+=``; pre-allocating its Replicate gradient
is what makes it so (left to itself torch would store the Partial gradient).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from raylm.parallel.clip import clip_grad_norm, norm_pieces


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    if isinstance(p, DTensor):
        with torch.no_grad():
            return p.to_local()
    return p


def bucket_params(params: list, bucket_bytes: int) -> list:
    """Parameters in buckets of about ``bucket_bytes`` (of the local shards), in reverse
    order: backward produces the last layers' gradients first."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = local_tensor(p).numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class GradientSync:
    """How a rank's gradients meet over its data-parallel group, whatever the ZeRO stage:
    the worker calls these and nothing else (stage 0: ``GradientAllReduce``; 1 and 2:
    raylm.parallel.zero.partitioned; 3: raylm.parallel.zero.fsdp; built by
    raylm.parallel.zero.gradient_sync).

    Per step: ``arm(loss_sum)`` before the last micro-batch's backward, ``end_round()``
    after each micro-batch's backward, ``finish()`` (the gradients and the step's loss
    summed over dp; returns the loss), ``clip(norm_params, max_norm, pp_group)`` (the one
    global gradient norm, clipping), the optimizer's step, ``zero_grad()``. Subclasses
    keep ``params`` (the parameters it syncs)."""

    params: list
    # Forward and backward themselves are collective over dp (FSDP gathers parameters in
    # each): every dp rank must run as many micro-batches, a rank short of samples filler
    # ones.
    collective_forwards = False

    def arm(self, loss_sum: torch.Tensor) -> None:
        raise NotImplementedError

    def end_round(self, force: bool = False) -> None:
        """A micro-batch's backward is done (``force``: a round a rank without samples
        runs to keep pace). Only ZeRO-2 sends per round."""

    def finish(self) -> torch.Tensor:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Drop a step half-way (it did not commit): zero the gradients and forget any
        collective in flight."""
        self.zero_grad()

    def release(self) -> None:
        """After forwards with no backward (evaluation): free what they left gathered
        (ZeRO-3 keeping its parameters gathered through a step)."""

    def close(self) -> None:
        """Detach from the parameters (hooks), before another sync replaces this one."""

    def grad_of(self, p: torch.Tensor):
        """The gradient this rank keeps of ``p`` after ``finish`` (ZeRO 1/2: its rows)."""
        return p.grad

    def norm_pieces(self, norm_params: list) -> list:
        """What this rank holds of the gradients of ``norm_params``, as the pieces of
        raylm.parallel.clip: (local tensor, the groups it is summed over)."""
        return norm_pieces(self.grad_of(p) for p in norm_params)

    def scaled_grads(self) -> list:
        """The gradient tensors clipping scales (every one this rank keeps)."""
        return [p.grad for p in self.params]

    def clip(self, norm_params: list, max_norm: float, pp_group=None,
             loss_scale: float = 1.0) -> float:
        """Scale the gradients so the global norm (of ``norm_params``, over tp, dp rows
        and the pipeline's ``pp_group``; raylm.parallel.clip, the one norm) is at most
        ``max_norm``, unscaling them from ``loss_scale``; returns the norm before
        clipping (not finite: an overflow, gradients left as they are)."""
        return clip_grad_norm(self.norm_pieces(norm_params), self.scaled_grads(), max_norm,
                              pp_group, loss_scale)

    def make_optimizer(self, param_groups: list, **adamw):
        """(the torch optimizer that schedulers and checkpoints see, the object whose
        ``step()`` the worker calls)."""
        optimizer = torch.optim.AdamW(param_groups, **adamw)
        return optimizer, optimizer

    def checkpoint_form(self, model, dp_mesh):
        """The optimizer state in checkpoint form when it is not the torch optimizer's own
        (ZeRO 1/2's partitions); None otherwise."""
        return None

    def held_gradients(self):
        """The gradient buffers to count for the memory report when they are not the
        parameters' ``.grad`` (ZeRO-2's partitions); None otherwise."""
        return None


class GradientAllReduce(GradientSync):
    """ZeRO-0: each bucket of gradients all-reduced (summed) as soon as its last gradient
    is ready. ``reduce_dtype`` (bf16): a bucket is summed in that dtype on the wire and
    written back into the fp32 gradients; the loss slot is summed in fp32 on its own."""

    def __init__(self, params, group, bucket_bytes: int = 4 * 2**20, loss_slot: bool = True,
                 reduce_dtype=None):
        self.reduce_dtype = reduce_dtype
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        buckets = bucket_params(self.params, bucket_bytes)
        self.buckets = buckets
        self.flats: list[torch.Tensor] = []
        self.bucket_of: dict[int, int] = {}
        for i, bucket in enumerate(buckets):
            extra = 1 if loss_slot and i == len(buckets) - 1 else 0  # the loss slot
            flat = torch.zeros(sum(local_tensor(p).numel() for p in bucket) + extra,
                               dtype=bucket[0].dtype, device=local_tensor(bucket[0]).device)
            offset = 0
            for p in bucket:
                local = local_tensor(p)
                n = local.numel()
                view = flat[offset:offset + n].view_as(local)
                if isinstance(p, DTensor):
                    view = DTensor.from_local(view, p.device_mesh, p.placements, shape=p.shape,
                                              stride=p.stride(), run_check=False)
                p.grad = view
                self.bucket_of[id(p)] = i
                offset += n
            self.flats.append(flat)
        self.loss_slot = self.flats[-1][-1:] if self.flats and loss_slot else None
        self.pending = [0] * len(buckets)
        self.works: list = []
        self.launched = 0
        self.armed = False
        self.hooks = []
        if self.size > 1:
            self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                          for p in self.params]

    # -- per step --------------------------------------------------------------------------
    def arm(self, loss_sum: torch.Tensor) -> None:
        """Call before the last micro-batch's backward, with the rank's summed loss."""
        self.loss_slot.copy_(loss_sum.detach().reshape(1))
        if self.size > 1:
            self.pending = [len(b) for b in self.buckets]
            self.armed = True

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(p)]
        self.pending[i] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        flat = self.flats[self.launched]
        if self.reduce_dtype is None:
            self.works.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=True), None, None))
        else:
            last = self.launched == len(self.flats) - 1 and self.loss_slot is not None
            grads = flat[:-1] if last else flat
            low = grads.to(self.reduce_dtype)
            self.works.append((dist.all_reduce(low, op=dist.ReduceOp.SUM, group=self.group,
                                               async_op=True), grads, low))
            if last:
                self.works.append((dist.all_reduce(self.loss_slot, op=dist.ReduceOp.SUM,
                                                   group=self.group, async_op=True),
                                   None, None))
        self.launched += 1

    def finish(self) -> torch.Tensor:
        """Wait for every bucket (launching those still due, in order); returns the loss
        summed over the group. All ranks call this once per step."""
        if self.size > 1:
            while self.launched < len(self.buckets):
                self._launch()
            for work, grads, low in self.works:
                work.wait()
                if grads is not None:
                    grads.copy_(low)
        self.works, self.launched, self.armed = [], 0, False
        return self.loss_slot.clone()

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def reset(self) -> None:
        self.works, self.launched, self.armed = [], 0, False
        self.zero_grad()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _SummedChunks:
    """The work of ``reduce_scatter_sum`` over gloo: ``wait`` waits for the all-to-all and
    sums the rank's received chunks into ``out``."""

    def __init__(self, work, received: torch.Tensor, out: torch.Tensor, size: int):
        self.work, self.received, self.out, self.size = work, received, out, size

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            torch.sum(self.received.view(self.size, -1), dim=0, out=self.out.view(-1))
            self.work = self.received = None


def reduce_scatter_sum(out: torch.Tensor, staging: torch.Tensor, group):
    """Start summing ``staging`` (every rank's section, rank-major) over ``group`` into
    this rank's section ``out`` (a reduce-scatter); returns its work (``wait()``), or
    None with one rank (``out`` is a copy then).

    Over gloo it is an all-to-all that gives each rank every rank's section of its own,
    summed here when waited for. Why not gloo's reduce-scatter: gloo has none of its own
    (torch's gloo backend all-reduces the whole buffer and keeps a section: twice the
    bytes, every section summed on every rank), and an all-to-all moves the bytes of a
    ring reduce-scatter in one collective. On the 2-core machine, 4 MiB: 4 ranks 6.4-8.2 ms
    against 13-15 for the all-reduce and 8.5-14 for gloo's reduce-scatter, 2 ranks 2.5-3.3
    against 7-8 and 4.4-7 (raylm's ZeRO stages 1 and 2 all-reduced their buckets before,
    as the faster of those two). NCCL's reduce-scatter is kept."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        out.copy_(staging)
        return None
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(staging)
        work = dist.all_to_all_single(received, staging, group=group, async_op=True)
        return _SummedChunks(work, received, out, size)
    return dist.reduce_scatter_single(out, staging, op=dist.ReduceOp.SUM, group=group,
                                      async_op=True)


def all_reduce_sum_async(values: list[float], group, device="cpu"):
    """Start summing a few scalars over the group; returns (tensor, work or None)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        return t, dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return t, None


def all_reduce_sum(values: list[float], group, device="cpu") -> list[float]:
    """Sum a few scalars over the group in one collective."""
    t, work = all_reduce_sum_async(values, group, device)
    if work is not None:
        work.wait()
    return t.tolist()


def all_reduce_max(value: float, group, device="cpu") -> float:
    """The largest of one scalar over the group."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())
