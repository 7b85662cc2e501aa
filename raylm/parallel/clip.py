"""The global gradient norm and clipping: one function for every layout and ZeRO stage.

torch's ``clip_grad_norm_`` sees one rank's tensors. Here the norm is that of the whole
model, as one process would compute it. Each gradient sync describes what its rank holds
as *pieces*: ``(local tensor, process groups)``, where the local tensor's squared norm is
summed over those groups to count the whole tensor once:

* a gradient nothing shards (a plain tensor after the dp all-reduce, or a Replicate
  DTensor: norms under tensor parallelism) has no groups: every rank that holds it adds
  it locally and it counts once;
* a tensor-parallel shard (a DTensor sharded over tp; FSDP's rows over dp, its
  ``_StridedShard`` included) is summed over the mesh groups of its sharded dims;
* ZeRO 1/2's owned rows of a gradient are summed over the dp group (and over tp for the
  rows of a tensor-parallel shard);
* pipeline stages each bring their own parameters, summed over the pp group; a weight
  held by several stages (tied embeddings) is passed in by one of them only.

Each tensor's norm is taken in its own dtype, as torch's ``clip_grad_norm_`` does, and
squares are summed in float64. When nothing is summed over any group (one process, or
plain data parallelism after the all-reduce) the norm *is* torch's own
(``torch.nn.utils.get_total_norm`` and the same coefficient arithmetic): Adam turns a
last-bit change of the clip coefficient into visible changes of weights whose gradients
are near zero, so single-process parity is kept to the bit there.

Written here rather than taken from torch because ``clip_grad_norm_`` over DTensors does
one collective per gradient and knows nothing of ZeRO rows or pipeline stages; this does
one all-reduce per group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def reduce_partial(g: DTensor) -> DTensor:
    """A DTensor gradient with its Partial mesh dims summed (Replicate there): torch
    leaves one when a replicated parameter meets sharded activations and no gradient
    was pre-allocated."""
    if any(pl.is_partial() for pl in g.placements):
        g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                       for pl in g.placements])
    return g


def sharded_groups(t) -> tuple:
    """The process groups over which a (DTensor) tensor's local part is one of several:
    the groups of its mesh dims that are not Replicate (Shard, and FSDP's _StridedShard,
    whose ``is_shard()`` is False). A plain tensor: none."""
    if not isinstance(t, DTensor):
        return ()
    return tuple(t.device_mesh.get_group(d) for d, pl in enumerate(t.placements)
                 if not pl.is_replicate())


def norm_pieces(grads) -> list:
    """Pieces (see the module docstring) of gradients as autograd leaves them: plain
    tensors and DTensors (Partial dims reduced first). None entries are skipped."""
    pieces = []
    for g in grads:
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = reduce_partial(g)
            pieces.append((g.to_local(), sharded_groups(g)))
        else:
            pieces.append((g, ()))
    return pieces


def _trivial(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


@torch.no_grad()
def global_norm(pieces, pp_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (0-d tensor): float64, or, when no piece
    is summed over any group, torch's own float figure. Collective over every group
    named in ``pieces`` and over ``pp_group``: all ranks of a group call it with pieces
    of the same tensors, in the same order."""
    if all(all(_trivial(g) for g in groups) for _, groups in pieces) and _trivial(pp_group):
        return torch.nn.utils.get_total_norm([t for t, _ in pieces])
    device = pieces[0][0].device if pieces else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    summed: dict = {}  # groups -> local sum of squares, in first-seen order
    for t, groups in pieces:
        sq = torch.linalg.vector_norm(t.detach(), 2.0).double() ** 2
        groups = tuple(g for g in groups if not _trivial(g))
        if groups:
            summed[groups] = summed[groups] + sq if groups in summed else sq
        else:
            total += sq.to(device)
    # The same keys in the same order on every rank (same tensors, same order).
    for groups, sq in summed.items():
        sq = sq.reshape(1).clone()
        for g in groups:
            sq = _for_backend(sq, g)
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=g)
        total += sq[0].to(device)
    if not _trivial(pp_group):
        total = _for_backend(total.reshape(1).clone(), pp_group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total[0].to(device)
    return total.sqrt()


def _for_backend(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` where ``group``'s backend can sum it: NCCL takes GPU tensors only, and a
    rank's pieces can be on the CPU (no pieces at all; --cpu_offload's sharded
    gradients)."""
    if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return t.cuda()
    return t


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm(pieces, grads, max_norm: float, pp_group=None, loss_scale: float = 1.0):
    """Scale every tensor of ``grads`` so the global norm of ``pieces`` is at most
    ``max_norm``, with torch's formula (coefficient ``max_norm / (norm + 1e-6)``, capped
    at 1); returns the norm before clipping. ``loss_scale``: the gradients are of a loss
    multiplied by it (fp16): they are divided by it in the same pass, and the norm
    returned is the unscaled one; not finite (an overflow somewhere: the same figure on
    every rank), they are left as they are for the caller to skip the step. On a GPU
    (gradients there, no loss scale) the norm is returned as a 0-d device tensor, read
    without a host sync here: ``float()`` of it waits for the clip."""
    total = global_norm(pieces, pp_group)
    kept = [g for g in grads if g is not None]
    if loss_scale == 1.0 and total.device.type == "cuda" and \
            all(_local(g).device.type == "cuda" for g in kept):
        # On a GPU, no wait for the device: the coefficient stays a device tensor (as in
        # torch's clip_grad_norm_), so the clip's kernels queue behind backward's while
        # the CPU goes on, and the caller reads the norm once the step's work is all
        # launched. (x * 1.0 is x: scaling when nothing clips changes no bit.) Cast to
        # float32 as the CPU path's Python scalar is inside the kernels.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).float()
        plain = [g for g in kept if not isinstance(g, DTensor)]
        if plain:
            torch._foreach_mul_(plain, coef)
        for g in kept:
            if isinstance(g, DTensor):
                g.to_local().mul_(coef)  # (a Partial gradient's pieces: the sum scales)
        return total
    if loss_scale != 1.0:
        total = total / loss_scale
        if not bool(torch.isfinite(total)):
            return float(total)
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0)) / loss_scale
    if coef != 1.0:
        for g in grads:
            if g is not None:
                # (a DTensor's local part: the same product without DTensor's dispatch)
                _local(g).mul_(coef)
    return float(total)
