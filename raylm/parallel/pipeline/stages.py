"""Cutting a Hugging Face model into pipeline stage modules that keep its parameter names.

Each rank builds the whole model (same seed, so the same weights as one process would
have), then keeps only what its stages use: ``prune`` drops every module whose parameters
no local stage needs, so the rank's model holds exactly its stages' parameters under the
model's own names (``transformer.h.3.attn.c_attn.weight``). Optimizer, checkpoints and
``save_pretrained`` work on that pruned model unchanged, which is what makes a checkpoint
independent of the layout that wrote it.

Stage modules are views of the pruned model: shallow copies of its container modules with
a few children swapped (blocks of other stages become pass-throughs; the embedding side is
stood in for on every stage but the first; the final norm is an identity on every stage
but the last), sharing every parameter with it. A tied weight (GPT-2's ``wte`` and
``lm_head``) is kept on every rank whose stages use it, under its canonical name; the
runtime sums its gradient between those ranks each step (raylm.parallel.pipeline.runtime).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from raylm.models.dropout import SampleDropout
from raylm.models.families import Family, family_of
from raylm.models.units import distinct_params, is_t5
from raylm.plan.partition import Partition


# -- stand-ins ---------------------------------------------------------------------------
class Skip(nn.Module):
    """A block of another stage: returns the hidden states it is given (as a 1-tuple
    for families whose blocks return tuples)."""

    def __init__(self, as_tuple: bool = False):
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.as_tuple else hidden_states


class ZeroEmbedding(nn.Module):
    """Position embeddings on a non-first stage: the received activation already has
    them, and the base forward adds this module's output to it."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class Passthrough(nn.Module):
    """A whole embeddings module on a non-first stage: returns inputs_embeds as is."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return inputs_embeds


def _stand_in(kind: str, config, family: Family) -> nn.Module:
    if kind == "zeros":
        return ZeroEmbedding(getattr(config, family.hidden_size_attr), torch.float32)
    if kind == "identity":
        return nn.Identity()
    return Passthrough()


# -- module surgery ----------------------------------------------------------------------
def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its children, parameters and buffers, whose child
    table can be changed without touching the original."""
    new = copy.copy(module)
    new._modules = dict(module._modules)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    return new


def _with_children(root: nn.Module, replacements: dict) -> nn.Module:
    """A view of ``root`` with the modules at the given dotted paths replaced."""
    view = _shallow(root)
    copied = {"": view}
    for path, new in replacements.items():
        parts = path.split(".")
        parent = view
        for i, part in enumerate(parts[:-1]):
            key = ".".join(parts[:i + 1])
            if key not in copied:
                copied[key] = _shallow(parent._modules[part])
                parent._modules[part] = copied[key]
            parent = copied[key]
        parent._modules[parts[-1]] = new
    return view


def prune(model: nn.Module, keep: set) -> None:
    """Drop, in place, every module holding parameters of which none is in ``keep`` (a set
    of parameter ids). Blocks in a ModuleList become ``Skip`` so indices and names stay."""
    def visit(module):
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            params = list(child.parameters())
            if not params:
                continue  # stateless (dropout, rotary tables): harmless to keep
            if not any(id(p) in keep for p in params):
                module._modules[name] = Skip() if isinstance(module, nn.ModuleList) else None
            else:
                visit(child)
    visit(model)


# -- the family mechanism ----------------------------------------------------------------
class FamilyStage(nn.Module):
    """One stage: the model's own base forward over a range of its blocks.

    forward(x, attention_mask=None): x is input_ids on the first stage and the received
    hidden states on the others; returns hidden states, or logits on the last stage.
    """

    def __init__(self, model: nn.Module, family: Family, bounds: tuple, first: bool,
                 last: bool):
        super().__init__()
        blocks = model.get_submodule(family.layers)
        a, b = bounds
        replace = {family.layers: nn.ModuleList(
            [blk if a <= i < b else Skip(family.tuple_blocks) for i, blk in enumerate(blocks)])}
        if not first:
            # The embedding side is not this stage's: its modules go (a view holding them
            # would hold their parameters), or are stood in for where the base forward
            # still calls them.
            for path in family.embed:
                replace[path] = None
            for path, kind in family.non_first.items():
                replace[path] = _stand_in(kind, model.config, family)
        if not last:
            for path in family.final:
                replace[path] = nn.Identity()
        root = _with_children(model, replace)
        self.base = root.get_submodule(family.base)
        self.head = root.get_submodule(family.head) if last else None
        self.first, self.last = first, last

    def forward(self, x, attention_mask=None):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.base(attention_mask=attention_mask, use_cache=False, **inputs)[0]
        return self.head(hidden) if self.last else hidden


class _Sendable(nn.Module):
    """Wraps a stage so that what it returns can go over the wire as is: gloo sends only
    contiguous tensors, and zero-bubble schedules detach outputs in place, which a view
    does not allow. An exported graph takes tensors only, so keyword inputs (meant for
    other kinds of stage) are dropped for it. With ``dropout`` set ([seed, step, sites,
    shards]) the stage runs its micro-batch (``sample_ids``: its rows' ids) inside
    SampleDropout."""

    def __init__(self, stage: nn.Module, takes_kwargs: bool):
        super().__init__()
        self.stage = stage
        self.takes_kwargs = takes_kwargs
        self.dropout = None

    def forward(self, *args, sample_ids=None, **kwargs):
        if (self.dropout is not None and sample_ids is not None and self.training
                and sample_ids.device.type != "meta"):
            seed, step, sites, shards = self.dropout
            with SampleDropout(seed, step, sample_ids.tolist(), sites, shards):
                return self._forward(args, kwargs)
        return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        out = self.stage(*args, **kwargs) if self.takes_kwargs else self.stage(*args)
        if isinstance(out, tuple):
            return tuple(_own(t) for t in out)
        return _own(out)


def _own(t):
    if not isinstance(t, torch.Tensor):
        return t
    return t.clone(memory_format=torch.contiguous_format) \
        if t._is_view() or not t.is_contiguous() else t


def _stage_factory(model: nn.Module, part: Partition, example_ids):
    """stage index -> stage module (train mode), and the eval-mode modules where the
    stage's mode is fixed when it is built (exported graphs), else None."""
    family = family_of(model.config)
    last = part.num_stages - 1
    if family is not None:
        return (lambda s: _Sendable(FamilyStage(model, family, part.bounds[s], s == 0,
                                                s == last), True)), None
    if is_t5(model.config):
        from raylm.models.t5_stages import t5_stage_modules
        mods = [_Sendable(m, True) for m in t5_stage_modules(model, part.bounds)]
        return (lambda s: mods[s]), None
    from raylm.models.export_split import export_stage_modules
    was_training = model.training
    model.train()
    train_mods = [_Sendable(m, False) for m in export_stage_modules(model, example_ids,
                                                                    part.bounds)]
    model.eval()
    eval_mods = [_Sendable(m, False) for m in export_stage_modules(model, example_ids,
                                                                   part.bounds)]
    model.train(was_training)
    return (lambda s: train_mods[s]), eval_mods


def cut(model: nn.Module, part: Partition, stages: list[int], example_ids=None) -> tuple:
    """This rank's stage modules, for every parameter name the pp ranks that use it, and
    this rank's eval-mode stage modules where they differ (else None).

    ``model`` is the full model (same weights on every rank); it is pruned in place to
    what ``stages`` use. Every rank computes the same holders table. ``example_ids``
    (micro-batch x sequence) is what a generic model is traced with."""
    make, eval_mods = _stage_factory(model, part, example_ids)
    names = {id(p): n for n, p in model.named_parameters()}  # canonical names
    holders: dict[str, set] = {}
    mods = {}
    for s in range(part.num_stages):
        mod = make(s)
        if s in stages:
            mods[s] = mod
        for p in mod.parameters():
            holders.setdefault(names[id(p)], set()).add(part.stage_rank[s])
    local = [mods[s] for s in stages]
    prune(model, set(distinct_params(local)))
    local_eval = [eval_mods[s] for s in stages] if eval_mods is not None else None
    return local, {n: sorted(r) for n, r in holders.items()}, local_eval
