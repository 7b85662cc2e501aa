"""Data-parallel gradient sync: a bucketed all-reduce over the dp process group.

Not DDP: DDP's reducer hooks into autograd and, composed with pipeline stages, either
asserts or (static_graph=True) syncs wrong gradients (shared notes). An explicit
all-reduce after the last micro-batch's backward composes with any schedule that
accumulates gradients locally, which is every schedule raylm runs. Gradients are summed,
not averaged: the loss is already normalised by the global token count of the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradientAllReduce:
    def __init__(self, params, group, bucket_bytes: int = 25 * 2**20):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        # Fixed bucket layout, the same on every rank (same model, same order).
        self.buckets: list[list[torch.nn.Parameter]] = []
        current, current_bytes = [], 0
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if current and current_bytes + nbytes > bucket_bytes:
                self.buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            self.buckets.append(current)

    def sync(self) -> None:
        """Sum every parameter's gradient over the group (all ranks call this)."""
        if self.size == 1:
            return
        flats, works = [], []
        for bucket in self.buckets:
            # A parameter that took no part in this step still joins the bucket as zeros,
            # so every rank reduces the same layout.
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in bucket])
            works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group,
                                         async_op=True))
            flats.append(flat)
        for bucket, flat, work in zip(self.buckets, flats, works):
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                g = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
                offset += n


def all_reduce_sum(values: list[float], group, device="cpu") -> list[float]:
    """Sum a few scalars over the group in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()
