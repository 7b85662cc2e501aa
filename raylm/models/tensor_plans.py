"""Tensor-parallel plans as data: per family, which module gets which style.

One generic mechanism (raylm.parallel.tensor.apply) reads these; a family is a few lines,
as in torchtitan's ``parallelize_llama``. Patterns are module paths relative to the
Hugging Face *base model* (``model.base_model``: ``transformer`` for GPT-2, ``model`` for
Llama, the model itself for T5), with ``*`` matching one path atom (fnmatch per atom),
exactly like the keys of transformers' ``config.base_model_tp_plan``. A pattern that
matches no module is skipped (plans list alternatives: T5's ``wi`` or ``wi_0``/``wi_1``).

Style names are transformers' own vocabulary (``"colwise"``, ``"rowwise"``, ...) so a
raylm plan and a Hugging Face plan go through the same translation (STYLES below).

The vocabulary-parallel embedding and LM head are not in these plans: every family gets
them from ``model.get_input_embeddings()`` / ``model.get_output_embeddings()``.

``tensor_parallel_shapes`` is the one model of what a plan does to each parameter's shape
(no process group: the planner's memory model and the ZeRO ownership table read it on the
meta model); ``apply_tensor_parallel`` pads the vocabulary as it says and checks every
parameter torch sharded against it.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from raylm.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

# Style names raylm translates into torch ParallelStyles
# (raylm.parallel.tensor.apply ``torch_style``), with the dim each shards: (nn.Linear
# weight, nn.Linear bias, nn.Embedding weight); None = replicated.
# Semantics follow transformers' own registry (transformers.distributed.tensor_parallel
# ALL_PARALLEL_STYLES), so a Hugging Face plan means here what it means there.
#   colwise                         ColwiseParallel: weight rows (output features) sharded,
#                                   input replicated, output sharded on the last dim (local)
#   rowwise                         RowwiseParallel: weight columns sharded, input sharded on
#                                   the last dim, output summed (replicated, or sequence
#                                   shards under sequence parallelism)
#   colwise_gather_output           ColwiseParallel with the output all-gathered (HF);
#   colwise_rep                     the same under its other HF name
#   rowwise_split_input             RowwiseParallel taking a replicated input (HF);
#   rowwise_rep                     the same under its other HF name
#   embedding_rowwise               a vocabulary-parallel nn.Embedding: rows sharded, the
#                                   ranks' partial lookups summed (HF)
#   embedding_colwise               an nn.Embedding sharded on its embedding dim, the slices
#                                   gathered into a replicated output (HF)
#   embedding_colwise_local         raylm's: sharded on the embedding dim, output kept local
#                                   (T5's relative_attention_bias: one column per head, and
#                                   each rank computes its own heads)
#   replicated_with_grad_allreduce  a replicated module applied to head-local activations
#                                   (Qwen3's q_norm/k_norm): gradient summed over tp (HF)
#   all_reduce                      a module whose output is a partial sum over tp ranks
#                                   (its inner layers row-parallel to a partial result): the
#                                   output is summed (HF)
#   mla_kv_a_proj                   multi-head latent attention's replicated kv_a projection:
#                                   its rotary slice feeds head-local attention, so that
#                                   slice's gradient is summed over tp (HF)
#   replicate                       the module stays whole on every rank (HF)
STYLES = {
    "colwise": (0, 0, 1),
    "rowwise": (1, None, 0),
    "colwise_gather_output": (0, 0, 1),
    "colwise_rep": (0, 0, 1),
    "rowwise_split_input": (1, None, 0),
    "rowwise_rep": (1, None, 0),
    "embedding_rowwise": (None, None, 0),
    "embedding_colwise": (None, None, 1),
    "embedding_colwise_local": (None, None, 1),
    "replicated_with_grad_allreduce": (None, None, None),
    "all_reduce": (None, None, None),
    "mla_kv_a_proj": (None, None, None),
    "replicate": (None, None, None),
}

# Styles of transformers' plans that raylm refuses, with the reason the error gives.
NOT_TRANSLATED = {
    "moe_tp_experts": "mixture-of-experts layers are not tensor-parallel in raylm yet",
    "moe_identity_expert": "mixture-of-experts layers are not tensor-parallel in raylm yet",
    "packed_colwise": "packed expert weights (mixture of experts) are not tensor-parallel in "
                      "raylm yet",
    "packed_rowwise": "packed expert weights (mixture of experts) are not tensor-parallel in "
                      "raylm yet",
    "local_params": "modules run on local parameter shards (attention sinks) are not "
                    "tensor-parallel in raylm yet",
}


def shard_dim(style: str, embedding: bool, pname: str):
    """The dim of parameter ``pname`` ("weight", "bias") of an nn.Linear (or nn.Embedding
    when ``embedding``) that ``style`` shards, or None when it stays replicated."""
    linear_weight, linear_bias, embedding_weight = STYLES[style]
    if embedding:
        return embedding_weight if pname == "weight" else None
    return {"weight": linear_weight, "bias": linear_bias}.get(pname)


@dataclass(frozen=True)
class SequenceParallelPlan:
    """What changes under ``--sequence_parallel``: between blocks, activations are
    sequence shards (Shard(1) DTensors); norms and dropouts run on them; a block's
    attention and MLP gather the sequence on entry and their row-parallel output layers
    reduce-scatter back to sequence shards."""

    norms: tuple  # torch SequenceParallel
    inputs: dict  # module -> argument (position or keyword) carrying its hidden states
    positional: tuple = ()  # position embeddings added to the (sharded) token embeddings


@dataclass(frozen=True)
class Plan:
    layers: dict  # pattern -> style name
    # Attributes the Hugging Face forward uses as *global* sizes that must become local
    # (divided by tp), e.g. GPT-Neo's num_heads in its head split.
    local_attrs: dict = field(default_factory=dict)
    # Fused projections (after GPT-2's Conv1D -> nn.Linear): pattern -> number of fused
    # parts. Their output rows are reordered so that each rank's contiguous shard holds
    # its own slice of every part (q_r, k_r, v_r).
    fused: dict = field(default_factory=dict)
    sequence_parallel: Optional[SequenceParallelPlan] = None
    # A language model's input embedding and LM head are sharded on the (padded)
    # vocabulary, its loss vocabulary-parallel. False (an image classifier): the plan's
    # layers only, the head whole (its logits, and so its loss, as without tp).
    vocabulary: bool = True


_GPT2_SP = SequenceParallelPlan(norms=("h.*.ln_1", "h.*.ln_2", "ln_f"),
                                inputs={"h.*.attn": 0, "h.*.mlp": 0}, positional=("wpe",))

_BERT = Plan(
    layers={
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    local_attrs={"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")},
)

_T5_LAYERS: dict = {}
for _stack in ("encoder", "decoder"):
    for _att in ("SelfAttention", "EncDecAttention"):
        for _p in ("q", "k", "v"):
            _T5_LAYERS[f"{_stack}.block.*.layer.*.{_att}.{_p}"] = "colwise"
        _T5_LAYERS[f"{_stack}.block.*.layer.*.{_att}.o"] = "rowwise"
    for _p in ("wi", "wi_0", "wi_1"):
        _T5_LAYERS[f"{_stack}.block.*.layer.*.DenseReluDense.{_p}"] = "colwise"
    _T5_LAYERS[f"{_stack}.block.*.layer.*.DenseReluDense.wo"] = "rowwise"
    # The relative position bias has one column per head: each rank keeps its heads'.
    _T5_LAYERS[f"{_stack}.block.0.layer.0.SelfAttention.relative_attention_bias"] = \
        "embedding_colwise_local"


def _vit_like(layers: str) -> Plan:
    """The plan of a ViT-like encoder whose blocks are ``layers``.*: each block's
    attention heads (q, k, v column-parallel, o row-parallel) and MLP split."""
    return Plan(layers={f"{layers}.*.attention.q_proj": "colwise",
                        f"{layers}.*.attention.k_proj": "colwise",
                        f"{layers}.*.attention.v_proj": "colwise",
                        f"{layers}.*.attention.o_proj": "rowwise",
                        f"{layers}.*.mlp.fc1": "colwise", f"{layers}.*.mlp.fc2": "rowwise"},
                vocabulary=False)


# raylm's own plans, for families transformers has no base_model_tp_plan for.
RAYLM_PLANS = {
    "gpt2": Plan(
        layers={"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise",
                "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        # split_size: the width of each of q, k, v in c_attn's (now local) output.
        local_attrs={"h.*.attn": ("split_size", "num_heads")},
        fused={"h.*.attn.c_attn": 3},
        sequence_parallel=_GPT2_SP,
    ),
    "gpt_neo": Plan(
        layers={"h.*.attn.attention.q_proj": "colwise", "h.*.attn.attention.k_proj": "colwise",
                "h.*.attn.attention.v_proj": "colwise",
                "h.*.attn.attention.out_proj": "rowwise",
                "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
        local_attrs={"h.*.attn.attention": ("num_heads",)},
        sequence_parallel=_GPT2_SP,
    ),
    "bert": _BERT,
    "roberta": _BERT,
    # ViT and its kin (image classifiers): their attention splits heads by view(..., -1,
    # head_dim), so the local projections need no sizes changed; the classifier head
    # stays whole. (Dinov2's SwiGLU MLP, use_swiglu_ffn, fuses its gate and up
    # projections in one layer, which a column split would mix: it matches no entry and
    # stays whole on every rank.) BEiT is not here: its relative position bias is a
    # table per head that a head split would have to cut too.
    "vit": _vit_like("layers"),
    "deit": _vit_like("layers"),
    "dinov2": _vit_like("encoder.layer"),
    "t5": Plan(layers=_T5_LAYERS,
               local_attrs={"*.block.*.layer.*.SelfAttention": ("n_heads", "inner_dim"),
                            "*.block.*.layer.*.EncDecAttention": ("n_heads", "inner_dim")}),
}

# Sequence parallelism for families planned by transformers' base_model_tp_plan whose
# decoder layer is Llama's (input_layernorm -> self_attn(hidden_states=...) ->
# post_attention_layernorm -> mlp(hidden) -> final norm).
_LLAMA_SP = SequenceParallelPlan(
    norms=("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "norm"),
    inputs={"layers.*.self_attn": "hidden_states", "layers.*.mlp": 0})
HF_SEQUENCE_PARALLEL = {"llama": _LLAMA_SP, "mistral": _LLAMA_SP, "qwen2": _LLAMA_SP}


def plan_for(config) -> tuple[Optional[Plan], str]:
    """(plan, source) for a model config; source is "raylm", "transformers", or "user" (a
    model of the user's own with the plan they gave). The plan is None when there is
    none."""
    model_type = getattr(config, "model_type", None)
    if model_type == "custom":  # a model of the user's own: the plan they passed, if any
        user = getattr(config, "tp_plan", None)
        return (Plan(layers={f"module.{k}": v for k, v in user.items()}, vocabulary=False),
                "user") if user \
            else (None, "")
    if model_type in RAYLM_PLANS:
        return RAYLM_PLANS[model_type], "raylm"
    hf = getattr(config, "base_model_tp_plan", None)
    if hf:
        return Plan(layers=dict(hf), sequence_parallel=HF_SEQUENCE_PARALLEL.get(model_type)), \
            "transformers"
    return None, ""


def layers_only(config) -> bool:
    """Whether the model's plan shards its layers only (Plan.vocabulary False: a model of
    your own's, an image classifier's): what the stage graphs of the export split take."""
    plan, _ = plan_for(config)
    return plan is not None and not plan.vocabulary


def unsupported_styles(plan: Plan) -> dict:
    """pattern -> style for the plan entries raylm does not translate."""
    return {k: v for k, v in plan.layers.items() if v not in STYLES}


# -- checks and matching (no torch.distributed: the driver and the planner use them) ------
def check_tensor_parallel(config, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ConfigError (one line) when ``config`` cannot be split ``tp`` ways."""
    if tp <= 1:
        return
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if model_type == "custom":  # (raylm.models.custom)
        if not getattr(config, "tp_plan", None):
            raise ConfigError(f"--tp {tp}: the model_init model {config.name} has no "
                              "tensor-parallel plan: pass one, train(..., tp_plan={'blocks.*."
                              "up': 'colwise', 'blocks.*.down': 'rowwise'}), or leave --tp "
                              "unset: data and pipeline parallelism and ZeRO apply")
        if sequence_parallel:
            raise ConfigError("--sequence_parallel is not available for a model of your own "
                              "(tp_plan shards its layers only)")
        for fqn, (size, what) in (config.tp_sizes or {}).items():
            if size % tp:
                raise ConfigError(f"--tp {tp} must divide the {what} of {fqn} ({size}), "
                                  "which tp_plan shards")
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads:
        raise ConfigError(f"--tp {tp}: cannot tell the attention heads of model type "
                          f"'{model_type}'")
    if heads % tp or kv_heads % tp:
        raise ConfigError(f"--tp {tp} must divide the attention heads ({heads}) and the "
                          f"key-value heads ({kv_heads}) of this {model_type} model")
    plan, _ = plan_for(config)
    if plan is None:
        raise ConfigError(
            f"--tp {tp}: model type '{model_type}' has no tensor-parallel plan (raylm plans: "
            f"{', '.join(sorted(RAYLM_PLANS))}; or any model whose config has transformers' "
            "base_model_tp_plan)")
    bad = unsupported_styles(plan)
    if bad:
        pattern, style = next(iter(bad.items()))
        why = NOT_TRANSLATED.get(style, f"raylm translates {', '.join(STYLES)}")
        raise ConfigError(
            f"--tp {tp}: the {model_type} tensor-parallel plan shards {pattern} as "
            f"'{style}', which raylm does not translate ({why}); run this model without --tp")
    if sequence_parallel and plan.sequence_parallel is None:
        supported = sorted([t for t, p in RAYLM_PLANS.items() if p.sequence_parallel]
                           + list(HF_SEQUENCE_PARALLEL))
        raise ConfigError(f"--sequence_parallel is not supported for model type "
                          f"'{model_type}' (supported: {', '.join(supported)})")


def base_prefix(model: nn.Module) -> str:
    """Path of the HF base model inside ``model`` (plan keys are relative to it)."""
    base = getattr(model, "base_model", model)
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name
    return ""


def match(model: nn.Module, prefix: str, pattern: str, parameters: bool = False) -> list:
    """Module fqns matching ``pattern`` (relative to ``prefix``; ``*`` = one atom); with
    ``parameters``, parameter fqns instead."""
    full = f"{prefix}.{pattern}" if prefix else pattern
    atoms = full.split(".")
    out = []
    named = model.named_parameters() if parameters else model.named_modules()
    for name, _ in named:
        parts = name.split(".")
        if name and len(parts) == len(atoms) and all(
                fnmatch.fnmatchcase(a, p) for a, p in zip(parts, atoms)):
            out.append(name)
    return out


# Under sequence parallelism a row-parallel layer's output is a sequence-sharded DTensor,
# which the plain lora_B beside it does not take.
LORA_SP = ("sequence parallelism with LoRA adapters is not supported yet; drop "
           "--sequence_parallel (tensor parallelism alone shards the adapters)")
COLUMN_STYLES = ("colwise", "colwise_gather_output", "colwise_rep")
ROW_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep")


def is_lora_layer(module) -> bool:
    """A layer peft wrapped in a LoRA layer (raylm.models.lora): the original is its
    ``base_layer``, the adapters its ``lora_A`` / ``lora_B``."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def layer_styles(model: nn.Module, fqn: str, style: str) -> list:
    """[(module fqn, style)] that a plan entry of ``fqn`` shards: the module itself, or for
    a LoRA layer the layer it wraps and its adapters, sharded with it. Under a
    column-parallel layer ``lora_B`` is column-parallel (its output shard is the
    layer's) and ``lora_A`` whole; under a row-parallel layer ``lora_A`` is row-parallel
    (its input is the layer's input shard; its output summed over tp) and ``lora_B``
    whole. (Megatron-style LoRA, e.g. NeMo's, splits adapters the same way.)"""
    module = model.get_submodule(fqn)
    if not is_lora_layer(module):
        return [(fqn, style)]
    if style in COLUMN_STYLES:
        kind = "lora_B"
    elif style in ROW_STYLES:
        kind = "lora_A"
    else:
        raise ConfigError(f"--use_peft with --tp: {fqn} is tensor-parallel as '{style}', and "
                          "raylm shards LoRA adapters only with column- or row-parallel "
                          "layers; leave it out of --lora_target_modules")
    return [(f"{fqn}.base_layer", style)] + \
        [(f"{fqn}.{kind}.{name}", style) for name in getattr(module, kind)]


# -- what a plan does to each parameter's shape ---------------------------------------------
@dataclass(frozen=True)
class TensorParallelShapes:
    """What tensor parallelism of degree ``tp`` makes of each distinct parameter of a model
    (canonical names, ``named_parameters()``): ``shapes`` its global shape at run time
    (GPT-2's Conv1D weights as nn.Linear, [out, in]; the input embedding, the LM head
    and its bias padded on the vocabulary to a multiple of tp) and ``shard`` the dim tp
    splits it on (DTensor ``Shard(dim)``, torch.chunk's split); a name not in ``shard``
    is replicated."""

    tp: int
    vocab_size: int
    padded_vocab_size: int
    shapes: dict
    shard: dict

    def local(self, tp_rank: int) -> dict:
        """{parameter name: local shape} on tensor-parallel rank ``tp_rank``."""
        out = dict(self.shapes)
        for name, dim in self.shard.items():
            shape = out[name]
            if dim < len(shape):
                per = math.ceil(shape[dim] / self.tp)
                start = min(tp_rank * per, shape[dim])
                out[name] = shape[:dim] + (min(start + per, shape[dim]) - start,) + \
                    shape[dim + 1:]
        return out


def tensor_parallel_shapes(model: nn.Module, tp: int) -> TensorParallelShapes:
    """The shapes and shard dims ``tp``-way tensor parallelism gives ``model``'s
    parameters (the whole model, before any pipeline cut; on the meta device or real).
    The rules: GPT-2's Conv1D layers become nn.Linear (W transposed); a plan's colwise
    layers shard weight and bias on dim 0 (an nn.Embedding on dim 1), rowwise layers the
    weight on dim 1 (bias replicated, an nn.Embedding on dim 0), as ``STYLES`` lists;
    the input embedding, the LM head and its bias are sharded on the vocabulary, padded
    to a multiple of tp; everything else is replicated. tp <= 1: the model as it is."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    shapes = {n: tuple(int(x) for x in p.shape) for n, p in model.named_parameters()}
    plan, _ = plan_for(model.config)
    # (a model of the user's own, an image classifier: the plan's layers only; no
    # vocabulary-parallel pair)
    vocabulary = tp > 1 and plan is not None and plan.vocabulary
    emb, head = (model.get_input_embeddings(), model.get_output_embeddings()) \
        if vocabulary or tp <= 1 else (None, None)
    # (an image model's input embedding is a patch projection: no vocabulary)
    weight = getattr(emb, "weight", None)
    vocab = int(weight.shape[0]) if isinstance(weight, nn.Parameter) else 0
    if tp <= 1:
        return TensorParallelShapes(max(tp, 1), vocab, vocab, shapes, {})
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if isinstance(module, Conv1D):
            n = names[id(module.weight)]
            shapes[n] = shapes[n][::-1]
    shard: dict = {}
    if plan is not None:
        prefix = base_prefix(model)
        for pattern, style in plan.layers.items():
            if style not in STYLES:
                continue  # refused by check_tensor_parallel before anything is built
            for fqn, st in [x for f in match(model, prefix, pattern)
                            for x in layer_styles(model, f, style)]:
                module = model.get_submodule(fqn)
                embedding = isinstance(module, nn.Embedding)
                for pname, p in module.named_parameters(recurse=False):
                    dim = shard_dim(st, embedding, pname)
                    if dim is not None:
                        shard[names[id(p)]] = dim
    padded = math.ceil(vocab / tp) * tp
    on_vocab = [emb.weight] if emb is not None else []
    if head is not None:
        on_vocab += [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None
                                     else [])
    for p in on_vocab:  # vocabulary-parallel, padded to a multiple of tp
        n = names[id(p)]
        shapes[n] = (math.ceil(shapes[n][0] / tp) * tp, *shapes[n][1:])
        shard[n] = 0
    return TensorParallelShapes(tp, vocab, padded, shapes, shard)
