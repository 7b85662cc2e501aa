"""What the plan decided, in words and tables: the driver logs it, `raylm plan` prints it.

`raylm plan` shows the layout (chosen by the planner when --dp/--tp/--pp are all 0, else
the user's), the predicted per-rank memory broken down (parameters, gradients, optimizer
states, activations, workspace) against the worker memory, the predicted step time and
tokens/s, the next best layouts with why each lost, and for a pipeline each stage's pp
rank, blocks (module names), parameters and memory. The figures are the cost model's
(raylm.plan.cost): fp32 training with AdamW, activations derived per architecture
(raylm.plan.activations).

ZeRO: for the layout, a table of the predicted per-worker parameter, gradient and
optimizer-state bytes (and the peak with activations and workspace) at each stage 0-3,
the plan's stage marked, and which rank owns which partition (raylm.report.ownership).
"""

from __future__ import annotations

from typing import Optional

from raylm.errors import ConfigError
from raylm.models.families import family_of
from raylm.models.loading import resolve_block_size, resolve_model
from raylm.parallel.pipeline.stages import cut
from raylm.plan.activations import requested_recompute
from raylm.plan.cost import rank_memory, single_stage, stage_activation_bytes, step_time
from raylm.plan.hardware import hardware_for
from raylm.plan.inflight import peak_in_flight
from raylm.plan.layout import plan_run
from raylm.plan.planner import memory_options, meta_shape, search_for_config
from raylm.plan.text import BYTES_PER_PARAM, human_bytes
from raylm.plan.zero import STAGE_PARTITIONS, ZERO_STAGES, requested_zero_stage
from raylm.report.ownership import ownership_lines, zero_ownership

ALTERNATIVES_SHOWN = 5
# `raylm plan --json` lists each rank's rows of every tensor up to this many (rank,
# tensor) pairs in all; past it (thousands of ranks) only the counts and bytes.
OWNERSHIP_ROWS_LIMIT = 50_000


def _block_range(names: list) -> str:
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def build_plan_report(cfg, capacity: Optional[int] = None, from_cluster: bool = False) -> dict:
    """Everything `raylm plan` prints, as a JSON-able dict: the layout raylm would use for
    ``cfg`` on ``--num_workers`` workers (else ``capacity``, the connected cluster's, else
    one replica), its predicted memory and step time, the alternatives, and per pipeline
    stage and pp rank its modules and memory. No actor, no weights (meta device).
    ``from_cluster``: take worker memory and workers per node from the connected Ray
    cluster (`raylm plan --address`); otherwise flags and defaults only."""
    import dataclasses

    if cfg.per_device_train_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--per_device_train_batch_size and --gradient_accumulation_steps "
                          "must be >= 1")
    requested = requested_zero_stage(cfg)  # the flags' own errors first
    classes = None
    if getattr(cfg, "task", None) == "image-classification" and cfg.train_dir:
        from raylm.data.images import scan_image_folder

        # (the head is sized to the folder's classes, as raylm train sizes it)
        classes = scan_image_folder(cfg.train_dir, "--train_dir").classes
    elif getattr(cfg, "task", None) == "image-classification" and cfg.dataset_name:
        from raylm.data.hf_datasets import load_splits
        from raylm.data.images import dataset_classes

        splits = load_splits(cfg)  # (the dataset's labels, read in this process: no Ray)
        if "train" in splits:
            classes = dataset_classes(splits["train"], cfg.label_column_name)
    spec = resolve_model(cfg, classes=classes)
    seq_len = resolve_block_size(cfg, spec)
    searched = not (cfg.dp or cfg.tp or cfg.pp)
    workers = cfg.num_workers or capacity or (
        1 if searched else max(1, cfg.dp or 1) * max(1, cfg.tp or 1) * max(1, cfg.pp or 1))
    hw = hardware_for(cfg, None if from_cluster else {})
    model, shape = meta_shape(spec, seq_len, hw.use_gpu)

    # The plan itself is raylm train's (raylm.plan.layout.plan_run: the same function,
    # the same flags); the search around it supplies the alternatives and the figures.
    if searched:
        search = search_for_config(cfg, workers, spec, seq_len, hw=hw, shape=shape)
        plan, part = plan_run(cfg, max(workers, capacity or 0), spec, seq_len, hw=hw,
                              search=search)
    else:
        plan, part = plan_run(cfg, workers, spec, seq_len, hw=hw)
        search = search_for_config(cfg, plan.world_size, spec, seq_len, hw=hw, shape=shape,
                                   global_batch=plan.global_batch_size,
                                   prefer=(plan.dp, plan.tp, plan.pp, plan.schedule),
                                   zero_stage=plan.zero_stage,
                                   sequence_parallel=plan.sequence_parallel,
                                   recompute=plan.recompute)
    chosen = search.chosen
    if chosen is None or chosen.problem:  # the user's own --dp/--tp/--pp
        raise ConfigError(f"dp={plan.dp} x tp={plan.tp} x pp={plan.pp}: "
                          f"{chosen.problem if chosen else 'not a layout of the workers'}")
    if part is None:
        part = single_stage(shape)

    config = spec.config
    mb, m = plan.micro_batch_size, plan.micro_batches_per_rank
    tokens = mb * seq_len
    rec = shape.recipe
    layout = chosen.layout
    per_block = rec.block_bytes(tokens, seq_len, plan.tp, layout.sequence_parallel,
                                hw.mask_bytes, layout.recompute, hw.compute_bytes)
    total_params = shape.total_params
    report = {
        "layout": plan.describe(),
        "plan": {**plan.dims.to_dict(),
                 **{k: v for k, v in dataclasses.asdict(plan).items()
                    if k not in ("dims", "stage_bounds", "cpus_per_worker", "use_gpu")},
                 "world_size": plan.world_size,
                 "micro_batches_per_rank": m,
                 "stage_bounds": [list(b) for b in plan.stage_bounds]},
        "model": {"model_type": config.model_type, "objective": spec.objective,
                  "parameters": total_params,
                  "hidden_size": shape.hidden, "num_heads": shape.heads,
                  "num_kv_heads": shape.kv_heads, "intermediate_size": shape.intermediate,
                  "vocab_size": shape.vocab, "seq_len": seq_len,
                  "num_blocks": shape.num_blocks,
                  "trainable_parameters": (total_params if shape.trainable_params is None
                                           else shape.trainable_params),
                  "lora": dataclasses.asdict(spec.lora) if spec.lora is not None else None},
        "estimate": {"bytes_per_param": BYTES_PER_PARAM,
                     "activation_bytes_per_block": per_block,
                     "embedding_activation_bytes": rec.embed_bytes(
                         tokens, plan.tp, layout.sequence_parallel, hw.mask_bytes),
                     "head_activation_bytes": rec.head_bytes(
                         tokens, seq_len, plan.tp, layout.sequence_parallel,
                         hw.compute_bytes),
                     "activations": rec.description,
                     "precision": ("bf16" if cfg.bf16 else "fp16" if cfg.fp16
                                   else "fp32")},
        "planner": {"searched": searched, "num_workers": search.num_workers,
                    "global_batch": search.global_batch, "evaluated": search.evaluated,
                    "elapsed_s": search.elapsed_s},
        "hardware": _hardware_dict(hw),
        "assumed": _assumptions(hw),
        "chosen": chosen.to_dict(),
        "memory": chosen.memory.to_dict() if chosen.memory else None,
        "worker_memory": hw.worker_memory,
        "fits": chosen.fits,
        "time": chosen.time.to_dict() if chosen.time else None,
        "alternatives": [c.to_dict() for c in search.alternatives[:ALTERNATIVES_SHOWN]],
        "stages": [],
        "ranks": [],
        "tied": {},
        "zero": zero_report(spec, plan, seq_len, shape, part, layout, hw, requested,
                            searched, model,
                            reshard_flag=getattr(cfg, "reshard_after_forward", None)),
        "recompute": recompute_report(cfg, shape, part or single_stage(shape), layout, hw,
                                      searched),
    }
    numel = {n: p.numel() for n, p in model.named_parameters()}  # tied weights once
    if plan.pp == 1:
        names = [u.name for u in shape.blocks] if shape.cuttable else []
        mem = chosen.ranks[0]
        report["ranks"].append({
            "pp_rank": 0, "stages": [], "blocks": names, "parameters": total_params,
            "local_parameters": mem.param_count, "weight_bytes": mem.states,
            "in_flight": 1, "activation_bytes": mem.activations,
            "total_bytes": mem.states + mem.activations, "memory": mem.to_dict()})
        return report

    report["model"]["embeddings"] = part.embed.name
    report["model"]["head"] = part.head.name
    last = part.num_stages - 1
    stage_act = stage_activation_bytes(shape, part, layout, hw)
    held, _ = peak_in_flight(plan.schedule, part.stage_rank, m, stage_act)
    for s, (a, b) in enumerate(part.bounds):
        params = part.stage_params(s)
        split = sum(shape.block_split[a:b]) + (shape.embed_split if s == 0 else 0) + \
            (shape.head_split if s == last else 0)
        local = params - split + split / plan.tp
        weights = local * BYTES_PER_PARAM
        act = stage_act[s] * held[s]
        report["stages"].append({
            "stage": s, "pp_rank": part.stage_rank[s],
            "blocks": [u.name for u in part.blocks[a:b]], "first_block": a,
            "last_block": b - 1, "num_blocks": b - a,
            "embeddings": s == 0, "head": s == last, "parameters": params,
            "local_parameters": local, "weight_bytes": weights, "in_flight": held[s],
            "activation_bytes": act, "total_bytes": weights + act})

    # What each pp rank holds: its stages' parameters, a weight two of its stages share
    # once, and which weights more than one rank holds (tied embeddings).
    rank_params, report["tied"] = _rank_params(model, part, numel, plan.pp)
    for r in range(plan.pp):
        mem = chosen.ranks[r]
        report["ranks"].append({
            "pp_rank": r, "stages": part.stages_of(r), "parameters": rank_params[r],
            "local_parameters": mem.param_count, "weight_bytes": mem.states,
            "activation_bytes": mem.activations,
            "total_bytes": mem.states + mem.activations, "memory": mem.to_dict()})
    return report


def recompute_report(cfg, shape, part, layout, hw, searched: bool) -> dict:
    """Activation checkpointing and sequence parallelism for the layout: each setting's
    predicted activations, peak per worker and step time at the plan's ZeRO stage, which
    the plan runs, and how it was chosen."""
    import dataclasses

    asked_mode, asked_sp = requested_recompute(cfg), cfg.sequence_parallel
    rows = []
    # Every setting this layout can run (the planner's options with nothing asked).
    base = dataclasses.replace(layout, recompute="none", sequence_parallel=False)
    for option in memory_options(base, shape, {}, None, None):
        mode, sp = option.recompute, option.sequence_parallel
        ranks = rank_memory(shape, part, option, hw)
        worst = max(ranks, key=lambda r: r.total)
        rows.append({"recompute": mode, "sequence_parallel": sp,
                     "activations": worst.activations, "weight_copies": worst.weight_copies,
                     "workspace": worst.workspace,
                     "total": worst.total, "fits": worst.total <= hw.worker_memory,
                     "step": step_time(shape, part, option, hw, ranks).step,
                     "chosen": (mode, sp) == (layout.recompute, layout.sequence_parallel)})
    if asked_mode is not None and (asked_sp is not None or layout.tp == 1):
        how = "flags"
    elif layout.recompute == "none" and not layout.sequence_parallel:
        how = "fits without recomputation or sequence parallelism"
    else:
        how = ("planner: the fastest setting that fits" if searched
               else "the fastest setting at which this layout fits")
    return {"recompute": layout.recompute, "sequence_parallel": layout.sequence_parallel,
            "requested": asked_mode, "chosen_by": how, "options": rows}


def zero_report(spec, plan, seq_len: int, shape, part, layout, hw, requested, searched,
                model=None, reshard_flag=None) -> dict:
    """The ZeRO part of the report: the plan's stage and how it was chosen, the
    predicted per-worker states at each stage 0-3 for the layout (the pp rank that
    needs the most), and which rank owns which partition (raylm.report.ownership).
    ``reshard_flag``: --reshard_after_forward as given (None: the planner chose)."""
    import dataclasses

    if requested is not None:
        how = "flag"
    elif plan.dp <= 1:
        how = "dp=1: nothing to partition"
    elif plan.zero_stage == 0:
        how = "fits without ZeRO"
    else:
        how = ("planner: the lowest stage that fits" if searched
               else "the lowest stage at which this layout fits")
    stages = []
    for z in ZERO_STAGES:
        ranks = rank_memory(shape, part, dataclasses.replace(layout, zero_stage=z), hw)
        worst = max(range(len(ranks)), key=lambda r: ranks[r].total)
        m = ranks[worst]
        stages.append({"stage": z, "partitioned": list(STAGE_PARTITIONS[z]),
                       "pp_rank": worst, "parameters": m.parameters,
                       "gradients": m.gradients, "optimizer": m.optimizer,
                       "states": m.states, "total": m.total,
                       "fits": m.total <= hw.worker_memory, "chosen": z == plan.zero_stage,
                       "ranks": [r.to_dict() for r in ranks]})
    try:
        owners = zero_ownership(spec, plan, seq_len, model, OWNERSHIP_ROWS_LIMIT)
        lines = ownership_lines(owners, plan.dp)
    except Exception as e:  # noqa: BLE001 - a view of the plan; the plan stands without it
        owners, lines = [], [f"ZeRO ownership: not available for this model ({e})"]
    rows_kept = all("rows" in e for e in owners)
    return {"stage": plan.zero_stage, "requested": requested, "chosen_by": how,
            "cpu_offload": plan.cpu_offload, "dp": plan.dp,
            "reshard_after_forward": plan.reshard_after_forward,
            "reshard_after_forward_by": "flag" if reshard_flag is not None else "planner",
            "worker_memory": hw.worker_memory, "stages": stages,
            "ownership": owners, "ownership_rows": rows_kept,
            "ownership_summary": lines}


def _hardware_dict(hw) -> dict:
    return {"use_gpu": hw.use_gpu, "worker_tflops": hw.worker_flops / 1e12,
            "worker_memory_gb": hw.worker_memory / 2**30,
            "workers_per_node": hw.workers_per_node,
            "node_link_gbps": hw.node_link_bw * 8 / 1e9,
            "network_gbps": hw.network_bw * 8 / 1e9, "source": dict(hw.source)}


def _assumptions(hw) -> list[str]:
    """The defaults the figures rest on, where no flag or cluster gave a value."""
    kind = "GPU (--use_gpu)" if hw.use_gpu else "CPU"
    out = []
    if hw.source.get("worker_memory_gb") == "default":
        why = ("Ray does not report GPU memory; set --worker_memory_gb" if hw.use_gpu else
               "no Ray cluster connected; set --worker_memory_gb, or --address to read it "
               "from a cluster")
        out.append(f"worker memory {hw.worker_memory / 2**30:g} GiB: the {kind} default "
                   f"({why})")
    if hw.source.get("workers_per_node") == "default":
        out.append(f"{hw.workers_per_node} workers per node: the default "
                   "(--workers_per_node)")
    if hw.source.get("worker_tflops") == "default":
        out.append(f"{hw.worker_flops / 1e12:g} TFLOP/s per worker: the {kind} default "
                   "(--worker_tflops)")
    links = [f for f in ("node_link_gbps", "network_gbps") if hw.source.get(f) == "default"]
    if links:
        out.append(f"links {hw.node_link_bw * 8 / 1e9:g} Gbit/s in a node, "
                   f"{hw.network_bw * 8 / 1e9:g} Gbit/s across nodes: the {kind} defaults "
                   f"({', '.join('--' + f for f in links)})")
    return out


def _rank_params(model, part, numel: dict, pp: int) -> tuple[list, dict]:
    """(distinct parameters each pp rank holds, {weight name: ranks} for weights held by
    more than one rank)."""
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


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x >= 1e-3 else f"{x * 1e3:.3g} ms"


def _objective(model: dict) -> str:
    names = {"causal": "causal LM", "mlm": "masked LM", "seq2seq": "seq2seq",
             "span_corruption": "T5 span corruption"}
    return names.get(model.get("objective"), model.get("objective") or "causal LM")


def format_plan_report(report: dict) -> list[str]:
    """The text `raylm plan` prints: the layout, the predicted memory per rank and step
    time, the alternatives, and (pp > 1) a table per pipeline stage and per pp rank."""
    p, model, c = report["plan"], report["model"], report["chosen"]
    mb, m = p["micro_batch_size"], p["micro_batches_per_rank"]
    seq = model["seq_len"]
    lines = [f"plan: {report['layout']}",
             f"model: {model['model_type']} ({_objective(model)}), "
             f"{model['parameters']:,} parameters, "
             f"{model.get('num_blocks') or '?'} blocks, hidden {model['hidden_size']}, "
             f"{model['num_heads']} heads, sequence {seq}"]
    lora = model.get("lora")
    if lora:
        trained = model["trainable_parameters"]
        lines.append(f"LoRA (peft): rank {lora['rank']}, alpha {lora['alpha']:g}, dropout "
                     f"{lora['dropout']:g} on {', '.join(lora['target_modules'])}: "
                     f"{trained:,} trainable parameters "
                     f"({100.0 * trained / max(model['parameters'], 1):.2f}%), the rest "
                     "frozen (no gradients, no optimizer state)")
    pl = report["planner"]
    if pl["searched"]:
        lines.append(f"chosen by the planner: dp={c['dp']} x tp={c['tp']} x pp={c['pp']}, "
                     f"{c['microbatches']} micro-batch(es) of {mb} per replica"
                     + (f", schedule {c['schedule']}" if c["pp"] > 1 else "")
                     + f" (best of {pl['evaluated']} layouts of {pl['num_workers']} workers "
                     f"for a global batch of {pl['global_batch']} sequences, "
                     f"{pl['elapsed_s'] * 1000:.0f} ms)")
    else:
        lines.append("layout from --dp/--tp/--pp (set all three to 0 for the planner's "
                     "choice)")
    mem, hw = report["memory"], report["hardware"]
    if mem is not None:
        worker = report["worker_memory"]
        where = "" if p["pp"] == 1 else " (the pp rank that needs the most)"
        lines.append(
            f"memory per worker{where}: parameters {human_bytes(mem['parameters'])}, "
            f"gradients {human_bytes(mem['gradients'])}, optimizer states "
            f"{human_bytes(mem['optimizer'])}, activations {human_bytes(mem['activations'])}"
            f" ({mem['in_flight']} micro-batch(es) of {mb} x {seq} tokens), "
            + (f"16-bit weight copies {human_bytes(mem['weight_copies'])}, "
               if mem["weight_copies"] else "") + "workspace "
            f"{human_bytes(mem['workspace'])} = {human_bytes(mem['total'])} of "
            f"{human_bytes(worker)}" + ("" if report["fits"] else "  ** DOES NOT FIT **"))
    t = report["time"]
    if t is not None:
        lines.append(
            f"step: predicted {_seconds(t['step'])}, {t['tokens_per_s']:,.0f} tokens/s "
            f"(compute {_seconds(t['compute'])}, tp all-reduces {_seconds(t['tp_comm'])}, "
            f"pipeline bubble {_seconds(t['bubble'])} ({t['bubble_fraction']:.0%}) and "
            f"sends {_seconds(t['pp_comm'])}, dp all-reduce {_seconds(t['dp_comm'])} "
            f"exposed, optimizer {_seconds(t['optimizer'])})")
    lines.append(f"cost model: {'GPU' if hw['use_gpu'] else 'CPU'} workers of "
                 f"{hw['worker_tflops']:g} TFLOP/s and {human_bytes(report['worker_memory'])}, "
                 f"{hw['workers_per_node']} per node, links {hw['node_link_gbps']:g} Gbit/s "
                 f"in a node and {hw['network_gbps']:g} Gbit/s across")
    for a in report["assumed"]:
        lines.append(f"assumed: {a}")
    if report["alternatives"]:
        lines.append("")
        lines.append("alternatives (next best first):")
        rows = []
        for a in report["alternatives"]:
            name = f"dp={a['dp']} tp={a['tp']} pp={a['pp']}" + (
                f" {a['schedule']}" if a["pp"] > 1 else "") + (
                f" ZeRO-{a['zero_stage']}" if a.get("zero_stage") else "") + (
                " sp" if a.get("sequence_parallel") else "") + (
                f" {a['recompute']}-recompute" if a.get("recompute", "none") != "none"
                else "")
            am, at = a["memory"], a["time"]
            rows.append(["  " + name, a["microbatches"],
                         human_bytes(am["total"]) if am else "-",
                         _seconds(at["step"]) if at else "-",
                         f"{at['tokens_per_s']:,.0f}" if at else "-", a["reason"]])
        lines += _table(["  layout", "micro-batches", "memory/worker", "step", "tokens/s",
                         "why not"], rows, right={1, 2, 3, 4})
    mode = report["recompute"]["recompute"]
    precision = report["estimate"]["precision"]
    note = (f"memory: {precision} training with AdamW (fp32 weights, gradients, 2 moments) "
            f"+ the activations autograd keeps ({report['estimate']['activations']}"
            + ("" if mode == "none" else f", {mode} activation checkpointing") + ") + "
            + ("" if precision == "fp32" else "autocast's 16-bit copies of the matrices "
               "(one per step) + ")
            + "workspace (logits and gradients in flight, pipeline buffers"
            + ("" if mode == "none" else ", a block's recomputation") + ")")
    if not report["stages"]:
        r = report["ranks"][0]
        if p["tp"] == 1:
            who = ("the rank" if p["world_size"] == 1
                   else f"each of the {p['world_size']} data-parallel ranks")
            holds = f"{who} holds the whole model: {r['parameters']:,} parameters"
        else:
            holds = (f"each rank holds a 1/{p['tp']} shard of the model's matrices: "
                     f"{r['local_parameters']:,.0f} of its {r['parameters']:,} parameters")
        lines.append("")
        lines.append(f"{holds}; ~{human_bytes(r['weight_bytes'])} "
                     f"weights+grads+AdamW + ~{human_bytes(r['activation_bytes'])} "
                     f"activations (1 micro-batch of {mb} x {seq} tokens at a "
                     f"time) = ~{human_bytes(r['total_bytes'])} per rank, before the "
                     "workspace that 'memory per worker' above adds")
        lines.append(note)
        return lines + _recompute_lines(report) + _zero_lines(report)

    lines.append("")
    lines.append(f"pipeline: {len(report['stages'])} stage(s) on {p['pp']} pp rank(s), "
                 f"schedule {p['schedule']}, {m} micro-batch(es) of {mb} x "
                 f"{seq} tokens per step ('in flight': the micro-batches "
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
    return lines + _recompute_lines(report) + _zero_lines(report)


def _recompute_lines(report: dict) -> list[str]:
    """The activation checkpointing (and sequence parallelism) table of the layout."""
    r = report.get("recompute")
    if not r:
        return []
    where = "" if report["plan"]["pp"] == 1 else ", the pp rank that needs the most"
    lines = ["", f"activation checkpointing (per worker{where}, at the plan's ZeRO stage; "
             f"{r['recompute']}{', sequence parallel' if r['sequence_parallel'] else ''}: "
             f"{r['chosen_by']}):"]
    rows = [[f"  {o['recompute']}", "yes" if o["sequence_parallel"] else "-",
             human_bytes(o["activations"]), human_bytes(o["weight_copies"]),
             human_bytes(o["workspace"]), human_bytes(o["total"]), _seconds(o["step"]),
             "yes" if o["fits"] else "no", "<- chosen" if o["chosen"] else ""]
            for o in r["options"]]
    return lines + _table(["  recompute", "sequence parallel", "activations",
                           "weight copies", "workspace", "peak/worker", "step", "fits", ""],
                          rows, right={2, 3, 4, 5, 6})


def _zero_lines(report: dict) -> list[str]:
    """The ZeRO table (per-worker states at each stage, the plan's marked) and the
    ownership summary."""
    z = report.get("zero")
    if not z:
        return []
    where = "" if report["plan"]["pp"] == 1 else ", the pp rank that needs the most"
    lines = ["", f"ZeRO over each data-parallel group (dp={z['dp']}; per worker{where}; "
             f"stage {z['stage']}: {z['chosen_by']}"
             + (", sharded state offloaded to host memory" if z["cpu_offload"] else "")
             + ((", parameters kept gathered through each step (--reshard_after_forward "
                 "False)" if z.get("reshard_after_forward_by") == "flag" else
                 ", parameters kept gathered through each step (the planner's: they fit; "
                 "--reshard_after_forward True frees them after each forward)")
                if not z.get("reshard_after_forward", True) else "")
             + "):"]
    rows = []
    for s in z["stages"]:
        rows.append([f"  ZeRO-{s['stage']}", ", ".join(s["partitioned"]) or "-",
                     human_bytes(s["parameters"]), human_bytes(s["gradients"]),
                     human_bytes(s["optimizer"]), human_bytes(s["states"]),
                     human_bytes(s["total"]), "yes" if s["fits"] else "no",
                     "<- chosen" if s["chosen"] else ""])
    lines += _table(["  stage", "partitioned over dp", "parameters", "gradients",
                     "optimizer states", "states", "peak/worker", "fits", ""], rows,
                    right={2, 3, 4, 5, 6})
    by = {s["stage"]: s for s in z["stages"]}
    if 2 in by and 3 in by and by[3]["total"] > by[2]["total"]:
        kept = report["plan"]["pp"] > 1 or not z.get("reshard_after_forward", True)
        lines.append("  (ZeRO-3's peak is above ZeRO-2's: it gathers each block's parameters "
                     "for its forward and backward" + (", and here keeps them gathered "
                     "through the step" if kept else "") + "; the peak counts them, "
                     "the states do not)")
    lines.append("")
    lines += z["ownership_summary"]
    return lines


def _rank_table(report: dict) -> list[str]:
    header = ["pp rank", "stages", "parameters", "weights+grads+AdamW", "activations (peak)",
              "total"]
    rows = [[r["pp_rank"], ",".join(map(str, r["stages"])), f"{r['parameters']:,}",
             human_bytes(r["weight_bytes"]), human_bytes(r["activation_bytes"]),
             human_bytes(r["total_bytes"])] for r in report["ranks"]]
    return _table(header, rows, right={0, 2, 3, 4, 5})
