"""A model's initial weights without ever holding the whole model: for ZeRO stage 3.

From scratch they are ``build_model(spec, seed)``'s, its initialisation recorded on the
meta device and replayed a module's worth at a time (raylm.models.init_replay tells how).

The same trace gives ``build_model(spec, seed, device="meta")`` its skeleton: the traced
model's parameters stay on the meta device (tied ones one Parameter, as tying ran), and
only the ops its buffers depend on are replayed to make them real (rotary ``inv_freq``,
causal masks, position ids...). A pretrained model (``spec.pretrained_path``) is read from
its safetensors file(s) instead, a tensor at a time (``safe_open``; sharded index
supported), the tied weight that ``save_pretrained`` leaves out given its source's value.

Limits (each is detected and raised as MaterializeError, never silently wrong): the
replay's (raylm.models.init_replay); and a pretrained directory is read a tensor at a
time only where its safetensors weights name every state-dict entry (or its tied
partner; a missing persistent buffer takes its built value): ``reads_tensor_by_tensor``
says so, and the engine loads other checkpoints whole (``build_model``, transformers'
from_pretrained) before it shards them.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Iterable, Iterator, Optional

import torch

from raylm.models.auto import from_config, from_pretrained
from raylm.models.init_replay import (MaterializeError, make_buffers_real, replayed_state,
                                      trace_from_config)
from raylm.models.lora import add_lora, adapter_value, base_name, is_adapter, without_lora

__all__ = ["initial_state", "meta_skeleton"]

_META = torch.device("meta")


# -- the public API ------------------------------------------------------------------------
def meta_skeleton(spec, seed: int):
    """The model ``build_model(spec, seed)`` builds, with every parameter on the meta
    device and every buffer real (see ``raylm.models.loading.build_model``)."""
    if built_whole(spec):
        model = _whole_model(spec, seed)
        params_to_meta(model)
        if spec.pretrained_path:  # (its buffers: BatchNorm statistics, from the checkpoint)
            _load_buffers(model, spec.weights_dir)
            model.eval()
        return model
    config = spec.config
    model, trace = trace_from_config(config, spec.trust_remote_code)
    make_buffers_real(model, trace, seed)
    params_to_meta(model)
    if spec.pretrained_path:
        _load_buffers(model, spec.weights_dir)
        model.eval()  # as from_pretrained leaves it
    return model


def built_whole(spec) -> bool:
    """Models built whole on the CPU (under a forked generator, ``_whole_model``) rather
    than replayed from a meta-device trace: a model of the user's own (raylm cannot trace
    an arbitrary factory), and image classifiers (ViT's initialisation, ``trunc_normal_``
    on a float32 copy assigned back through ``.data``, replays to other values); both are
    small next to what ZeRO-3 is for. (Outside ZeRO-3 such models are built whole: a
    meta skeleton would save them nothing.)"""
    return (getattr(spec, "model_init", None) is not None
            or getattr(spec, "objective", None) == "image_classification")


def _whole_model(spec, seed: int):
    """``build_model(spec, seed)``'s model, built whole on the CPU (from its config; a
    pretrained image classifier with a new head loaded, the head's initial values being
    from_pretrained's draws); the caller's random generator is neither read nor
    changed."""
    with torch.random.fork_rng(devices=[]):
        if getattr(spec, "model_init", None) is not None:
            from raylm.models.custom import build_custom

            return build_custom(spec.model_init, spec.config, seed)
        if spec.pretrained_path and getattr(spec, "new_head", False):
            return from_pretrained(spec, seed)
        torch.manual_seed(seed)
        return from_config(spec.config, spec.trust_remote_code, dtype=torch.float32)


def initial_state(spec, seed: int, names: Optional[Iterable[str]] = None) -> Iterator:
    """Yield ``(name, tensor)`` for every entry of ``build_model(spec, seed).state_dict()``
    (parameters and persistent buffers; tied weights under each of their names), each
    the full initial value (CPU, float32 if floating point, contiguous), equal bit for
    bit to build_model's, a module's worth at a time (see the module docstring).

    ``names``: yield only these state-dict keys (a KeyError names any unknown one). It
    filters what is yielded, not what is generated: every random draw of the whole model
    is replayed, so the values do not depend on it.

    From scratch, the initialisation runs on a private copy of the CPU generator, seeded
    like ``torch.manual_seed(seed)``: the caller's global generator is neither read nor
    changed, and may be used between items. For ``spec.pretrained_path`` the tensors are
    read one at a time from the model's safetensors file(s) (sharded ones included).

    Tensors yielded for the same storage (tied weights) are the same tensor object;
    copy before writing into one.
    """
    if getattr(spec, "lora", None) is not None:
        yield from _with_adapters(spec, seed, names)
        return
    if spec.pretrained_path and not getattr(spec, "new_head", False):
        yield from _pretrained_state(spec, seed, names)
        return
    if built_whole(spec):  # (a pretrained image classifier with a new head too)
        state = _whole_model(spec, seed).state_dict()
        wanted = _check_names(state, names)
        for name, tensor in state.items():
            if name in wanted:
                yield name, _cpu_value(tensor)
        return
    config = copy.deepcopy(spec.config)
    model, trace = trace_from_config(config, spec.trust_remote_code)
    state = model.state_dict(keep_vars=True)
    wanted = _check_names(state, names)
    replayed = replayed_state(trace, [(n, t) for n, t in state.items() if n in wanted], seed)
    cpu = {n: t for n, t in state.items() if n in wanted and t.device.type != "meta"}
    del model, state
    for name, tensor in cpu.items():  # tensors the construction made on the CPU
        yield name, _cpu_value(tensor)
    del cpu
    yield from replayed


def _with_adapters(spec, seed: int, names) -> Iterator:
    """initial_state of a model with LoRA adapters (raylm.models.lora): the adapters'
    values (a function of seed and name), then the base model's under the wrapped
    layers' names (``c_attn.base_layer.weight`` is the base's ``c_attn.weight``)."""
    base = without_lora(spec)
    model = add_lora(meta_skeleton(base, seed), spec.lora, seed)
    state = model.state_dict(keep_vars=True)
    wanted = _check_names(state, names)
    shapes = {n: tuple(state[n].shape) for n in wanted if is_adapter(n)}
    of_base = {base_name(n): n for n in wanted if not is_adapter(n)}
    del model, state
    for name, shape in shapes.items():
        yield name, adapter_value(name, shape, seed)
    for name, value in initial_state(base, seed, names=set(of_base)):
        yield of_base[name], value


def _cpu_value(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone().contiguous()
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


def params_to_meta(model) -> None:
    """Parameters the construction made on the CPU (torch.tensor constants) go to the
    meta device like the rest, tied ones staying one Parameter."""
    moved: dict = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None and p.device.type != "meta":
                if id(p) not in moved:
                    moved[id(p)] = torch.nn.Parameter(p.detach().to(_META),
                                                      requires_grad=p.requires_grad)
                module._parameters[attr] = moved[id(p)]


def _check_names(state: dict, names) -> set:
    if names is None:
        return set(state)
    wanted = set(names)
    unknown = sorted(wanted - set(state))
    if unknown:
        raise KeyError(f"not in the model's state dict: {', '.join(unknown[:5])}"
                       + (" ..." if len(unknown) > 5 else ""))
    return wanted


# -- pretrained ----------------------------------------------------------------------------
class _Checkpoint:
    """The safetensors file(s) of a model directory, opened lazily."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        else:
            raise MaterializeError(f"{path} has no model.safetensors (or sharded index): "
                                   "its weights are not read a tensor at a time "
                                   "(reads_tensor_by_tensor; build_model loads them whole)")
        self.handles: dict = {}

    def __contains__(self, key) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[key]
        if file not in self.handles:
            self.handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self.handles[file].get_tensor(key)

    def close(self):
        self.handles.clear()


def _checkpoint_key(model, ckpt: _Checkpoint, name: str) -> Optional[str]:
    """The file's key for a state-dict name (also across a base-model prefix)."""
    if name in ckpt:
        return name
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in ckpt:
        return name[len(prefix) + 1:]
    return None


def _tied_groups(model) -> dict:
    """name -> the names sharing its tensor (tied weights), from the built model."""
    by_id: dict = {}
    for n, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(n)
    return {n: group for group in by_id.values() for n in group}


def reads_tensor_by_tensor(spec) -> bool:
    """Whether ``initial_state`` can give ``spec``'s initial weights without the whole
    model: from scratch, or pretrained weights in safetensors files that name every
    weight of the model (directly or across the base-model prefix; only the file headers
    are read). A checkpoint in ``.bin`` files, with the legacy names transformers renames
    on load (BERT's ``LayerNorm.gamma``) or without weights the model has (a body under a
    new head, which from_pretrained draws) is for ``build_model``. (A pretrained image
    classifier is built whole from its config, its weights then read as here.)"""
    spec = without_lora(spec)
    if not spec.pretrained_path:
        return True
    if getattr(spec, "new_head", False):
        return False
    try:
        ckpt = _Checkpoint(spec.weights_dir)
    except MaterializeError:
        return False
    model = meta_skeleton(spec, 0)
    groups = _tied_groups(model)
    try:
        return all(any(_checkpoint_key(model, ckpt, n) is not None for n in groups[name])
                   for name, t in model.state_dict(keep_vars=True).items()
                   if t.device.type == "meta")  # (a buffer the file lacks: its built value)
    finally:
        ckpt.close()


def _pretrained_state(spec, seed, names) -> Iterator:
    model = meta_skeleton(spec, seed)
    state = model.state_dict(keep_vars=True)
    wanted = _check_names(state, names)
    groups = _tied_groups(model)
    ckpt = _Checkpoint(spec.weights_dir)
    try:
        done = set()
        for name in state:
            if name not in wanted or name in done:
                continue
            group = [n for n in groups[name] if n in wanted]
            value = None
            for n in groups[name]:  # any of the tied names the file has
                key = _checkpoint_key(model, ckpt, n)
                if key is not None:
                    value = ckpt.get(key)
                    break
            if value is None:
                t = state[name]
                if t.device.type != "meta":  # a buffer the file lacks: its built value
                    value = t.detach().clone()
                else:
                    raise MaterializeError(
                        f"{spec.pretrained_path} has no weight for {name}")
            if value.is_floating_point() and value.dtype != torch.float32:
                value = value.float()
            value = value.contiguous()
            for n in group:
                done.add(n)
                yield n, value
            del value
    finally:
        ckpt.close()


def _load_buffers(model, path: str) -> None:
    """A pretrained skeleton's persistent buffers, from the checkpoint when it has them."""
    try:
        ckpt = _Checkpoint(path)
    except MaterializeError:
        return
    persistent = {n for n, _ in model.named_buffers()} & set(model.state_dict())
    for name in persistent:
        key = _checkpoint_key(model, ckpt, name)
        if key is None:
            continue
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        value = ckpt.get(key)
        old = module._buffers[attr]
        if value.is_floating_point():
            value = value.to(old.dtype)
        module._buffers[attr] = value.contiguous()
    ckpt.close()
