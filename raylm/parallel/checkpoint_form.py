"""The layout-free checkpoint form of a rank's state, in one place.

A raylm checkpoint is written by torch.distributed.checkpoint (DCP) keyed by the model's
own parameter names, and must load under any layout (dp, tp = 1, 2, 4, pipeline stages
holding subsets of the names, ZeRO 0-3): the same form is what a regroup reads from the
live ranks' memory (raylm.checkpoint.memory). DCP reshards a DTensor into any other
sharding of the *same global shape*, so every tensor is presented in a global shape that
does not depend on the layout. This module turns a rank's runtime tensors into that form
and back; raylm.checkpoint.state writes and reads it.

* **Tensor parallelism** (``CanonicalAdapter``, one rule per parameter):
  - the vocabulary unpadded: a padded [V_pad, ...] Shard(0) becomes [V, ...] with uneven
    shards (the last rank drops its zero rows; torch's chunking of V gives the same
    split);
  - HF orientation: a GPT-2 Conv1D turned nn.Linear ([out, in]) is shown as [in, out];
  - GPT-2's fused c_attn as the view [H, 3, H] (weight) / [3, H] (bias), Shard on the
    last dim: each rank holds a column block of each of q, k and v, which is no DTensor
    shard of [H, 3H] but is one of [H, 3, H]. That view applies without tensor
    parallelism too, so a GPT-2 checkpoint looks the same from every layout.
  Canonical tensors are views of the runtime tensors (no copy to save);
  ``from_canonical`` writes loaded values back explicitly, whether or not DCP loaded
  through the views. Optimizer state keys (``state.<param fqn>.<name>``) follow their
  parameter when their shape is the parameter's.
* **ZeRO-3 with tensor parallelism**: a parameter is a DTensor over (dp, tp), each rank
  holding its FSDP rows of its tp shard. ``tp_shard_of`` gathers it over dp into the tp
  shard (what the adapter speaks), ``write_rows_back`` returns a tp shard's rows to the
  rank.
* **ZeRO 1/2** (``PartitionedOptimizerForm``): the partitioned optimizer's state in the
  keys and global shapes an unpartitioned optimizer's would have.
* **The whole rank** (``RankStateForm``): model and optimizer state dicts (optimizer
  state flattened to one key per parameter and setting, so pipeline stages write
  disjoint keys) through all of the above, ``{"model": ..., "optim": ...}``, and the way
  back after DCP loaded into it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from raylm.models.tensor_plans import RAYLM_PLANS, base_prefix, is_lora_layer, match
from raylm.parallel.data import local_tensor
from raylm.plan.zero import owned_rows


# -- a (dp, tp) DTensor and its tp shard ---------------------------------------------------
def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (a DTensor's global stride)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def tp_shard_of(value):
    """A ZeRO-3 tensor under tensor parallelism (a DTensor over (dp, tp): each rank holds
    its FSDP rows of its tensor-parallel shard) as the tensor-parallel DTensor alone (on
    the tp mesh, the rank's whole tp shard): gathered over dp, a transient copy. (A tp
    shard split on dim 0 is FSDP's ``_StridedShard`` over dp; redistribute handles it.)"""
    mesh = value.device_mesh
    tp_mesh, pl = mesh[mesh.mesh_dim_names[-1]], value.placements[-1]
    whole = value.redistribute(placements=[Replicate()] * (mesh.ndim - 1) + [pl])
    return DTensor.from_local(whole.to_local(), tp_mesh, [pl], shape=value.shape,
                              stride=value.stride(), run_check=False)


@torch.no_grad()
def write_rows_back(value, whole) -> None:
    """The inverse of ``tp_shard_of``: copy this rank's dp rows of ``whole`` (the rank's
    tp shard as loaded, a DTensor on the tp mesh, or a plain tensor of the rows) into
    ``value``'s local tensor (the rows split over dp as torch.chunk splits them, as FSDP
    and Shard(0) do: raylm.plan.zero.owned_rows; a local slice, no communication)."""
    mesh = value.device_mesh
    full = whole.to_local() if isinstance(whole, DTensor) else whole
    a, b = owned_rows(full.shape[0], mesh.size(0), mesh.get_local_rank(0))
    local = value.to_local()
    local.copy_(full[a:b].reshape_as(local))


# -- tensor parallelism: the canonical adapter ---------------------------------------------
def _make(local: torch.Tensor, like: DTensor, placement, shape) -> DTensor:
    shape = tuple(int(n) for n in shape)
    return DTensor.from_local(local, like.device_mesh, [placement], shape=torch.Size(shape),
                              stride=contiguous_stride(shape), run_check=False)


def _one_dim(t: DTensor):
    if len(t.placements) != 1:
        raise NotImplementedError("canonical form: tensors on a 1-D (tp) mesh only")
    return t.placements[0]


class _Vocab:
    """dim 0 is the vocabulary, padded to a multiple of tp: drop the padding rows."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def canonical(self, t):
        if not isinstance(t, DTensor):
            return t[:self.vocab]
        pl, local = _one_dim(t), t.to_local()
        shape = (self.vocab, *t.shape[1:])
        if isinstance(pl, Shard) and pl.dim == 0:
            per = t.shape[0] // t.device_mesh.size()
            real = max(0, min(per, self.vocab - t.device_mesh.get_local_rank() * per))
            return _make(local[:real], t, Shard(0), shape)
        if pl.is_replicate():
            return _make(local[:self.vocab], t, Replicate(), shape)
        raise NotImplementedError(f"vocabulary tensor placed {pl}")

    def to_hf(self, full):
        return full


class _Transposed:
    """A Conv1D turned nn.Linear: runtime [out, in], HF [in, out]."""

    def canonical(self, t):
        if not isinstance(t, DTensor):
            return t.t()
        pl = _one_dim(t)
        if isinstance(pl, Shard):
            pl = Shard(1 - pl.dim % 2)
        return _make(t.to_local().t(), t, pl, (t.shape[1], t.shape[0]))

    def to_hf(self, full):
        return full


class _Fused:
    """A fused projection of ``parts`` outputs (GPT-2's c_attn: q, k, v of width n).

    Runtime (tp, nn.Linear): weight [parts*n, in] Shard(0), each rank's rows
    [p0_r; p1_r; ...]; bias [parts*n] likewise. Runtime without tp (Conv1D): weight
    [in, parts*n], bias [parts*n]. Canonical: [in, parts, n] / [parts, n], Shard(-1)."""

    def __init__(self, parts: int, conv1d: bool):
        self.parts, self.conv1d = parts, conv1d

    def canonical(self, t):
        k = self.parts
        if self.conv1d:  # a plain Conv1D tensor, the canonical form is a view
            if t.ndim == 1 and isinstance(t, DTensor) and \
                    any(pl.is_shard() for pl in t.placements):
                # A bias split by rows over dp (ZeRO): its [parts, n] form is no DTensor
                # shard of the rows; use the whole (small) bias, written back by rows.
                t = t.redistribute(placements=[Replicate()] * len(t.placements))
            return t.view(t.shape[0], k, -1) if t.ndim == 2 else t.view(k, -1)
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(t, DTensor) and not (isinstance(_one_dim(t), Shard)
                                           and _one_dim(t).dim == 0):
            raise NotImplementedError(f"fused projection placed {t.placements}")
        if t.ndim == 2:
            n, inp = t.shape[0] // k, t.shape[1]
            local = local.view(k, -1, inp).permute(2, 0, 1)  # [in, parts, n_local]
            shape, pl = (inp, k, n), Shard(2)
        else:
            n = t.shape[0] // k
            local = local.view(k, -1)
            shape, pl = (k, n), Shard(1)
        return _make(local, t, pl, shape) if isinstance(t, DTensor) else local

    def to_hf(self, full):
        return full.reshape(full.shape[0], -1) if full.ndim == 3 else full.reshape(-1)


class _FusedRows:
    """The rows of a fused projection's outputs in a matrix of their own: a LoRA
    adapter's ``lora_B`` [parts*n, r] under GPT-2's c_attn (its rows are c_attn's
    outputs, reordered per rank under tensor parallelism as c_attn's are). Canonical:
    [parts, n, r], Shard(1) under tp (each rank's rows [p0_r; p1_r; ...] are a shard of
    that view, as for _Fused)."""

    def __init__(self, parts: int, tp: bool):
        self.parts, self.tp = parts, tp

    def canonical(self, t):
        k = self.parts
        if not self.tp:
            if isinstance(t, DTensor) and any(pl.is_shard() for pl in t.placements):
                # Rows split over dp (ZeRO-3): the [parts, n, r] form is no DTensor
                # shard of them; use the whole (small) adapter, written back by rows.
                t = t.redistribute(placements=[Replicate()] * len(t.placements))
            return t.view(k, -1, t.shape[-1])
        if not isinstance(t, DTensor):
            return t.view(k, -1, t.shape[-1])
        pl = _one_dim(t)
        if not (isinstance(pl, Shard) and pl.dim == 0):
            raise NotImplementedError(f"fused rows placed {t.placements}")
        local = t.to_local()
        return _make(local.view(k, -1, local.shape[-1]), t, Shard(1),
                     (k, t.shape[0] // k, t.shape[-1]))

    def to_hf(self, full):
        return full.reshape(-1, full.shape[-1])


def _write_back(dest, value: torch.Tensor) -> None:
    """When a canonical form is a copy rather than a view (a dp-sharded fused bias), put
    the rows of ``dest`` back from the whole ``value``."""
    local = dest.to_local() if isinstance(dest, DTensor) else dest
    if not isinstance(dest, DTensor) or local.data_ptr() == value.data_ptr():
        return
    flat = value.reshape(-1)
    if local.numel() == flat.numel():
        if local.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            local.copy_(flat.view_as(local))
        return
    write_rows_back(dest, value.reshape(dest.shape))


class CanonicalAdapter:
    """Runtime tensors <-> checkpoint (canonical) tensors, by state-dict key.

    to_canonical(sd) -> {key: canonical tensor}: views (DTensors where the runtime tensor
        is one, built with ``from_local(shape=, stride=)``); keys without a rule as they are.
    from_canonical(canon, sd): copy the (loaded) canonical values back into sd's tensors.
    hf_state_dict(model): collective over tp; the whole model's state in Hugging Face
        names, shapes and orientation, unpadded, as plain CPU tensors.
    """

    def __init__(self, rules: dict, shapes: dict):
        self.rules = rules  # param fqn -> rule
        self.shapes = shapes  # param fqn -> runtime global shape

    @property
    def identity(self) -> bool:
        return not self.rules

    def rule(self, key: str, value):
        fqn = key[len("state."):].rpartition(".")[0] if key.startswith("state.") else key
        rule = self.rules.get(fqn)
        if rule is None or not isinstance(value, torch.Tensor):
            return None
        if tuple(value.shape) != self.shapes.get(fqn):
            return None  # e.g. an optimizer's scalar "step"
        return rule

    def to_canonical(self, sd: dict) -> dict:
        out = {}
        for key, value in sd.items():
            rule = self.rule(key, value)
            out[key] = rule.canonical(value) if rule is not None else value
        return out

    @torch.no_grad()
    def from_canonical(self, canon: dict, sd: dict) -> None:
        for key, dest in sd.items():
            rule = self.rule(key, dest)
            if rule is None or key not in canon:
                continue
            view, src = rule.canonical(dest), canon[key]
            if isinstance(view, DTensor):
                view = view.to_local()
            if isinstance(src, DTensor):
                src = src.to_local()
            if view.data_ptr() == src.data_ptr() and view.stride() == src.stride():
                continue  # DCP loaded through the view: already in place
            view.copy_(src)
            _write_back(dest, view)

    @torch.no_grad()
    def hf_state_dict(self, model: nn.Module, keep: bool = True) -> dict:
        """``keep=False``: take part in the collectives only (a rank that does not save).
        Under ZeRO-3 with tensor parallelism a tensor sharded over (dp, tp) is first
        gathered over dp into its tp shard."""
        out = {}
        for key, value in model.state_dict().items():
            if isinstance(value, DTensor) and value.device_mesh.ndim > 1:
                value = tp_shard_of(value)
            rule = self.rule(key, value)
            if rule is not None:
                value = rule.canonical(value)
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if rule is not None:
                full = rule.to_hf(full)
            if keep:
                out[key] = full.detach().cpu().clone(memory_format=torch.contiguous_format)
        return out


def canonical_adapter(model: nn.Module, tps=None) -> CanonicalAdapter:
    """The adapter for ``model`` as it is now (after tensor parallelism, if ``tps``, and
    after any pipeline cut: rules for parameters the rank does not hold never match)."""
    from transformers.pytorch_utils import Conv1D


    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters(remove_duplicate=False)}
    rules: dict = {}
    if tps is None:
        plan = RAYLM_PLANS.get(getattr(model.config, "model_type", None))
        if plan is not None:
            prefix = base_prefix(model)
            for pattern, parts in plan.fused.items():
                for fqn in match(model, prefix, pattern):
                    module = model.get_submodule(fqn)
                    if is_lora_layer(module):  # (LoRA: the wrapped layer, its lora_B)
                        for name in module.lora_B:
                            rules[f"{fqn}.lora_B.{name}.weight"] = _FusedRows(parts, False)
                        fqn, module = f"{fqn}.base_layer", module.base_layer
                    if isinstance(module, Conv1D):
                        rules[f"{fqn}.weight"] = rules[f"{fqn}.bias"] = _Fused(parts, True)
    else:
        if tps.padded_vocab_size != tps.vocab_size:
            for fqn in tps.vocab_params:
                rules[fqn] = _Vocab(tps.vocab_size)
        for fqn, parts in tps.fused.items():
            if fqn not in tps.converted:  # a LoRA lora_B under a fused layer
                rules[f"{fqn}.weight"] = _FusedRows(parts, True)
        for fqn in tps.converted:
            if fqn in tps.fused:
                rules[f"{fqn}.weight"] = rules[f"{fqn}.bias"] = _Fused(tps.fused[fqn], False)
            else:
                rules[f"{fqn}.weight"] = _Transposed()
    return CanonicalAdapter(rules, shapes)


# -- ZeRO 1/2: the partitioned optimizer's state -------------------------------------------
class PartitionedOptimizerForm:
    """A raylm.parallel.zero PartitionedOptimizer's state in the form every other layout
    saves it: the flattened optimizer state dict of torch.distributed.checkpoint.state_dict
    (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), each state tensor a DTensor of
    the parameter's full shape. Without tensor parallelism that is a ``Shard(0)``
    DTensor over dp whose local part *is* the rank's state (no copy); a tensor-parallel
    parameter's state is first gathered over dp into the tensor-parallel shard (a
    transient copy of one replica's states, so DCP sees the DTensors a stage 0 run
    would give it)."""

    def __init__(self, popt, model, dp_mesh):
        self.popt, self.model, self.dp_mesh = popt, model, dp_mesh
        self.views: dict = {}  # key -> (rank's state tensor, owner param, gathered?)

    def state_dict(self) -> dict:
        popt = self.popt
        fqn_of: dict = {}
        for name, p in self.model.named_parameters():
            fqn_of.setdefault(id(p), name)
        param_of = {id(piece): p for p, piece in zip(popt.params, popt.pieces)}
        out, self.views = {}, {}
        for group in popt.optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for piece in group["params"]:
                p = param_of[id(piece)]
                fqn = fqn_of[id(p)]
                for k, v in popt.optimizer.state.get(piece, {}).items():
                    key = f"state.{fqn}.{k}"
                    if isinstance(v, torch.Tensor) and v.shape == piece.shape and v.ndim:
                        out[key] = self._global(key, v, p)
                    else:
                        out[key] = v
                for hk, hv in hyper.items():
                    out[f"param_groups.{fqn}.{hk}"] = hv
        return out

    def _global(self, key: str, v: torch.Tensor, p) -> DTensor:
        g = self.popt.grads
        local = local_tensor(p)
        if not isinstance(p, DTensor):
            self.views[key] = (v, p, False)
            return DTensor.from_local(v, self.dp_mesh, [Shard(0)], shape=local.shape,
                                      stride=contiguous_stride(local.shape),
                                      run_check=False)
        rows = local.shape[0]
        per = math.ceil(rows / g.size)
        padded = torch.zeros((per, *local.shape[1:]), dtype=v.dtype, device=v.device)
        padded[:v.shape[0]].copy_(v)
        full = torch.empty((per * g.size, *local.shape[1:]), dtype=v.dtype, device=v.device)
        dist.all_gather_single(full, padded, group=g.group)
        full = full[:rows].contiguous()
        self.views[key] = (v, p, full)
        return DTensor.from_local(full, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride(), run_check=False)

    @torch.no_grad()
    def load(self, loaded: dict) -> None:
        """Copy loaded values (``loaded``: the dict ``state_dict()`` gave, after DCP and
        the canonical adapter wrote into it) back into the rank's rows."""
        g = self.popt.grads
        for key, (v, p, gathered) in self.views.items():
            src = loaded[key]
            src = src.to_local() if isinstance(src, DTensor) else src
            if gathered is not False:
                a, b = owned_rows(local_tensor(p).shape[0], g.size, g.dp_rank)
                src = src[a:b]
            if src.data_ptr() != v.data_ptr():
                v.copy_(src)


# -- the whole rank ------------------------------------------------------------------------
# Optimizer state flattened to one key per parameter and setting ("state.<name>.exp_avg",
# "param_groups.<name>.lr"): ranks holding different parameters (pipeline stages) then
# write disjoint keys, instead of each writing its own "param_groups" list under one key.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class RankStateForm:
    """A rank's model and optimizer state in checkpoint form.

    ``state``: {"model": {name: tensor}, "optim": {"state.<name>.exp_avg": tensor, ...}},
    views of the live tensors where the form is the runtime's own (what DCP saves, or
    loads into). Building it is collective where the form gathers (ZeRO-3 with tensor
    parallelism, ZeRO 1/2 with tensor parallelism). ``zero``: the
    PartitionedOptimizerForm of a ZeRO 1/2 optimizer, else None. After DCP loaded into
    ``state``, ``apply_loaded()`` puts the values into the model and optimizer."""

    def __init__(self, model, optimizer, adapter, zero=None):
        self.model, self.optimizer, self.adapter, self.zero = model, optimizer, adapter, zero
        if zero is None:
            self.model_sd, self.optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
        else:
            self.model_sd = get_model_state_dict(model, options=OPTIONS)
            self.optim_sd = zero.state_dict()
        self.tp_form = _tp_only({**self.model_sd, **self.optim_sd})
        canon = adapter.to_canonical(self.tp_form)
        self.state = {"model": {k: canon[k] for k in self.model_sd},
                      "optim": {k: canon[k] for k in self.optim_sd}}

    def apply_loaded(self) -> None:
        self.adapter.from_canonical({**self.state["model"], **self.state["optim"]},
                                    self.tp_form)
        for key, value in {**self.model_sd, **self.optim_sd}.items():
            if self.tp_form[key] is not value:
                write_rows_back(value, self.tp_form[key])
        strict = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)
        if self.zero is None:
            set_state_dict(self.model, self.optimizer, model_state_dict=self.model_sd,
                           optim_state_dict=self.optim_sd, options=strict)
        else:
            set_model_state_dict(self.model, self.model_sd, options=strict)
            self.zero.load(self.optim_sd)


def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors so there is something to load into.

    torch's get_state_dict does this itself only when every grad is None; raylm's grads
    are never None (they are views into the flat all-reduce buckets), so do the same here:
    one step at learning rate 0 on the (zero) gradients, which changes no parameter.
    """
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def _tp_only(sd: dict) -> dict:
    """ZeRO-3 with tensor parallelism: FSDP's tensors are DTensors over (dp, tp), each
    rank holding its dp rows of its tp shard, while the canonical adapter speaks tp
    shards: such a tensor is gathered over dp into its tp shard (a transient copy of the
    rank's tp share of the states; ``apply_loaded`` returns loaded values by rows)."""
    return {k: tp_shard_of(v) if isinstance(v, DTensor) and v.device_mesh.ndim > 1 else v
            for k, v in sd.items()}
