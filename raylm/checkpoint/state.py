"""What a rank saves and restores: model, optimizer, LR schedule, RNG (worker side).

Model and optimizer go through torch.distributed.checkpoint, keyed by the model's own
parameter names and in the model's own shapes, so a checkpoint does not depend on the
layout that wrote it: pipeline stages write disjoint keys, tensor-parallel shards are
DTensors of the full tensor, and DCP reshards on load into any other layout. A model
whose runtime form differs from its checkpoint form (a vocabulary padded for tensor
parallelism, GPT-2's layers turned into nn.Linear) goes through the canonical adapter of
raylm.parallel.tensor, which presents its tensors in the model's own shapes. RNG states are per
rank, written with safetensors (no pickle anywhere in a checkpoint). The LR schedule is a
pure function of the step, so it is rebuilt from the step rather than stored.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from raylm.parallel.shards import tp_shard_of, write_rows_back


def _rng_path(path: str, rank: int) -> str:
    return os.path.join(path, "rng", f"rank-{rank:05d}.safetensors")


# Optimizer state flattened to one key per parameter and setting ("state.<name>.exp_avg",
# "param_groups.<name>.lr"): ranks holding different parameters (pipeline stages) then
# write disjoint keys, instead of each writing its own "param_groups" list under one key.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def save_rank_state(path: str, model, optimizer, rank: int, adapter,
                    process_group=None, zero=None) -> None:
    """Collective: every rank of ``process_group`` calls this with the same ``path``.
    ``zero``: the checkpoint form of a ZeRO 1/2 partitioned optimizer (its state is
    saved in the same keys and global shapes as an unpartitioned one's)."""
    state = checkpoint_state(model, optimizer, adapter, zero)
    dcp.save(state, checkpoint_id=path, process_group=process_group)
    _save_rng(path, rank)


def checkpoint_state(model, optimizer, adapter, zero=None) -> dict:
    """The rank's state in checkpoint form, as ``save_rank_state`` writes it: views of
    the live tensors where the form is the runtime's own. Collective where the form
    gathers (ZeRO-3 with tensor parallelism: ``_tp_only``)."""
    return _canonical_state(model, optimizer, adapter, zero)[2]


def export_rank_state(state: dict, planner=None, on_copied=None):
    """``state`` (``checkpoint_state``) into Ray's object store, by this rank alone (no
    collective: its group may be broken, or the call runs in a thread of its own;
    raylm.checkpoint.memory): the DCP metadata of its chunks, with their ObjectRefs as
    storage data. ``planner``: an ExportPlanner kept between exports; ``on_copied``:
    called once every chunk is copied out of ``state``'s tensors (before the copies go
    into the object store)."""
    from raylm.checkpoint.memory import ObjectStoreWriter

    writer = ObjectStoreWriter(on_copied)
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    return writer.metadata


def _save_rng(path: str, rank: int) -> None:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    os.makedirs(os.path.dirname(_rng_path(path, rank)), exist_ok=True)
    save_file(rng, _rng_path(path, rank))


def load_rank_state(path: str, model, optimizer, rank: int, adapter, fallback_seed: int,
                    process_group=None, zero=None) -> None:
    """Collective: restore model and optimizer, and this rank's RNG.

    A rank with no RNG file of its own (the checkpoint was written by fewer ranks) seeds
    from ``fallback_seed`` instead.
    """
    _load(model, optimizer, adapter, zero, checkpoint_id=path, process_group=process_group)
    rng_file = _rng_path(path, rank)
    if os.path.exists(rng_file):
        rng = load_file(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        torch.manual_seed(fallback_seed)


def import_rank_state(storage_reader, model, optimizer, adapter, zero=None) -> None:
    """Collective over the world: load model and optimizer state from another layout's
    state in memory (raylm.checkpoint.memory.ObjectStoreReader) as from a checkpoint."""
    _load(model, optimizer, adapter, zero, storage_reader=storage_reader)


def _load(model, optimizer, adapter, zero, **source) -> None:
    init_optimizer_state(optimizer)
    (model_sd, optim_sd), tp_form, state = _canonical_state(model, optimizer, adapter, zero)
    dcp.load(state, **source)
    adapter.from_canonical({**state["model"], **state["optim"]}, tp_form)
    _write_rows_back({**model_sd, **optim_sd}, tp_form)
    strict = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)
    if zero is None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=strict)
    else:
        set_model_state_dict(model, model_sd, options=strict)
        zero.load(optim_sd)


def _canonical_state(model, optimizer, adapter, zero=None):
    """The rank's model and optimizer state dicts, the same in tensor-parallel form
    (``_tp_only``) and in checkpoint form:
    {"model": {name: tensor}, "optim": {"state.<name>.exp_avg": tensor, ...}}."""
    if zero is None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    else:
        model_sd = get_model_state_dict(model, options=OPTIONS)
        optim_sd = zero.state_dict()
    tp_form = _tp_only({**model_sd, **optim_sd})
    canon = adapter.to_canonical(tp_form)
    return (model_sd, optim_sd), tp_form, {"model": {k: canon[k] for k in model_sd},
                                           "optim": {k: canon[k] for k in optim_sd}}


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
    rank's tp share of the states; ``_write_rows_back`` returns loaded values by rows)."""
    from torch.distributed.tensor import DTensor

    return {k: tp_shard_of(v) if isinstance(v, DTensor) and v.device_mesh.ndim > 1 else v
            for k, v in sd.items()}


def _write_rows_back(sd: dict, tp_form: dict) -> None:
    for key, value in sd.items():
        if tp_form[key] is not value:
            write_rows_back(value, tp_form[key])
