"""Which rank owns which partition: the driver's ZeRO plan, per global rank.

Under ZeRO stage s >= 1 each data-parallel group splits every tensor its ranks hold
(raylm.plan.zero: rows [start, stop) of dim 0, torch.chunk's split). What a rank holds
is its pipeline stages' parameters (a weight two of its stages share once; a tied weight
on two pp ranks once on each) in its tensor-parallel shard's local shapes; this module
derives both from the model built on the meta device, with the rules the runtime
applies:

* pipeline stages: the runtime's own cut (raylm.parallel.pipeline.stages.cut) for the
  families and T5; for a model cut by torch.export, the planner's units (the blocks by
  module name, the output embedding with the last stage, everything else with the
  first);
* tensor parallelism: raylm.models.tensor_plans.tensor_parallel_shapes, the one model
  of it (apply_tensor_parallel checks what torch sharded against it).

Bytes are fp32 training with AdamW: 4 per parameter, 4 per gradient, 8 per optimizer
state element (two moments), each counted for the elements the rank keeps of it: the
whole of what it holds, or its partition once the stage partitions that category.
"""

from __future__ import annotations

from typing import Optional

from raylm.models.families import family_of
from raylm.models.tensor_plans import tensor_parallel_shapes
from raylm.models.units import is_t5, meta_model, model_units
from raylm.parallel.pipeline.stages import cut
from raylm.plan.partition import Partition, partition, stage_ranks
from raylm.plan.text import human_bytes
from raylm.plan.zero import STAGE_PARTITIONS, owned_partition

BYTES = {"parameters": 4, "gradients": 4, "optimizer": 8}
CATEGORIES = ("parameters", "gradients", "optimizer")
CATEGORY_NAMES = {"parameters": "parameters", "gradients": "gradients",
                  "optimizer": "optimizer states"}


# -- what one rank holds --------------------------------------------------------------------
def _partition(model, plan, seq_len: int):
    """The plan's Partition (pp > 1): its stage bounds, or balanced ones."""
    embed, blocks, head = model_units(model, seq_len)
    if plan.stage_bounds:
        return Partition(bounds=[tuple(b) for b in plan.stage_bounds],
                         stage_rank=stage_ranks(plan.schedule, plan.pp, plan.virtual),
                         embed=embed, blocks=blocks, head=head)
    return partition(embed, blocks, head, plan.pp, plan.schedule, plan.virtual)


def pipeline_holders(spec, part) -> dict:
    """{parameter name: [pp ranks holding it]} for a pipeline Partition (a fresh meta
    model is cut: the cut prunes it)."""
    model = meta_model(spec)
    if family_of(model.config) is not None or is_t5(model.config):
        try:
            return cut(model, part, [])[1]
        except Exception:  # noqa: BLE001 - the units below say the same, approximately
            model = meta_model(spec)
    names = {id(p): n for n, p in model.named_parameters()}
    holders: dict = {}
    last = part.num_stages - 1
    block_stage = {}
    for s, (a, b) in enumerate(part.bounds):
        for i in range(a, b):
            block_stage[part.blocks[i].name] = s
    placed = set()
    for unit, s in block_stage.items():
        for p in model.get_submodule(unit).parameters():
            holders.setdefault(names[id(p)], set()).add(part.stage_rank[s])
            placed.add(id(p))
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    emb = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb.parameters()} if emb is not None else set()
    for n, p in model.named_parameters():
        if id(p) in placed:
            continue
        if id(p) in head_ids:
            holders.setdefault(n, set()).add(part.stage_rank[last])
        if id(p) not in head_ids or id(p) in emb_ids:
            holders.setdefault(n, set()).add(part.stage_rank[0])
    return {n: sorted(r) for n, r in holders.items()}


def held_shapes(spec, plan, seq_len: int, model=None) -> dict:
    """{(pp_rank, tp_rank): {parameter name: local shape}}: what each rank of one
    data-parallel replica holds (every dp replica holds the same)."""
    model = model if model is not None else meta_model(spec)
    if plan.pp > 1:
        holders = pipeline_holders(spec, _partition(model, plan, seq_len))
    else:
        holders = None
    tp_shapes = tensor_parallel_shapes(model, plan.tp)
    out = {}
    for t in range(plan.tp):
        shapes = tp_shapes.local(t)
        for p in range(plan.pp):
            out[(p, t)] = ({n: s for n, s in shapes.items() if p in holders.get(n, ())}
                           if holders is not None else shapes)
    return out


# -- the ownership table --------------------------------------------------------------------
def zero_ownership(spec, plan, seq_len: int, model=None) -> list[dict]:
    """One entry per global rank of ``plan`` (``plan.dims`` order): what it holds and
    which partition of it it owns under ``plan.zero_stage``, and its state bytes.

    Each entry: ``rank``; ``coords`` {"dp", "pp", "tp"}; ``stage``; ``partitioned``
    (the categories the stage splits over dp); ``tensors`` (how many it holds);
    ``elements`` {"held": of its pp stages' tp shards, "owned": its rows of them (all of
    them at stage 0 or dp=1), "parameters"/"gradients"/"optimizer": what it keeps of
    each}; ``bytes`` {"parameters", "gradients", "optimizer", "total"} (fp32, AdamW);
    ``rows`` {parameter name: (start, stop)}: the rows of dim 0 (of the local tp shard)
    it owns of each tensor it holds (the whole tensor when nothing is partitioned).
    Ranks of equal (pp shapes, dp rank) share one ``rows`` dict. ``model``: the meta
    model, if the caller built one (it is not modified)."""
    model = model if model is not None else meta_model(spec)
    groups = held_shapes(spec, plan, seq_len, model)
    # Frozen parameters (a LoRA run's base) have no gradient and no optimizer state.
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    stage = plan.zero_stage
    parts = STAGE_PARTITIONS[stage]
    split = stage > 0 and plan.dp > 1
    cache: dict = {}
    entries = []
    for rank in range(plan.world_size):
        coords = plan.dims.coords(rank)
        d = coords["dp"]
        shapes = groups[(coords["pp"], coords["tp"])]
        key = (tuple(shapes.items()), d if split else 0)
        if key not in cache:
            whole, held = owned_partition(shapes, 1, 0)  # everything, nothing split
            rows, owned = owned_partition(shapes, plan.dp, d) if split else (whole, held)
            trained = {n: s for n, s in shapes.items() if n not in frozen}
            t_held = owned_partition(trained, 1, 0)[1]
            t_owned = owned_partition(trained, plan.dp, d)[1] if split else t_held
            cache[key] = (rows, held, owned, t_held, t_owned)
        rows, held, owned, t_held, t_owned = cache[key]
        elements = {"held": held, "owned": owned}
        for c in CATEGORIES:
            if c == "parameters":
                elements[c] = owned if (split and c in parts) else held
            else:  # trained tensors only
                elements[c] = t_owned if (split and c in parts) else t_held
        nbytes = {c: BYTES[c] * elements[c] for c in CATEGORIES}
        nbytes["total"] = sum(nbytes.values())
        entries.append({"rank": rank, "coords": coords,
                        "stage": stage, "partitioned": list(parts) if split else [],
                        "tensors": len(shapes), "elements": elements, "bytes": nbytes,
                        "rows": rows})
    return entries


def _ranges(values: list) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, values = [], sorted(set(values))
    start = prev = None
    for v in values + [None]:
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ", ".join(out)


def _count_range(values: list) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def ownership_lines(entries: list[dict], dp: Optional[int] = None) -> list[str]:
    """The ownership table as a few log lines: a header, then one line per (pp rank,
    tp ranks) group whose ranks hold the same (tp ranks of equal shards merged)."""
    if not entries:
        return []
    dp = dp or (max(e["coords"]["dp"] for e in entries) + 1)
    stage = entries[0]["stage"]
    parts = entries[0]["partitioned"]
    if parts:
        what = ", ".join(CATEGORY_NAMES[c] for c in parts)
        head = (f"ZeRO-{stage} ownership: each of the dp={dp} ranks of a group owns rows "
                f"[start, stop) of dim 0 of every tensor it holds (torch.chunk's split); "
                f"partitioned: {what}")
    elif stage > 0:
        head = f"ZeRO-{stage} with dp={dp}: nothing to partition; every rank owns what it holds"
    else:
        head = "ZeRO-0: no partition; every rank holds and updates all it holds"
    lines = [head]
    groups: dict = {}
    for e in entries:
        c = e["coords"]
        groups.setdefault((c["pp"], c["tp"]), []).append(e)
    merged: dict = {}  # (pp, what the group holds and owns) -> tp ranks
    for (p, t), es in sorted(groups.items()):
        sig = (p, es[0]["tensors"], es[0]["elements"]["held"],
               tuple(e["elements"]["owned"] for e in es))
        merged.setdefault(sig, []).append(t)
    many_tp = len(groups) > len({k[0] for k in groups})
    for (p, tensors, held, owned), tps in merged.items():
        es = [e for t in tps for e in groups[(p, t)]]
        b = {k: [e["bytes"][k] for e in es] for k in ("parameters", "gradients",
                                                      "optimizer", "total")}
        ranks = sorted(e["rank"] for e in es)
        who = f"pp rank {p}" + (f", tp rank(s) {_ranges(tps)}" if many_tp else "")
        text = (f"  {who} (global ranks {_ranges(ranks)}): {tensors} tensors, "
                f"{held:,} elements")
        if parts:
            text += f"; each dp rank owns {_count_range(list(owned))}"
        def hb(k):
            lo, hi = human_bytes(min(b[k])), human_bytes(max(b[k]))
            return lo if lo == hi else f"{lo}-{hi}"
        text += (f"; per rank parameters {hb('parameters')}, gradients {hb('gradients')}, "
                 f"optimizer states {hb('optimizer')} = {hb('total')}")
        lines.append(text)
    return lines
