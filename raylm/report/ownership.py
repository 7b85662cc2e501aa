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

import math
from typing import Optional

import numpy as np

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
def zero_ownership(spec, plan, seq_len: int, model=None,
                   rows_limit: Optional[int] = None) -> list[dict]:
    """One entry per global rank of ``plan`` (``plan.dims`` order): what it holds and
    which partition of it it owns under ``plan.zero_stage``, and its state bytes.

    Each entry: ``rank``; ``coords`` {"dp", "pp", "tp"}; ``stage``; ``partitioned``
    (the categories the stage splits over dp); ``tensors`` (how many it holds);
    ``elements`` {"held": of its pp stages' tp shards, "owned": its rows of them (all of
    them at stage 0 or dp=1), "parameters"/"gradients"/"optimizer": what it keeps of
    each}; ``bytes`` {"parameters", "gradients", "optimizer", "total"} (fp32, AdamW);
    ``rows`` {parameter name: (start, stop)}: the rows of dim 0 (of the local tp shard)
    it owns of each tensor it holds (the whole tensor when nothing is partitioned).
    Ranks of equal (pp shapes, dp rank) share one ``rows`` dict. ``rows_limit``: no
    ``rows`` when the ranks hold more tensors than that in all (0: never; the log's
    lines need only the counts). ``model``: the meta model, if the caller built one (it
    is not modified).

    The counts of every dp rank of a group come from one array operation over the
    group's tensors (owned_rows' arithmetic, vectorised): a plan of 16,384 ranks has
    2,048 dp ranks to a group, and a loop over them and their tensors took seconds."""
    model = model if model is not None else meta_model(spec)
    groups = held_shapes(spec, plan, seq_len, model)
    # Frozen parameters (a LoRA run's base) have no gradient and no optimizer state.
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    stage = plan.zero_stage
    parts = STAGE_PARTITIONS[stage]
    split = stage > 0 and plan.dp > 1
    dp = plan.dp if split else 1
    # Groups of equal shapes (the tp ranks of equal shards) share their counts and rows.
    kinds: dict = {}
    same = {g: kinds.setdefault(tuple(shapes.items()), len(kinds))
            for g, shapes in groups.items()}
    rows = rows_limit is None or plan.dp * sum(map(len, groups.values())) <= rows_limit
    counts: dict = {}  # the shapes -> (held, owned[dp], trained held, owned[dp])
    row_cache: dict = {}
    entries = []
    for rank in range(plan.world_size):
        coords = plan.dims.coords(rank)
        d = coords["dp"] if split else 0
        shapes = groups[(coords["pp"], coords["tp"])]
        key = same[(coords["pp"], coords["tp"])]
        if key not in counts:
            counts[key] = _owned_counts(shapes, frozen, dp)
        held, owned, t_held, t_owned = counts[key]
        elements = {"held": held, "owned": int(owned[d])}
        for c in CATEGORIES:
            if c == "parameters":
                elements[c] = elements["owned"] if (split and c in parts) else held
            else:  # trained tensors only
                elements[c] = int(t_owned[d]) if (split and c in parts) else t_held
        nbytes = {c: BYTES[c] * elements[c] for c in CATEGORIES}
        nbytes["total"] = sum(nbytes.values())
        entry = {"rank": rank, "coords": coords,
                 "stage": stage, "partitioned": list(parts) if split else [],
                 "tensors": len(shapes), "elements": elements, "bytes": nbytes}
        if rows:
            if (key, d) not in row_cache:
                row_cache[(key, d)] = owned_partition(shapes, dp, d)[0]
            entry["rows"] = row_cache[(key, d)]
        entries.append(entry)
    return entries


def _owned_counts(shapes: dict, frozen: set, dp: int) -> tuple:
    """(elements held, elements each of the ``dp`` ranks owns, the same two of the
    trained tensors only) of one group's tensors ``shapes``: raylm.plan.zero's
    owned_numel for every dp rank at once (a 0-d tensor is one row)."""
    dims = [tuple(int(n) for n in s) or (1,) for s in shapes.values()]
    first = np.array([d[0] for d in dims], dtype=np.int64)
    inner = np.array([math.prod(d[1:]) for d in dims], dtype=np.int64)
    trained = np.array([n not in frozen for n in shapes], dtype=bool)
    per = -(-first // dp)  # ceil(rows / dp); 0 for a tensor of no rows
    start = np.minimum(np.arange(dp, dtype=np.int64)[:, None] * per, first)
    owned = (np.minimum(start + per, first) - start) * inner  # [dp, tensors]
    return (int((first * inner).sum()), owned.sum(axis=1),
            int((first * inner)[trained].sum()), owned[:, trained].sum(axis=1))


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
