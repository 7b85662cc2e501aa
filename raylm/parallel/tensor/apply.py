"""Applying a tensor-parallel plan to a whole Hugging Face model, in place.

torch's ``parallelize_module`` does the sharding; this module prepares the model for it
and fills in what torch has no notion of:

1. GPT-2's ``Conv1D`` layers become ``nn.Linear`` (transposed weight): torch's Colwise/
   RowwiseParallel only shard ``nn.Linear`` and ``nn.Embedding``.
2. Fused projections (GPT-2's ``c_attn``: q, k, v stacked) get their output rows
   reordered so that rank r's contiguous shard is [q_r; k_r; v_r]; attributes the HF
   forward uses as global sizes (``split_size``, ``num_heads``) become local.
3. The vocabulary is padded with zero rows to a multiple of tp (embedding, head, head
   bias, ties kept), and a forward hook sets the padded logit columns to the dtype's
   minimum, so the softmax, the loss and every gradient equal the unpadded model's.
4. The plan: the family's layers (colwise / rowwise, from transformers'
   ``base_model_tp_plan`` or raylm's own plans), the vocabulary-parallel embedding
   (RowwiseParallel, input replicated) and head (ColwiseParallel, output kept a DTensor
   sharded on the vocabulary: the loss is a parallel cross-entropy under
   ``loss_parallel()``), and, with sequence parallelism, norms on sequence shards.
5. Tied parameters (GPT-2's wte/lm_head, BERT's decoder weight and bias, T5's shared
   embeddings) are re-tied: ``parallelize_module`` distributes each module's parameter
   separately, so the holders are pointed back at one DTensor parameter.
6. Every parameter's global shape and shard dim are checked against
   ``raylm.models.tensor_plans.tensor_parallel_shapes``, the model of tensor parallelism
   the planner's memory figures and the ZeRO ownership table use (no process group), so
   the two cannot drift apart silently.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from raylm.errors import ConfigError
from raylm.models.tensor_plans import (TensorParallelShapes, base_prefix, check_tensor_parallel,
                                       layer_styles, match, plan_for, tensor_parallel_shapes)
from raylm.parallel.tensor.stage_graphs import check_styles, shard_stage_graphs


# -- the result ----------------------------------------------------------------------------
@dataclass
class TPState:
    """What ``apply_tensor_parallel`` did to a model (read by the canonical adapter)."""

    mesh: Any  # the 1-D tp DeviceMesh
    sequence_parallel: bool
    vocab_size: int  # the model's own vocabulary
    padded_vocab_size: int  # a multiple of tp; rows past vocab_size are zero
    source: str  # "raylm", "transformers" or "user": where the layer plan came from
    plan: dict = field(default_factory=dict)  # module fqn -> the torch style applied
    converted: tuple = ()  # Conv1D modules turned into nn.Linear (fqns)
    fused: dict = field(default_factory=dict)  # fused module fqn -> number of parts
    vocab_params: tuple = ()  # parameter fqns whose dim 0 is the (padded) vocabulary

    @property
    def tp(self) -> int:
        return self.mesh.size()

    def loss_context(self):
        """Forward, loss and backward of a step run inside this: logits are sharded on the
        vocabulary, and cross-entropy over them is torch's parallel one. (A user's plan
        leaves the logits whole, as an image classifier's plan does: nothing to do.)"""
        if not self.vocab_params:
            return contextlib.nullcontext()
        return loss_parallel()

    def describe(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        pad = (f", vocabulary {self.vocab_size} padded to {self.padded_vocab_size}"
               if self.padded_vocab_size != self.vocab_size else "")
        return f"tp={self.tp} ({self.source} plan, {len(self.plan)} modules{sp}{pad})"


# -- helpers -------------------------------------------------------------------------------
def _apply_layers(model: nn.Module, tp_mesh, plan, source: str, prefix: str, expected,
                  src_data_rank, graphs: list) -> TPState:
    """A plan with no vocabulary-parallel pair (Plan.vocabulary False): a model of the
    user's own (train(..., tp_plan=); raylm.models.custom.check_tp_plan checked its
    styles, and refused a sharded tied weight: nothing to re-tie) or an image classifier:
    exactly the styles the plan names; the logits come out whole (a plan of your own may
    not leave them column-sharded), so the loss is the plain one (TPState.loss_context:
    none). The stage ``graphs`` of a pipeline read the sharded layers as their styles
    do."""
    styles, named = {}, {}
    for pattern, name in plan.layers.items():
        for fqn in match(model, prefix, pattern):
            style = torch_style(name)
            if style is not None:
                styles[fqn], named[fqn] = style, (name, style)
    if graphs:
        check_styles(named)  # (before anything is sharded)
    parallelize_module(model, tp_mesh, styles, src_data_rank=src_data_rank)
    _check_shapes(model, expected)
    if graphs:
        shard_stage_graphs(graphs, model, named, tp_mesh)
    vocab = getattr(model.config, "vocab_size", 0) or 0
    return TPState(mesh=tp_mesh, sequence_parallel=False, vocab_size=vocab,
                   padded_vocab_size=vocab, source=source,
                   plan={k: repr(v) for k, v in styles.items()})


def _holders(model: nn.Module) -> dict:
    """id(param) -> (param, [(module, attribute, fqn)]) over every path to every module."""
    out: dict = {}
    seen = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None or (id(module), pname) in seen:
                continue
            seen.add((id(module), pname))
            fqn = f"{mname}.{pname}" if mname else pname
            out.setdefault(id(p), (p, []))[1].append((module, pname, fqn))
    return out


def _set_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, attr = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _convert_conv1d(model: nn.Module) -> list:
    """Every transformers Conv1D (x @ W + b, W [in, out]) -> nn.Linear (W.T), in place."""
    from transformers.pytorch_utils import Conv1D

    converted = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Conv1D):
            continue
        weight = module.weight
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=module.bias is not None,
                           device="meta")
        linear.weight = nn.Parameter(weight.detach().t().contiguous(),
                                     requires_grad=weight.requires_grad)
        if module.bias is not None:
            linear.bias = module.bias
        linear.train(module.training)
        _set_module(model, name, linear)
        converted.append(name)
    return converted


@torch.no_grad()
def _reorder_fused(linear: nn.Linear, parts: int, tp: int) -> None:
    """Rows [p_0; p_1; ...] (each split in tp blocks) -> [p_0,r; p_1,r; ...] per rank r."""
    out = linear.weight.shape[0]
    if out % (parts * tp):
        raise ConfigError(f"--tp {tp} must divide the width of each of the {parts} fused "
                          f"projections ({out // parts})")
    w = linear.weight.view(parts, tp, out // (parts * tp), -1).transpose(0, 1)
    linear.weight.copy_(w.reshape(out, -1).clone())
    if linear.bias is not None:
        b = linear.bias.view(parts, tp, -1).transpose(0, 1)
        linear.bias.copy_(b.reshape(out).clone())


def torch_style(name: str, sp: bool = False, config=None):
    """A plan's style name (tensor_plans.STYLES) as a torch ParallelStyle, or None for a module
    that stays whole on every rank. Under sequence parallelism the row-parallel layers
    reduce-scatter into sequence shards (kept as DTensors, so the residual stream stays
    one)."""
    to_seq = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    if name in ("colwise", "embedding_colwise_local"):
        return ColwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel(**to_seq)
    if name in ("rowwise_split_input", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate(), **to_seq)
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce":
        return ReplicatedOnLocalShards()
    if name == "all_reduce":
        return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
    if name == "mla_kv_a_proj":
        return SumGradientOfRotarySlice(config.get_text_config().qk_rope_head_dim)
    if name == "replicate":
        return None
    raise ConfigError(f"raylm does not translate the tensor-parallel style '{name}'")


def _sum_gradient_over_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the tp ranks. In DTensor terms: a
    replicated value whose local gradient is a Partial (each rank's holds only its heads'
    share), redistributed to Replicate."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


class SumGradientOfRotarySlice(ParallelStyle):
    """transformers' ``mla_kv_a_proj`` (multi-head latent attention, e.g. MiniCPM3,
    DeepSeek-V2): the replicated kv_a projection's output is [latent, rotary key]. The
    latent part reaches the heads through the column-parallel kv_b projection, whose input
    gradient torch already sums; the rotary slice goes straight to head-local attention, so
    its gradient must be summed here. Written by hand: torch has no style for a slice of an
    output."""

    src_data_rank = None

    def __init__(self, rope_dim: int):
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def outputs(mod, args, out):
            head, tail = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            return torch.cat([head, _sum_gradient_over_tp(tail, device_mesh)], dim=-1)

        module.register_forward_hook(outputs)
        return module


class ReplicatedOnLocalShards(ParallelStyle):
    """A replicated module (weights Replicate DTensors) applied to an activation that is
    already this rank's shard of something (Qwen3's per-head q_norm sees its heads only).

    Written by hand: torch has no style for it (SequenceParallel is the nearest, but fixes
    the shard to the sequence dim). The local input is presented as Shard(0): the module
    only normalises along the last dim, so any other shard dim computes the same; its
    weight gradient is then Partial and is summed over tp when it accumulates into the
    Replicate gradient (GradientAllReduce pre-allocates those)."""

    src_data_rank = None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(
                    DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                    requires_grad=p.requires_grad))

        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Shard(0)], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                         for a in args)

        def outputs(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _mask_padded_logits(head: nn.Module, vocab: int, padded: int, mesh):
    """Set the padded vocabulary columns of the head's (sharded) output to the dtype's
    minimum: exp() of them is 0, so softmax and loss ignore them and they get no
    gradient. Hand-written: torch's vocabulary-parallel styles assume an even vocab."""
    per = padded // mesh.size()
    real = max(0, min(per, vocab - mesh.get_local_rank() * per))
    if real == per:
        return None  # this rank's shard has no padding

    def hook(module, args, out):
        local = out.to_local()
        pad = torch.arange(local.shape[-1], device=local.device) >= real
        local = local.masked_fill(pad, torch.finfo(local.dtype).min)
        return DTensor.from_local(local, out.device_mesh, out.placements, shape=out.shape,
                                  stride=out.stride(), run_check=False)

    return head.register_forward_hook(hook)


def _check_shapes(model: nn.Module, expected: TensorParallelShapes) -> None:
    """Each parameter as torch sharded it (global shape, the dim of its Shard placement)
    against raylm's model of tensor parallelism; a style whose effect the model does not
    know fails here, naming the parameter, instead of as a wrong memory figure."""
    for name, p in model.named_parameters():
        dims = [pl.dim for pl in p.placements if isinstance(pl, Shard)] \
            if isinstance(p, DTensor) else []
        got = (tuple(p.shape), dims[0] if dims else None)
        want = (expected.shapes.get(name), expected.shard.get(name))
        if got != want:
            raise RuntimeError(
                f"tensor parallelism made {name} of global shape {got[0]} sharded on dim "
                f"{got[1]}, but raylm.models.tensor_plans.tensor_parallel_shapes says "
                f"{want[0]} on dim {want[1]}: update that model with the style's rule")


# -- the one entry point -------------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False,
                          src_data_rank=None, graphs=None) -> TPState:
    """Shard ``model`` (whole, built with the same weights on every tp rank) over the 1-D
    ``tp_mesh``, in place. ``src_data_rank=None`` takes each rank's own copy of the
    weights (no communication); pass 0 to broadcast rank 0's instead. ``graphs``: the
    pipeline stages of ``model`` cut by the generic export split (fx.GraphModules, a model
    of your own's), which run its planned layers as the plan's styles do
    (raylm.parallel.tensor.stage_graphs)."""
    config = model.config
    tp = tp_mesh.size()
    check_tensor_parallel(config, tp, sequence_parallel)
    plan, source = plan_for(config)
    if plan is None:  # only reachable with tp == 1, which check_tensor_parallel passes
        raise ConfigError(f"model type '{config.model_type}' has no tensor-parallel plan")
    if graphs and plan.vocabulary:  # (refused at planning: tensor_pipeline_problem)
        raise ConfigError(f"--tp {tp} with --pp: the {config.model_type} model's stages are "
                          "traced graphs, which take a plan of layers only")
    sp = plan.sequence_parallel if sequence_parallel else None
    prefix = base_prefix(model)
    expected = tensor_parallel_shapes(model, tp)

    # 1-2. Layers torch can shard; fused rows per rank; local sizes.
    converted = _convert_conv1d(model)
    fused = {}
    for pattern, parts in plan.fused.items():
        for fqn in match(model, prefix, pattern):
            # (a LoRA layer: the layer it wraps, and lora_B, whose rows are its outputs)
            for sub, _ in layer_styles(model, fqn, "colwise"):
                _reorder_fused(model.get_submodule(sub), parts, tp)
                fused[sub] = parts
    for pattern, attrs in plan.local_attrs.items():
        for fqn in match(model, prefix, pattern):
            module = model.get_submodule(fqn)
            for attr in attrs:
                value = getattr(module, attr)
                if value % tp:
                    raise ConfigError(f"--tp {tp} must divide {fqn}.{attr} ({value})")
                setattr(module, attr, value // tp)

    if not plan.vocabulary:  # a model of the user's own, an image classifier
        return _apply_layers(model, tp_mesh, plan, source, prefix, expected, src_data_rank,
                             graphs or [])

    # 3. The vocabulary, padded to a multiple of tp (ties kept: every holder is swapped).
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or not isinstance(head, nn.Linear):
        raise ConfigError(f"--tp {tp}: the {config.model_type} model has no embedding / "
                          "linear LM head pair to shard over the vocabulary")
    vocab, padded = expected.vocab_size, expected.padded_vocab_size
    holders = _holders(model)
    vocab_ids = {id(emb.weight), id(head.weight)}
    if head.bias is not None:
        vocab_ids.add(id(head.bias))
    for pid in vocab_ids:
        p = holders[pid][0]
        if p.shape[0] != vocab:
            raise ConfigError(f"--tp {tp}: the LM head's output size ({p.shape[0]}) is not "
                              f"the vocabulary size ({vocab})")
        if padded != vocab:
            new = nn.Parameter(torch.cat([p.detach(), p.new_zeros(padded - vocab, *p.shape[1:])]),
                               requires_grad=p.requires_grad)
            for module, attr, _ in holders[pid][1]:
                setattr(module, attr, new)
    holders = _holders(model)
    vocab_now = {id(emb.weight), id(head.weight)} | ({id(head.bias)} if head.bias is not None
                                                      else set())
    vocab_fqns = tuple(fqn for pid in vocab_now for _, _, fqn in holders[pid][1])
    ties = [hs for _, hs in holders.values() if len(hs) > 1]

    # 4. The plan: {module fqn: torch style}.
    styles: dict = {}
    for pattern, name in plan.layers.items():
        fqns = match(model, prefix, pattern)
        if not fqns and match(model, prefix, pattern, parameters=True):
            raise ConfigError(f"--tp {tp}: the {config.model_type} tensor-parallel plan "
                              f"shards the parameter {pattern} directly, which raylm does "
                              "not translate; run this model without --tp")
        for fqn, sub_name in [x for f in fqns for x in layer_styles(model, f, name)]:
            style = torch_style(sub_name, sp is not None, config)
            if style is not None:
                styles[fqn] = style
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight is emb.weight:
            styles[name] = RowwiseParallel(
                input_layouts=Replicate(),
                output_layouts=Shard(1) if sp else Replicate(), use_local_output=sp is None)
    head_fqn = names[id(head)]
    styles[head_fqn] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                       output_layouts=Shard(-1), use_local_output=False)
    if sp is not None:
        for pattern in sp.norms:
            for fqn in match(model, prefix, pattern):
                styles[fqn] = SequenceParallel()
        for pattern, arg in sp.inputs.items():
            if isinstance(arg, str):
                style = PrepareModuleInput(input_kwarg_layouts={arg: Shard(1)},
                                           desired_input_kwarg_layouts={arg: Replicate()})
            else:
                style = PrepareModuleInput(
                    input_layouts=(None,) * arg + (Shard(1),),
                    desired_input_layouts=(None,) * arg + (Replicate(),))
            for fqn in match(model, prefix, pattern):
                styles[fqn] = style
        for pattern in sp.positional:
            for fqn in match(model, prefix, pattern):
                styles[fqn] = PrepareModuleOutput(output_layouts=Replicate(),
                                                  desired_output_layouts=Shard(1),
                                                  use_local_output=False)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    parallelize_module(model, tp_mesh, styles, src_data_rank=src_data_rank)
    # torch's styles make every parameter they distribute trainable: frozen ones (a LoRA
    # run's base) stay frozen.
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in frozen:
            p.requires_grad_(False)

    # 5. Re-tie: point every holder of a tied parameter at one DTensor parameter.
    for hs in ties:
        params = [module._parameters[attr] for module, attr, _ in hs]
        dts = [p for p in params if isinstance(p, DTensor)]
        if not dts:
            continue
        keep = dts[0]
        for p in dts[1:]:
            if p.placements != keep.placements:
                raise RuntimeError(f"tied parameters {[f for _, _, f in hs]} were sharded "
                                   f"differently ({keep.placements} vs {p.placements})")
        for module, attr, _ in hs:
            setattr(module, attr, keep)

    if padded != vocab:
        _mask_padded_logits(head, vocab, padded, tp_mesh)
    _check_shapes(model, expected)  # 6.
    return TPState(mesh=tp_mesh, sequence_parallel=sp is not None, vocab_size=vocab,
                   padded_vocab_size=padded, source=source,
                   plan={k: repr(v) for k, v in styles.items()}, converted=tuple(converted),
                   fused=fused, vocab_params=vocab_fqns)

