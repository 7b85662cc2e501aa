"""Activation checkpointing: each transformer block keeps less for its backward and
recomputes the rest there (torch.utils.checkpoint, non-reentrant).

* ``full``: a block keeps only its inputs; its whole forward runs again in backward
  (one more forward: about a third more compute; Chen et al. 2016, Megatron's "full").
* ``selective``: as torchtitan's op-level selective checkpointing, the block also keeps
  the outputs of its expensive ops, the matrix multiplies, the fused attention kernels
  and the collectives of tensor parallelism (so recomputation never communicates), and
  recomputes the cheap element-wise rest (norms, activation functions, dropout, rotary).
  Nearly all the saving for a few memory-bound passes.

Applied to the blocks (raylm.models.units.transformer_blocks) as a wrapper around each
one's ``forward``, not as a wrapper module: parameter names, and so checkpoints, the
tensor-parallel plans and the pipeline cut, stay the model's own. It goes after tensor
parallelism and before the pipeline cut and FSDP (build_engine's order, as torchtitan's):
FSDP's hooks then sit around the checkpointed forward, gathering a block's parameters
before its forward and before its backward, which is when the recomputation runs.

Dropout is recomputed with the same masks: torch's own from the RNG state checkpoint
restores, and raylm's per-sample masks (raylm.models.dropout) by replaying the context
that drew them from the same call index.

What a checkpointed block keeps goes through one identity autograd node after it, which
saves those tensors (they are alive anyway until the block's backward): autograd's
saved-tensor hooks, and so raylm.runtime.memory.ActivationMeter, see them, as they see
everything an uncheckpointed block saves. The recomputation's own transient tensors
(one block's worth, during its backward) are not saved tensors of the graph.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from raylm.models.dropout import SampleDropout
from raylm.models.units import transformer_blocks
from raylm.plan.activations import RECOMPUTE_MODES as MODES

_aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: expensive to recompute.
_MATMULS = {_aten.mm.default, _aten.addmm.default}
_ATTENTION = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name)}
_COLLECTIVES = {getattr(torch.ops._c10d_functional, name).default for name in (
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")}
SAVED_OPS = frozenset(_MATMULS | _ATTENTION | _COLLECTIVES)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> int:
    """Checkpoint every block of ``model`` in ``mode`` (one of MODES); the blocks
    wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {MODES}")
    if mode == "none":
        return 0
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        # A key-value cache would grow again when a block is recomputed (transformers
        # turns it off with its own checkpointing too).
        config.use_cache = False
    blocks = transformer_blocks(model)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, mode)
    return len(blocks)


def checkpointed_blocks(model: torch.nn.Module) -> int:
    """How many of ``model``'s modules run checkpointed (a rank's, after the pipeline
    cut: the blocks its stages hold)."""
    return sum(1 for m in model.modules() if isinstance(m.__dict__.get("forward"),
                                                        functools.partial)
               and m.__dict__["forward"].func is _checkpointed)


class _Keep(torch.autograd.Function):
    """Identity on ``x`` that saves ``kept`` for backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, *kept):
        ctx.save_for_backward(*kept)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * len(ctx.saved_tensors)


def _checkpointed(forward, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved anyway
        return forward(*args, **kwargs)
    saved: list = []  # what selective checkpointing keeps, filled during the forward
    out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                     context_fn=functools.partial(_contexts, mode, saved), **kwargs)
    kept = [t for t in (*args, *kwargs.values(), *saved)
            if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    if isinstance(out, torch.Tensor):
        return _Keep.apply(out, *kept)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (_Keep.apply(out[0], *kept),) + out[1:]
    return out


def _contexts(mode: str, saved: list):
    """checkpoint's (forward, recomputation) contexts: selective checkpointing's
    caching modes, and the per-sample dropout context replayed for the recomputation
    (from where it stood when the block began)."""
    forward, again = [], []
    if mode == "selective":
        cache, cached = create_selective_checkpoint_contexts(
            functools.partial(_policy, saved))
        forward.append(cache)
        again.append(cached)
    dropout = SampleDropout.current()
    if dropout is not None:
        again.append(dropout.replay(dropout.mark()))
    return _Entered(forward), _Entered(again)


class _Entered:
    """Context managers entered together, in order, when this one is."""

    def __init__(self, managers: list):
        self.managers, self.stack = managers, None

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        for m in self.managers:
            self.stack.enter_context(m)
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def _policy(saved: list, ctx, op, *args, **kwargs):
    if op in SAVED_OPS:
        out = ctx.op_output
        saved.extend(t for t in (out if isinstance(out, (tuple, list)) else (out,))
                     if isinstance(t, torch.Tensor))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
