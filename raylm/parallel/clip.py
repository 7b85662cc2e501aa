"""Gradient clipping over a model spread across ranks: one function for every layout.

torch's ``clip_grad_norm_`` sees one rank's tensors. Here the norm is that of the whole
model, as one process would compute it:

* a gradient that is a DTensor *shard* (tensor parallelism) contributes its local part,
  summed over the shard's mesh group;
* a replicated gradient (a plain tensor, or a Replicate DTensor: norms under tensor
  parallelism) counts once, not once per tensor-parallel rank;
* pipeline stages each count their own parameters, summed over the pp group; a weight
  held by several stages (tied embeddings) is passed in by one of them only.
"""

from __future__ import annotations

import torch.distributed as dist

from raylm.parallel.tensor.grads import grad_norm_sq


def grad_norm(params, pp_group=None) -> float:
    """The global L2 norm of the gradients of ``params`` (see the module docstring)."""
    sq = grad_norm_sq(params)  # summed over tp where gradients are shards
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
    return float(sq.sqrt())


def clip_grad_norm(norm_params, all_params, max_norm: float, pp_group=None) -> float:
    """Scale every gradient of ``all_params`` so the global norm of ``norm_params`` is at
    most ``max_norm`` (torch's formula); returns the norm before clipping."""
    total = grad_norm(norm_params, pp_group)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in all_params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total
