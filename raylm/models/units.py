"""What a model is made of, for planning and cutting it: its units (the embeddings, each
block, the head) with their parameters and estimated forward FLOPs per token.

Works on a model built on the meta device (``meta_model``: no weights, any size is
instant). The planner balances pipeline stages over these units (raylm.plan.partition);
the pipeline cut keeps a rank's units (raylm.parallel.pipeline.stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from raylm.errors import ConfigError
from raylm.models.families import Family, family_of
from raylm.models.lora import add_lora, meta_base

if TYPE_CHECKING:
    from torch import nn

# torch (and torch.export, for the generic split) are imported where a model is built or
# split, not here: the planner imports Unit, and plain planning stays light.


@dataclass
class Unit:
    """One block (or the embeddings, or the head) and what it costs."""

    name: str
    params: int  # distinct parameters held
    flops: float  # forward FLOPs per token (estimate)
    # Of params, those trained (None: all): frozen ones (a LoRA run's base) have no
    # gradient and no optimizer state.
    trainable: Optional[int] = None

    @property
    def trained(self) -> int:
        return self.params if self.trainable is None else self.trainable


def _unit(name: str, params, flops: float) -> Unit:
    """A Unit of ``params`` (parameters), counting the trainable ones."""
    params = list(params)
    n = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    return Unit(name, n, flops, None if trained == n else trained)


def distinct_params(modules) -> dict:
    """{id: parameter} of ``modules`` (None skipped), each shared parameter once."""
    out = {}
    for m in modules:
        if m is not None:
            for p in m.parameters():
                out[id(p)] = p
    return out


HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads")  # a config's attention heads


def first_int(config, names) -> Optional[int]:
    """The first of the config attributes ``names`` that is a positive int (None: none)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def attention_width(config, hidden: int) -> int:
    """The width of a token's queries and attention output: heads x head_dim. Often the
    hidden size, but not where the config sets ``head_dim`` apart (Qwen3, Gemma, Mistral
    Nemo, and any Llama-type config given a smaller hidden size by --config_overrides,
    which keeps the default config's head_dim, as run_clm's update_from_string does) or
    T5's ``d_kv``. Where queries and keys are not as wide as values (DeepSeek's latent
    attention: ``qk_head_dim`` 192, ``v_head_dim`` 128, its ``head_dim`` the rotary part
    alone), the mean of the two: the scores take one, the weighted sum the other."""
    heads = first_int(config, HEAD_ATTRS)
    qk, v = first_int(config, ("qk_head_dim",)), first_int(config, ("v_head_dim",))
    head_dim = (qk + v) / 2 if qk and v else first_int(config, ("head_dim", "d_kv"))
    return int(heads * head_dim) if heads and head_dim else hidden


def _named_like(m, words) -> bool:
    return any(w in type(m).__name__ for w in words)


def attends(module: "nn.Module") -> bool:
    """Whether ``module`` computes attention scores, by its modules' classes: not where a
    state-space mixer (Mamba's ``MambaMixer``, ``Mamba2Mixer``) holds no attention module
    (``...Attention``, ``...Attn``): a Mamba block, or a hybrid's (Jamba's) Mamba layers.
    Anything else counts as attending, a block of unknown make included (a model of your
    own's), as before."""
    mods = list(module.modules())
    return (not any(_named_like(m, ("Mixer",)) for m in mods)
            or any(_named_like(m, ("Attention", "Attn")) for m in mods))


def attention_layers(model: "nn.Module", layers: int) -> float:
    """The share of a model's ``layers`` that attend (see ``attends``), for a model raylm
    cannot cut into blocks: its outermost attention modules over ``layers``, where it has
    state-space mixers; 1 otherwise."""
    if not any(_named_like(m, ("Mixer",)) for m in model.modules()):
        return 1.0
    outer, inside = 0, set()
    for name, m in model.named_modules():
        if _named_like(m, ("Attention", "Attn")) and not any(
                name.startswith(p + ".") for p in inside):
            outer += 1
            inside.add(name)
    return min(1.0, outer / max(1, layers))


def matmul_flops(params) -> float:
    # Forward multiply-adds of the weight matrices: 2 FLOPs per weight element per token.
    return float(sum(2 * p.numel() for p in params if p.ndim >= 2))


def family_units(model: nn.Module, family: Family, seq_len: int) -> tuple:
    """(embed, blocks, head) Units of a model of a known family (meta device is fine)."""
    cfg = model.config
    hidden = getattr(cfg, family.hidden_size_attr)
    embed = distinct_params(model.get_submodule(p) for p in family.embed)
    blocks = []
    for i, blk in enumerate(model.get_submodule(family.layers)):
        ps = list(distinct_params([blk]).values())
        # attention scores and their weighted sum: 2 x 2 x seq_len x heads x head_dim
        # per token
        blocks.append(_unit(f"{family.layers}.{i}", ps,
                            matmul_flops(ps) + 4.0 * seq_len * attention_width(cfg, hidden)))
    head_modules = [model.get_submodule(p) for p in family.final] + \
        [model.get_submodule(family.head)]
    head = distinct_params(head_modules)
    return (_unit("embeddings (" + ", ".join(family.embed) + ")", embed.values(), 0.0),
            blocks,
            _unit(", ".join(family.final + (family.head,)), head.values(),
                  matmul_flops(head.values())))


def meta_model(spec) -> nn.Module:
    """The model's structure with no weights (for planning; any size is instant)."""
    if getattr(spec, "model_init", None) is not None:  # (a model of the user's own)
        from raylm.models.custom import meta_custom

        return meta_custom(spec.model_init, spec.config)
    model = meta_base(spec.config, spec.trust_remote_code)
    lora = getattr(spec, "lora", None)
    return add_lora(model, lora, 0) if lora is not None else model


def model_units(model: nn.Module, seq_len: int) -> tuple:
    """(embeddings, blocks, head) Units of any model raylm can cut: a known family, T5,
    or any other model through the generic export path's block list."""
    family = family_of(model.config)
    if family is not None:
        return family_units(model, family, seq_len)
    if is_t5(model.config):
        from raylm.models.t5_stages import t5_units

        names = t5_units(model)
    else:
        names = layer_units(model)
    cfg = model.config
    hidden = next((getattr(cfg, a) for a in ("hidden_size", "d_model", "n_embd")
                   if isinstance(getattr(cfg, a, None), int)), 0)
    blocks = []
    for name in names:
        block = model.get_submodule(name)
        ps = list(distinct_params([block]).values())
        scores = 4.0 * seq_len * attention_width(cfg, hidden) if attends(block) else 0.0
        blocks.append(_unit(name, ps, matmul_flops(ps) + scores))
    head = distinct_params([model.get_output_embeddings()])
    in_blocks = distinct_params(model.get_submodule(n) for n in names)
    # Everything outside the blocks and the head (embeddings, position tables, final
    # norms) is counted with the first stage: an estimate, close for these models.
    embed = {i: p for i, p in distinct_params([model]).items()
             if i not in in_blocks and i not in head}
    return (_unit("input embeddings", embed.values(), 0.0), blocks,
            _unit("output head", head.values(), matmul_flops(head.values())))


def layer_units(model: nn.Module) -> list[str]:
    """The FQNs of the model's repeated blocks, in order (e.g. ``['gpt_neox.layers.0', ...]``):
    the units the pipeline cuts between (raylm.models.export_split).

    The blocks are the ``nn.ModuleList`` whose children are structurally identical (same
    class, same parameter names and shapes) and that holds the most parameters (then the
    most children). Lists nested inside another list's children, such as the experts of
    a mixture-of-experts block, are not candidates: a block's insides are not blocks.
    A model without such a list (a CNN, or Swin, whose stages are ``nn.Sequential``s of
    blocks that widen from stage to stage) has the same-type blocks of ``_runs``.
    Raises ConfigError if the model has neither.
    """
    from torch import nn

    lists = {name: mod for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) > 0}
    best, best_score = None, None
    for name, mod in lists.items():
        if any(name.startswith(other + ".") for other in lists if other != name):
            continue
        signatures = {_signature(child) for child in mod}
        if len(signatures) != 1:
            continue
        score = (sum(p.numel() for p in mod.parameters()), len(mod))
        if best_score is None or score > best_score:
            best, best_score = name, score
    if best is not None:
        return [f"{best}.{i}" for i in range(len(lists[best]))]
    names = {id(m): n for n, m in model.named_modules()}
    runs = [names[id(m)] for m in _runs(model)]
    if len(runs) < 2:
        raise ConfigError(
            f"{model_name(model)} has no repeated blocks (an nn.ModuleList of identical "
            "modules, or nn.Sequential / nn.ModuleList runs of one module type), so raylm "
            "cannot cut it into pipeline stages; train it without pipeline parallelism")
    return runs


def model_name(model: nn.Module) -> str:
    """The model's class, or for a model of the user's own its factory's name."""
    from raylm.models.custom import is_custom

    config = getattr(model, "config", None)
    return config.name if is_custom(config) else type(model).__name__


def _signature(module: nn.Module) -> tuple:
    return type(module), tuple((n, tuple(p.shape), p.dtype)
                               for n, p in module.named_parameters())


def transformer_blocks(model: nn.Module) -> list:
    """The repeated blocks of a model: the elements of its outermost ModuleLists of
    same-type modules that hold parameters (GPT-2's h, Llama's layers, T5's encoder and
    decoder blocks, BERT's layers); for a model with none, those of ``_runs`` (Swin's
    blocks, a CNN's residual blocks)."""
    from torch import nn

    return _same_type_children(model, (nn.ModuleList,)) or _runs(model)


def _same_type_children(model: nn.Module, kinds: tuple) -> list:
    """The children of the outermost containers of type ``kinds`` whose children are
    all of one type and hold parameters, in module order."""
    blocks, seen = [], set()

    def visit(module):
        for child in module.children():
            if isinstance(child, kinds) and len(child) > 0 and \
                    len({type(m) for m in child}) == 1 and \
                    any(True for _ in child[0].parameters()):
                for m in child:
                    if id(m) not in seen:
                        seen.add(id(m))
                        blocks.append(m)
                continue
            visit(child)

    visit(model)
    return blocks


def _runs(model: nn.Module) -> list:
    """Blocks of a model with no ModuleList of them: the children of its outermost
    ``nn.Sequential`` / ``nn.ModuleList`` containers that hold modules of one type, of
    the type with the most parameters there (at least two blocks), in module order.
    Swin's stages hold its blocks this way (torchvision's ``features.1``, ``features.3``,
    ...: the blocks widen from stage to stage, the patch merging between them sits
    outside), as a ResNet's ``layer1`` ... ``layer4`` hold its residual blocks."""
    from torch import nn

    by_type: dict = {}
    for m in _same_type_children(model, (nn.Sequential, nn.ModuleList)):
        by_type.setdefault(type(m), []).append(m)
    runs = [ms for ms in by_type.values() if len(ms) >= 2]  # (one module is no run)
    if not runs:
        return []
    return max(runs, key=lambda ms: sum(p.numel() for p in distinct_params(ms).values()))


def is_t5(config) -> bool:
    return getattr(config, "model_type", None) == "t5"


def has_own_stages(config) -> bool:
    """raylm cuts this model with its own stage modules (a known family, or T5), not the
    generic torch.export split."""
    return family_of(config) is not None or is_t5(config)
