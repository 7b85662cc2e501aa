"""Compile: each transformer block's forward through torch.compile (--torch_compile_scope
blocks, the default), or the rank's whole forward and its loss where the rank holds the
whole model with nothing wrapping its blocks (model).

Whole: the model's forward is one graph and the loss another (``apply_compile_model``),
so that on a GPU the embeddings, the head and the loss are compiled too and nothing
launches kernel by kernel between the blocks (on one H100, per-block compile left the
GPU idle 11-27 ms a step in the eager parts and between the 12 compiled calls in one
profiled run); it takes longer to compile (about 100 s against 12-18 s for GPT-2 12 x
768 there).

Per block (as torchtitan does), which every layout takes, its blocks wrapped or not
(tensor-parallel DTensors, FSDP's hooks, a pipeline stage, activation checkpointing):
identical blocks share one compiled graph (torch compiles a block's code once and takes each block's parameters as
inputs), a graph stays small enough to compile in seconds, and whatever is not a block
(embeddings, the head and its loss, the pipeline schedule, FSDP's hooks) stays eager.

The block's ``forward`` is replaced, not the module wrapped: parameter names, and so
checkpoints, tensor-parallel plans and the pipeline cut, stay the model's own, and a
module hook (FSDP2 gathering a block's parameters) runs around the compiled code. It goes
after tensor parallelism (the graph takes DTensor parameters) and before activation
checkpointing, which then checkpoints the compiled forward: recomputing a block runs its
compiled code again (build_engine's order: tensor parallel, compile, checkpointing,
pipeline cut, FSDP).

What does not compose yet is refused before any actor (raylm.plan.constraints:
``compile_problem``): the generic pipeline split (torch.export traces the model into
graphs with no blocks left). Each dropout breaks the graph: its masks are raylm's
per-sample ones, drawn eagerly (raylm.models.dropout), so a compiled run trains the
eager run's function. A rank compiles with as many threads as it computes with
(``compile_threads``): no pool of compile processes per rank.
"""

from __future__ import annotations

import os

import torch

from raylm.models.units import transformer_blocks


def compile_threads() -> None:
    """Inductor compiles with this rank's torch threads (unless
    TORCHINDUCTOR_COMPILE_THREADS says otherwise): by default it starts a pool of
    compile processes as large as the machine's cores in every rank."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # (imported here: a rank that does not compile never loads inductor)
        import torch._inductor.config as inductor

        inductor.compile_threads = max(1, torch.get_num_threads())


def guard_hooks() -> None:
    """Compiled code is guarded on its modules' hooks: per-sample dropout hooks the
    modules a first forward found dropping (raylm.models.dropout.DropoutSites), and a
    graph traced before would otherwise run on without them (torch skips those guards
    by default)."""
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False


def apply_compile_model(model: torch.nn.Module, loss_fn, backend=None, mode=None):
    """Compile ``model``'s forward in place (``nn.Module.compile``: parameter names and
    hooks stay the model's own) and return ``loss_fn`` compiled."""
    compile_threads()
    guard_hooks()
    _no_cache(model)
    model.compile(backend=backend or "inductor", mode=mode)
    return torch.compile(loss_fn, backend=backend or "inductor", mode=mode)


def _no_cache(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        # A key-value cache object per layer would make every block a graph of its own.
        config.use_cache = False


def apply_compile(model: torch.nn.Module, backend=None, mode=None) -> int:
    """Compile the forward of every block of ``model`` (torch.compile's ``backend``,
    default inductor, and ``mode``); the blocks compiled."""
    compile_threads()
    guard_hooks()
    _no_cache(model)
    blocks = transformer_blocks(model)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend or "inductor",
                                      mode=mode)
    return len(blocks)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process since it started or a kept rank
    reset (identical blocks share one: a model's blocks make one or a few)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
