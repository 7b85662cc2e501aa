"""What a rank saves and restores: model, optimizer, LR schedule, RNG (worker side).

Model and optimizer go through torch.distributed.checkpoint in the layout-free
checkpoint form of raylm.parallel.checkpoint_form (the model's own parameter names and
shapes, whatever the dp, tp, pp and ZeRO stage that wrote them), so DCP reshards on load
into any other layout. This module only moves that form: to files, into Ray's object
store (raylm.checkpoint.memory) and back. RNG states are per rank, written with
safetensors (DCP's own .metadata file is a pickle: load only checkpoints you trust). The LR schedule is a pure function of
the step, so it is rebuilt from the step rather than stored.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load, save

from raylm import storage
from raylm.parallel.checkpoint_form import RankStateForm, init_optimizer_state


def _rng_path(path: str, rank: int) -> str:
    return storage.join(path, "rng", f"rank-{rank:05d}.safetensors")


def save_rank_state(path: str, model, optimizer, rank: int, adapter,
                    process_group=None, zero=None) -> None:
    """Collective: every rank of ``process_group`` calls this with the same ``path``.
    ``zero``: the checkpoint form of a ZeRO 1/2 partitioned optimizer (its state is
    saved in the same keys and global shapes as an unpartitioned one's)."""
    state = checkpoint_state(model, optimizer, adapter, zero)
    dcp.save(state, storage_writer=storage.dcp_writer(path), process_group=process_group)
    _save_rng(path, rank)


def checkpoint_state(model, optimizer, adapter, zero=None) -> dict:
    """The rank's state in checkpoint form, as ``save_rank_state`` writes it: views of
    the live tensors where the form is the runtime's own. Collective where the form
    gathers (ZeRO-3 with tensor parallelism)."""
    return RankStateForm(model, optimizer, adapter, zero).state


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
    storage.write_bytes(_rng_path(path, rank), save(rng))


def load_rank_state(path: str, model, optimizer, rank: int, adapter, fallback_seed: int,
                    process_group=None, zero=None) -> None:
    """Collective: restore model and optimizer, and this rank's RNG.

    A rank with no RNG file of its own (the checkpoint was written by fewer ranks) seeds
    from ``fallback_seed`` instead.
    """
    _load(model, optimizer, adapter, zero, storage_reader=storage.dcp_reader(path),
          process_group=process_group)
    rng_file = _rng_path(path, rank)
    if storage.isfile(rng_file):
        rng = load(storage.read_bytes(rng_file))
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
    # The saved parameter groups carry the implementation they were trained with (torch's
    # load_state_dict takes every group setting from them); this run's --optim stands (the
    # same update either way).
    implementation = [{k: g[k] for k in ("fused", "foreach") if k in g}
                      for g in optimizer.param_groups]
    form = RankStateForm(model, optimizer, adapter, zero)
    dcp.load(form.state, **source)
    form.apply_loaded()
    for group, kept in zip(optimizer.param_groups, implementation):
        group.update(kept)
