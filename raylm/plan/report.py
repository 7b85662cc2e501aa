"""What the plan decided, in words and tables: the driver logs it, `raylm plan` prints it.

Memory figures are estimates for fp32 training with AdamW: 4 bytes of weights, 4 of
gradients and 8 of optimizer state per parameter, plus activations. The activation figure
per block and micro-batch is the Megatron-LM estimate (Korthikanti et al. 2022,
s*b*h*(34 + 5*a*s/h) bytes at 16-bit, doubled for fp32) times the micro-batches a stage
holds at its peak: all of them under GPipe, at most (stages - stage index) under 1F1B.
"""

from __future__ import annotations

from typing import Optional

from raylm.plan.partition import Partition

BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weights, gradients, AdamW moments


def activation_bytes_per_block(seq_len: int, micro_batch: int, hidden: int, heads: int) -> float:
    s, b, h, a = seq_len, micro_batch, hidden, heads
    return 2.0 * s * b * h * (34 + 5 * a * s / h)


def in_flight(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, num_stages - stage)


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def describe_partition(part: Partition, schedule: str = "1f1b",
                       microbatches: int = 1) -> list[str]:
    """One line per stage: rank, blocks, parameters, estimated weight and optimizer memory
    (the driver's log; `raylm plan` adds activations, see build_plan_report)."""
    last = part.num_stages - 1
    lines = [f"pipeline: {part.num_stages} stage(s) on {max(part.stage_rank) + 1} rank(s), "
             f"schedule {schedule}, {microbatches} micro-batch(es) per step"]
    for s, (a, b) in enumerate(part.bounds):
        names = [u.name for u in part.blocks[a:b]] if part.blocks else []
        what = []
        if s == 0 and part.embed is not None:
            what.append(part.embed.name)
        what.append(f"blocks {a}-{b - 1}" + (f" ({names[0]} .. {names[-1]})"
                                             if len(names) > 1 else
                                             f" ({names[0]})" if names else ""))
        if s == last and part.head is not None:
            what.append(part.head.name)
        line = f"  stage {s} on pp rank {part.stage_rank[s]}: {'; '.join(what)}"
        if part.blocks:
            params = part.stage_params(s)
            mem = params * BYTES_PER_PARAM
            line += f"; {params:,} parameters; ~{human_bytes(mem)} weights+grads+AdamW"
        lines.append(line)
    return lines


# -- `raylm plan`: the whole layout of a run, from flags alone ----------------------------
HIDDEN_ATTRS = ("hidden_size", "n_embd", "d_model")
HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads")
LAYER_ATTRS = ("num_hidden_layers", "n_layer", "num_layers")


def _first_int(config, names) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_dims(config) -> tuple[Optional[int], Optional[int]]:
    """(hidden size, attention heads) of a model config, None where it names neither."""
    return _first_int(config, HIDDEN_ATTRS), _first_int(config, HEAD_ATTRS)


def _schedule_events(schedule: str, pp: int, virtual: int, microbatches: int):
    """Per pp rank, the (stage, +1 | -1) activation events of one step, in order, from
    torch.distributed.pipelining's own schedule tables (multi-stage schedules only): a
    forward stores a micro-batch's activations, the backward that frees them is the full
    backward, or for zero bubble the weight backward (which still needs them)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as S

    m = microbatches
    if schedule == "interleaved_1f1b":
        rounds = max(1, m // pp)
        ns = SimpleNamespace(n_local_stages=virtual, pp_group_size=pp, _n_microbatches=m,
                             microbatches_per_round=m // rounds)
        ops_of = S.ScheduleInterleaved1F1B._calculate_single_rank_operations
        free = "B"
    else:
        ns = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
        ops_of = S.ScheduleZBVZeroBubble._calculate_single_rank_operations
        free = "W"
    events = []
    for r in range(pp):
        ev = []
        for a in ops_of(ns, r):
            if a is None:
                continue
            kind = getattr(a.computation_type, "value", str(a.computation_type))
            if kind == "F":
                ev.append((a.stage_index, 1))
            elif kind == free:
                ev.append((a.stage_index, -1))
        events.append(ev)
    return events


def peak_in_flight(schedule: str, stage_rank: list, microbatches: int,
                   stage_act: list) -> tuple[list, list]:
    """(micro-batches each stage holds at its peak, activation bytes each pp rank holds at
    its peak), for activation bytes ``stage_act[s]`` per micro-batch of stage s.

    GPipe holds every micro-batch; 1F1B holds (stages - stage index); interleaved 1F1B
    and zero bubble are replayed from torch's schedule tables (a rank's stages peak at
    different times, so the rank's peak is less than the sum of its stages' peaks)."""
    n = len(stage_rank)
    pp = max(stage_rank) + 1
    virtual = n // pp
    events = None
    if schedule in ("interleaved_1f1b", "zero_bubble") and pp > 1:
        try:
            events = _schedule_events(schedule, pp, virtual, microbatches)
        except Exception:  # torch internals moved: fall back to the closed form
            events = None
    if events is None:
        held = [in_flight(schedule, s, n, microbatches) for s in range(n)]
        per_rank = [0.0] * pp
        for s, r in enumerate(stage_rank):
            per_rank[r] += held[s] * stage_act[s]
        return held, per_rank
    stage_peak = [0] * n
    per_rank = []
    for ev in events:
        held = {}
        live, peak = 0.0, 0.0
        for s, d in ev:
            held[s] = held.get(s, 0) + d
            stage_peak[s] = max(stage_peak[s], held[s])
            live += d * stage_act[s]
            peak = max(peak, live)
        per_rank.append(peak)
    return stage_peak, per_rank


def _block_range(names: list) -> str:
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def build_plan_report(cfg) -> dict:
    """Everything `raylm plan` prints, as a JSON-able dict: the layout raylm would choose
    for ``cfg`` with ``--num_workers`` ranks (default: one replica, dp x pp), and per
    pipeline stage and pp rank its modules, parameters and estimated memory. No cluster,
    no actor, no weights (the model is built on the meta device)."""
    import dataclasses

    from raylm.errors import ConfigError
    from raylm.models.loading import resolve_block_size, resolve_model
    from raylm.parallel.pipeline.stages import meta_model, model_units
    from raylm.plan.layout import make_plan, plan_pipeline

    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--per_device_train_batch_size and --gradient_accumulation_steps "
                          "must be >= 1")
    spec = resolve_model(cfg)
    seq_len = resolve_block_size(cfg, spec)
    capacity = cfg.num_workers or max(1, cfg.dp or 1) * max(1, cfg.pp or 1)
    plan = make_plan(cfg, capacity)
    try:
        model = meta_model(spec)
    except (ValueError, TypeError, AttributeError, AssertionError) as e:
        # A config transformers refuses (heads not dividing the hidden size, ...).
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot build the model ({spec.config.model_type}) from its "
                          f"config: {msg}") from None
    part = None
    if plan.pp > 1:
        plan, part = plan_pipeline(cfg, spec, plan, seq_len)

    config = spec.config
    hidden, heads = model_dims(config)
    mb, m = plan.micro_batch_size, plan.micro_batches_per_rank
    act_per_block = (activation_bytes_per_block(seq_len, mb, hidden, heads)
                     if hidden and heads else None)
    numel = {n: p.numel() for n, p in model.named_parameters()}  # tied weights once
    total_params = sum(numel.values())

    report = {
        "layout": plan.describe(),
        "plan": {**{k: v for k, v in dataclasses.asdict(plan).items()
                    if k not in ("stage_bounds", "cpus_per_worker", "use_gpu")},
                 "world_size": plan.world_size,
                 "micro_batches_per_rank": m,
                 "stage_bounds": [list(b) for b in plan.stage_bounds]},
        "model": {"model_type": config.model_type, "parameters": total_params,
                  "hidden_size": hidden, "num_heads": heads, "seq_len": seq_len},
        "estimate": {"bytes_per_param": BYTES_PER_PARAM,
                     "activation_bytes_per_block": act_per_block},
        "stages": [],
        "ranks": [],
        "tied": {},
    }

    if part is None:
        try:
            _, blocks, _ = model_units(model, seq_len)
            num_blocks = len(blocks)
            names = [u.name for u in blocks]
        except Exception:  # a model raylm cannot cut still has a layer count
            num_blocks, names = _first_int(config, LAYER_ATTRS), []
        report["model"]["num_blocks"] = num_blocks
        weights = total_params * BYTES_PER_PARAM
        # Gradient accumulation runs one micro-batch at a time.
        act = act_per_block * num_blocks if act_per_block is not None and num_blocks else None
        report["ranks"].append({
            "pp_rank": 0, "stages": [], "blocks": names, "parameters": total_params,
            "weight_bytes": weights, "in_flight": 1, "activation_bytes": act,
            "total_bytes": weights + (act or 0)})
        return report

    report["model"]["num_blocks"] = len(part.blocks)
    report["model"]["embeddings"] = part.embed.name
    report["model"]["head"] = part.head.name
    last = part.num_stages - 1
    stage_act = [(act_per_block or 0.0) * (b - a) for a, b in part.bounds]
    held, rank_act = peak_in_flight(plan.schedule, part.stage_rank, m, stage_act)
    for s, (a, b) in enumerate(part.bounds):
        params = part.stage_params(s)
        weights = params * BYTES_PER_PARAM
        act = stage_act[s] * held[s] if act_per_block is not None else None
        report["stages"].append({
            "stage": s, "pp_rank": part.stage_rank[s],
            "blocks": [u.name for u in part.blocks[a:b]], "first_block": a,
            "last_block": b - 1, "num_blocks": b - a,
            "embeddings": s == 0, "head": s == last, "parameters": params,
            "weight_bytes": weights, "in_flight": held[s], "activation_bytes": act,
            "total_bytes": weights + (act or 0)})

    # What each pp rank holds: its stages' parameters, a weight two of its stages share
    # once, and which weights more than one rank holds (tied embeddings).
    rank_params, report["tied"] = _rank_params(model, part, numel, plan.pp)
    for r in range(plan.pp):
        stages = part.stages_of(r)
        weights = rank_params[r] * BYTES_PER_PARAM
        act = rank_act[r] if act_per_block is not None else None
        report["ranks"].append({
            "pp_rank": r, "stages": stages, "parameters": rank_params[r],
            "weight_bytes": weights, "activation_bytes": act,
            "total_bytes": weights + (act or 0)})
    return report


def _rank_params(model, part, numel: dict, pp: int) -> tuple[list, dict]:
    """(distinct parameters each pp rank holds, {weight name: ranks} for weights held by
    more than one rank)."""
    from raylm.models.families import family_of
    from raylm.parallel.pipeline.stages import cut

    if family_of(model.config) is not None:
        # The runtime's own cut (views of the meta model: instant) says who holds what.
        try:
            holders = cut(model, part, [])[1]
            rank_params = [0] * pp
            for name, ranks in holders.items():
                for r in ranks:
                    rank_params[r] += numel[name]
            return rank_params, {n: r for n, r in holders.items() if len(r) > 1}
        except Exception:
            pass
    # Otherwise from the stage sums, the tied input/output embedding counted once per rank.
    rank_params = [sum(part.stage_params(s) for s in part.stages_of(r)) for r in range(pp)]
    tied = {}
    try:
        emb = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        if out is not None and out.weight is emb:
            name = next(n for n, p in model.named_parameters() if p is emb)
            first, last = part.stage_rank[0], part.stage_rank[-1]
            if first == last:
                rank_params[first] -= emb.numel()
            else:
                tied[name] = sorted((first, last))
    except (AttributeError, NotImplementedError, StopIteration):
        pass
    return rank_params, tied


def _table(header: list, rows: list, right: set) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(row):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header)] + [fmt(r) for r in rows]


def format_plan_report(report: dict) -> list[str]:
    """The text `raylm plan` prints: the layout line, then a table per pipeline stage
    and per pp rank (or, with pp=1, one line for the whole model)."""
    p, model = report["plan"], report["model"]
    mb, m = p["micro_batch_size"], p["micro_batches_per_rank"]
    dims = (f"hidden {model['hidden_size']}, {model['num_heads']} heads"
            if model["hidden_size"] and model["num_heads"] else "hidden size/heads unknown")
    lines = [f"plan: {report['layout']}",
             f"model: {model['model_type']}, {model['parameters']:,} parameters, "
             f"{model.get('num_blocks') or '?'} blocks, {dims}, sequence {model['seq_len']}"]
    note = ("memory: estimates for fp32 training with AdamW "
            f"({report['estimate']['bytes_per_param']} bytes/parameter: weights, gradients, "
            "2 moments) + activations of the blocks (Korthikanti et al. 2022: no "
            "recomputation, attention scores stored; logits not counted)")
    if not report["stages"]:
        r = report["ranks"][0]
        who = ("the rank" if p["world_size"] == 1
               else f"each of the {p['world_size']} data-parallel ranks")
        lines.append(f"{who} holds the whole model: "
                     f"{r['parameters']:,} parameters; ~{human_bytes(r['weight_bytes'])} "
                     f"weights+grads+AdamW + ~{human_bytes(r['activation_bytes'])} "
                     f"activations (1 micro-batch of {mb} x {model['seq_len']} tokens at a "
                     f"time) = ~{human_bytes(r['total_bytes'])}")
        lines.append(note)
        return lines

    lines.append(f"pipeline: {len(report['stages'])} stage(s) on {p['pp']} pp rank(s), "
                 f"schedule {p['schedule']}, {m} micro-batch(es) of {mb} x "
                 f"{model['seq_len']} tokens per step ('in flight': the micro-batches "
                 "whose activations a stage holds at its peak)")
    lines.append(f"stage 0 also holds: {model['embeddings']}; the last stage also holds: "
                 f"{model['head']}")
    lines.append("")
    header = ["stage", "pp rank", "blocks", "#", "embed", "head", "parameters",
              "weights+grads+AdamW", "in flight", "activations", "total"]
    rows = [[s["stage"], s["pp_rank"], _block_range(s["blocks"]), s["num_blocks"],
             "yes" if s["embeddings"] else "-", "yes" if s["head"] else "-",
             f"{s['parameters']:,}", human_bytes(s["weight_bytes"]), s["in_flight"],
             human_bytes(s["activation_bytes"]), human_bytes(s["total_bytes"])]
            for s in report["stages"]]
    lines += _table(header, rows, right={0, 1, 3, 6, 7, 8, 9, 10})
    if any(len(r["stages"]) > 1 for r in report["ranks"]):
        # Several stages per rank: what one worker holds (its stages peak at different
        # times, and a weight two of its stages share is held once).
        lines.append("")
        lines += _rank_table(report)
    lines.append("")
    for name, ranks in report["tied"].items():
        lines.append(f"tied: {name} is held by pp ranks {', '.join(map(str, ranks))} "
                     "(its gradients are summed between them each step)")
    lines.append(note)
    return lines


def _rank_table(report: dict) -> list[str]:
    header = ["pp rank", "stages", "parameters", "weights+grads+AdamW", "activations (peak)",
              "total"]
    rows = [[r["pp_rank"], ",".join(map(str, r["stages"])), f"{r['parameters']:,}",
             human_bytes(r["weight_bytes"]), human_bytes(r["activation_bytes"]),
             human_bytes(r["total_bytes"])] for r in report["ranks"]]
    return _table(header, rows, right={0, 2, 3, 4, 5})
