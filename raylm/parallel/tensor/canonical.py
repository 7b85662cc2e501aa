"""The checkpoint form of a model's tensors: Hugging Face shapes, whatever the layout.

A raylm checkpoint is written by torch.distributed.checkpoint keyed by parameter name and
must load under any layout (tp = 1, 2, 4; pipeline stages holding subsets of the names).
DCP reshards a DTensor into any other sharding of the *same global shape*, so every
tensor is presented in a global shape that does not depend on the layout:

* the vocabulary unpadded: a padded [V_pad, ...] Shard(0) becomes [V, ...] with uneven
  shards (the last rank drops its zero rows; torch's chunking of V gives the same split);
* HF orientation: a GPT-2 Conv1D turned nn.Linear ([out, in]) is shown as [in, out];
* GPT-2's fused c_attn as the view [H, 3, H] (weight) / [3, H] (bias), Shard on the last
  dim: each rank holds a column block of each of q, k and v, which is no DTensor shard of
  [H, 3H] but is one of [H, 3, H]. That view applies without tensor parallelism too, so a
  GPT-2 checkpoint looks the same from every layout.

Canonical tensors are views of the runtime tensors (no copy to save); ``from_canonical``
writes loaded values back explicitly, whether or not DCP loaded through the views.
Optimizer state keys (``state.<param fqn>.<name>``) follow their parameter when their
shape is the parameter's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from raylm.models.tensor_plans import RAYLM_PLANS, base_prefix, match
from raylm.parallel.shards import contiguous_stride, tp_shard_of, write_rows_back


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
    write_rows_back(dest, flat)


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
                    if isinstance(model.get_submodule(fqn), Conv1D):
                        rules[f"{fqn}.weight"] = rules[f"{fqn}.bias"] = _Fused(parts, True)
    else:
        if tps.padded_vocab_size != tps.vocab_size:
            for fqn in tps.vocab_params:
                rules[fqn] = _Vocab(tps.vocab_size)
        for fqn in tps.converted:
            if fqn in tps.fused:
                rules[f"{fqn}.weight"] = rules[f"{fqn}.bias"] = _Fused(tps.fused[fqn], False)
            else:
                rules[f"{fqn}.weight"] = _Transposed()
    return CanonicalAdapter(rules, shapes)

