"""A model reduced to the numbers the cost model needs, read once from its meta-device
build: block/embedding/head parameters (and which of them tensor parallelism shards),
forward FLOPs per token, dimensions and the activation recipe. Everything after this is
arithmetic, so a 70B model on a thousand workers plans in well under a second.

Tensor-parallel sharding, as Megatron-LM lays a transformer out: every matrix of a block
is split (column- or row-parallel); a bias is split with its column-parallel matrix and
replicated after a row-parallel one (the layers whose output is the hidden size); norms
are replicated; the token embedding and the output head are vocabulary-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raylm.models.tensor_plans import is_lora_layer, tensor_parallel_shapes
from raylm.models.units import (HEAD_ATTRS, Unit, attention_layers, attention_width, first_int,
                                has_own_stages, model_units)
from raylm.plan.activations import ActivationRecipe, recipe_for

HIDDEN_ATTRS = ("hidden_size", "n_embd", "d_model")
LAYER_ATTRS = ("num_hidden_layers", "n_layer", "num_layers")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
INTERMEDIATE_ATTRS = ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "ffn_hidden_size")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    seq_len: int
    total_params: int  # distinct parameters of the model
    embed: Unit  # the partition's units (parameters, forward FLOPs per token)
    blocks: tuple
    head: Unit
    block_split: tuple  # per block: parameters tensor parallelism shards
    embed_split: int  # of the embedding unit: the vocabulary-parallel table
    head_split: int  # of the head unit: the output projection
    tied: int  # parameters counted in both the embedding and the head unit (tied table)
    recipe: ActivationRecipe
    tensor_parallel: bool  # raylm can shard this model type over tp
    cuttable: bool  # raylm can cut it into pipeline stages
    own_stages: bool  # cut by raylm's own stages (a family, T5), not torch.export
    config: object = field(default=None, compare=False, repr=False)
    lora: bool = False  # LoRA adapters on its layers (raylm.models.lora)
    # Of the trained parameters when some are frozen (LoRA's adapters), the share that
    # tensor parallelism shards (lora_B of column-parallel layers, lora_A of row-parallel).
    trained_split_share: float = 0.0
    trainable_params: Optional[int] = None  # distinct trained parameters (None: all)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def tp_divides(self, tp: int) -> bool:
        return self.heads % tp == 0 and self.kv_heads % tp == 0


def _split_params(module, hidden: int) -> int:
    """Parameters of ``module`` that tensor parallelism shards (see the module doc)."""
    n = 0
    for sub in module.modules():
        own = dict(sub.named_parameters(recurse=False))
        w = own.get("weight")
        if w is None or w.ndim < 2:
            continue  # norms (and modules without a matrix) stay replicated
        n += w.numel()
        b = own.get("bias")
        if b is not None:
            out = w.shape[1] if type(sub).__name__ == "Conv1D" else w.shape[0]
            n += 0 if out == hidden else b.numel()
    return n


def tensor_parallel_supported(config) -> bool:
    """Model types raylm's tensor parallelism shards: those with a transformers tp plan,
    and GPT-2 (converted to linear layers)."""
    return bool(getattr(config, "base_model_tp_plan", None)) or config.model_type == "gpt2"


def model_shape(model, seq_len: int, use_gpu: bool = False) -> ModelShape:
    """Read a (meta-device) model once. Raises ValueError when the config names no hidden
    size (the cost model needs it)."""
    config = model.config
    hidden = first_int(config, HIDDEN_ATTRS)
    if not hidden:
        raise ValueError(f"model type '{config.model_type}': no hidden size in its config")
    heads = first_int(config, HEAD_ATTRS) or 1
    kv = first_int(config, KV_HEAD_ATTRS) or heads
    head_dim = first_int(config, ("head_dim",)) or hidden // heads
    inter = first_int(config, INTERMEDIATE_ATTRS) or 4 * hidden
    vocab = first_int(config, ("vocab_size",)) or 0
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    try:
        embed, blocks, head = model_units(model, seq_len)
        block_split = tuple(_split_params(model.get_submodule(u.name), hidden)
                            for u in blocks)
        cuttable = True
    except Exception:  # a model raylm cannot cut: one unit per layer count, no pipeline
        layers = first_int(config, LAYER_ATTRS) or 1
        per = total // layers
        scores = 4.0 * seq_len * attention_width(config, hidden) * attention_layers(
            model, layers)  # (a hybrid's Mamba layers have none: Jamba)
        blocks = [Unit(f"layer {i}", per, 2.0 * per + scores) for i in range(layers)]
        embed, head = Unit("embeddings", 0, 0.0), Unit("head", total - per * layers, 0.0)
        block_split = tuple(0 for _ in blocks)
        cuttable = False
    tied = max(0, embed.params + sum(u.params for u in blocks) + head.params - total)
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    # (an image model's input embedding is a patch projection: no ``weight`` of its own)
    emb_w, out_w = getattr(emb, "weight", None), getattr(out, "weight", None)
    emb_n = emb_w.numel() if emb_w is not None else 0
    out_n = out_w.numel() if out_w is not None else 0
    is_tied = emb_w is not None and out_w is not None and out_w is emb_w
    # A tied table sits in the embedding unit only where the units count it twice.
    embed_split = emb_n if (not is_tied or tied) else 0
    return ModelShape(
        model_type=config.model_type, hidden=hidden, heads=heads, kv_heads=kv,
        head_dim=head_dim, intermediate=inter, vocab=vocab, seq_len=seq_len,
        total_params=total, embed=embed, blocks=tuple(blocks), head=head,
        block_split=block_split, embed_split=min(embed_split, embed.params),
        head_split=min(out_n, head.params), tied=tied,
        recipe=recipe_for(config, hidden, heads, kv, head_dim, inter, vocab, use_gpu),
        tensor_parallel=tensor_parallel_supported(config), cuttable=cuttable,
        own_stages=has_own_stages(config), config=config,
        lora=any(is_lora_layer(m) for m in model.modules()),
        trained_split_share=_trained_split_share(model),
        trainable_params=_trainable(model, total))


def _trainable(model, total: int) -> Optional[int]:
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return None if n == total else n


def _trained_split_share(model) -> float:
    """The share of the trained parameters that tensor parallelism shards, when some
    parameters are frozen (0.0 otherwise, or when the model has no tensor-parallel
    plan): from the one model of what a plan shards (tensor_parallel_shapes)."""
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    if not trained or sum(trained.values()) == total:
        return 0.0
    try:
        shard = tensor_parallel_shapes(model, 2).shard
    except Exception:  # noqa: BLE001 - no plan for this model: nothing is sharded
        return 0.0
    return sum(n for name, n in trained.items() if name in shard) / sum(trained.values())
