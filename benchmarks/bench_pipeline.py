"""raylm's pipeline runtime against the ideal of each schedule, on stages of fixed cost.

    python benchmarks/bench_pipeline.py            # p=4 stages, m=16 micro-batches (~2 min)
    python benchmarks/bench_pipeline.py --quick    # fewer steps, one round (~40 s)

Runs raylm.parallel.pipeline.runtime.PipelineRuntime, as raylm's ranks do, for each
schedule raylm supports (gpipe, 1f1b, interleaved_1f1b, zero_bubble) on p Ray actors (one
per pipeline rank, gloo process group over TCP, 1 torch thread each), but with SYNTHETIC
stages whose cost is fixed and known, so that the gap between the measured step and the
schedule's ideal is raylm's own overhead: torch.distributed.pipelining's schedule code,
the p2p send/recv over gloo, autograd bookkeeping, Python.

The synthetic stage. x [mb, d] -> SleepInput(x) * SleepWeight(w), w a 1-element weight:
  * SleepInput: forward sleeps t_f, backward sleeps t_bi and passes the gradient through;
    it saves one buffer of --act_kib KiB for backward: the stage's activation, K bytes per
    micro-batch.
  * SleepWeight: forward returns w, backward sleeps t_bw (the weight-gradient work).
  * t_bi + t_bw = t_b (t_bw = --w_frac x t_b). A full backward runs both sleeps; zero
    bubble's input-gradient pass (I) runs only SleepInput's (t_bi), its weight pass (W)
    only SleepWeight's (t_bw): the split follows autograd's graph, as it would for a real
    model. One exception, torch's: on stage 0 (no input gradient) I does nothing and W
    runs the whole backward (t_bi + t_bw).
  * Sleeps take no CPU, so p ranks on 2 cores still run their stages in parallel; what
    does take CPU is the overhead being measured.
  * With v stages per rank (interleaved_1f1b: --virtual, zero_bubble: 2) each stage costs
    1/v of t_f, t_bi, t_bw, so that every schedule does the same work per micro-batch on
    each rank: m (t_f + t_b) per step. That is also a lower bound of every schedule.

The ideal of a step:
  * formula: the textbook figure: gpipe and 1f1b (m + p - 1)(t_f + t_b); interleaved with
    v stages per rank (m + (p - 1)/v)(t_f + t_b) (Megatron-LM's, m a multiple of p);
    zero_bubble (ZB-V) m (t_f + t_b): the paper's zero bubble, for t_f = t_bi = t_bw (the
    default: 10, 10, 10 ms).
  * sim: the operations each rank runs, in the order torch's schedule runs them (its
    action lists, read from the schedule object the ranks built), played with the stage
    costs above, every dependency honoured, and communication and overhead free. This is
    the best that schedule can do with these stages; for gpipe and 1f1b it equals the
    formula. ratio = measured / sim isolates the runtime's overhead; ratio / formula also
    charges the schedule for being worse than the textbook one.
  * overhead per micro-batch = (measured - sim) / m; per op = (measured - sim) / (number
    of F, B (or F, I, W) operations a rank runs in a step: m v x 2 or x 3).
  * sim': sim with each op at the cost the synthetic stage has on its own. The stage is
    not free outside its sleeps (its module call, autograd's Functions, the saved
    buffer's allocation and hooks, each sleep's overshoot), and sim charges that to the
    runtime. Before the rounds every rank runs, at once (the same sleeps and load), m
    forwards and then m full backwards of a stage in a plain loop with no pipeline
    (PipeRank.plain), each call timed; sim' plays the schedule with those costs (a split
    backward's I and W each take half of what a full backward adds to its two sleeps).
    measured / sim' is what the pipeline runtime itself adds: p2p over gloo, the
    hand-offs and their wake-ups, torch's schedule code.

Step time: every rank waits on a gloo barrier, then runs PipelineRuntime.run over the m
micro-batches; a step lasts from the first rank's start to the last rank's end (one
monotonic clock, the ranks share a machine). The table shows the median over --steps
steps after --warmup untimed ones (the first builds torch's p2p buffers and metadata).
Also shown: the ranks' sleep overshoot (how much longer than asked a sleep took, averaged
over ops), which is in the overhead as measured but is the OS's, not raylm's.

Activation memory: SleepInput's saved buffer goes through torch.autograd.graph
.saved_tensors_hooks; the pack hook wraps it in a holder that adds its bytes to its
stage's live count, and the holder's __del__ (run when autograd drops the saved tensor:
after a non-retained backward, or when a retained graph is freed) takes them off. The peak
of the live count per stage over the timed steps is what autograd actually kept for that
stage. Expected: gpipe m K on every stage (all forwards before any backward), 1f1b
(p - s) K on stage s; for every schedule the script also replays torch's action order
(+K at F, -K at B, and at W for a split backward: the I pass retains the graph until W).

Asserts nothing (timings on a shared 2-core machine are noisy: repeat a run). Written to
benchmarks/results/bench_pipeline-<date>.json (bench_pipeline-quick-<date>.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
GOAL = ("1f1b", 1.05)  # measured / ideal for 1F1B, p=4, m=16
COMPUTE = ("F", "B", "I", "W")  # forward, full backward, input-grad, weight-grad


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks p (default 4)")
    ap.add_argument("--microbatches", "-m", type=int, default=16,
                    help="micro-batches per step m (default 16)")
    ap.add_argument("--t_f", type=float, default=10.0,
                    help="forward ms of one rank's share of the model (default 10)")
    ap.add_argument("--t_b", type=float, default=20.0,
                    help="backward ms of one rank's share of the model (default 20)")
    ap.add_argument("--w_frac", type=float, default=0.5,
                    help="share of t_b that is the weight gradient (zero bubble's W; "
                    "default 0.5: t_bi = t_bw = 10 ms = t_f)")
    ap.add_argument("--virtual", type=int, default=2,
                    help="stages per rank for interleaved_1f1b (default 2)")
    ap.add_argument("--act_kib", type=int, default=1024,
                    help="activation a stage saves per micro-batch, KiB (default 1024)")
    ap.add_argument("--mb_rows", type=int, default=2, help="rows per micro-batch (default 2)")
    ap.add_argument("--hidden", type=int, default=16,
                    help="width d of the tensor sent between stages (default 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 15; quick 5)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed first steps per schedule (default 3; quick 2)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="rounds of all schedules, interleaved; the table shows the best "
                    "round and the median of rounds (default 2; quick 1)")
    ap.add_argument("--schedules", nargs="*", choices=SCHEDULES, default=None,
                    help="run only these schedules")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round")
    args = ap.parse_args(argv)
    quick = dict(steps=5, warmup=2, repeat=1)
    full = dict(steps=15, warmup=3, repeat=2)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.schedules = [s for s in SCHEDULES if s in (args.schedules or SCHEDULES)]
    if not 0.0 <= args.w_frac <= 1.0:
        ap.error("--w_frac must be within 0..1")
    return args


# ----------------------------------------------------------------------------------------
# The synthetic stage (runs in the rank actors; pickled by value with this module).

LIVE: dict = {}  # stage -> live saved-activation bytes (per process)
PEAK: dict = {}  # stage -> peak of LIVE since the last reset
SLEEP = {"ops": 0, "over_s": 0.0}  # sleeps done, and their total overshoot
EVENTS: list = []  # (kind F/I/W, stage, start, end) of this step's synthetic work


def stage_times(cfg: dict, v: int) -> tuple:
    """(t_f, t_bi, t_bw) in seconds of one of a rank's v stages: 1/v of the rank's share."""
    t_f, t_b = cfg["t_f"] / 1000 / v, cfg["t_b"] / 1000 / v
    t_bw = t_b * cfg["w_frac"]
    return t_f, t_b - t_bw, t_bw


def _sleep(seconds: float, kind: str, stage: int) -> None:
    t0 = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    t1 = time.perf_counter()
    EVENTS.append((kind, stage, t0, t1))
    if seconds > 0:
        SLEEP["ops"] += 1
        SLEEP["over_s"] += t1 - t0 - seconds


class _Saved:
    """A saved tensor, counted in its stage's live bytes while autograd keeps it."""

    __slots__ = ("t", "stage", "nbytes")

    def __init__(self, t, stage: int):
        self.t, self.stage = t, stage
        self.nbytes = 0 if t.is_meta else t.numel() * t.element_size()
        LIVE[stage] = LIVE.get(stage, 0) + self.nbytes
        PEAK[stage] = max(PEAK.get(stage, 0), LIVE[stage])

    def __del__(self):
        LIVE[self.stage] -= self.nbytes


def _stage_functions():
    import torch

    class SleepInput(torch.autograd.Function):
        # anchor: on the first stage, whose input needs no gradient, a 1-element weight
        # that puts this op in the graph anyway (a real first stage has weights here).
        @staticmethod
        def forward(ctx, x, anchor, t_f, t_bi, act_numel, stage):
            if not x.is_meta:
                _sleep(t_f, "F", stage)
            ctx.t_bi, ctx.stage = t_bi, stage
            ctx.save_for_backward(torch.empty(act_numel, dtype=torch.float32,
                                              device=x.device))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # unpacked, as a real backward would
            _sleep(ctx.t_bi, "I", ctx.stage)
            da = torch.zeros(1) if ctx.needs_input_grad[1] else None
            return g, da, None, None, None, None

    class SleepWeight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w, t_bw, stage):
            ctx.t_bw, ctx.stage = t_bw, stage
            return w.clone()

        @staticmethod
        def backward(ctx, g):
            _sleep(ctx.t_bw, "W", ctx.stage)
            return g, None, None

    class SyntheticStage(torch.nn.Module):
        def __init__(self, stage: int, t_f: float, t_bi: float, t_bw: float, act_bytes: int):
            super().__init__()
            self.stage, self.t_f, self.t_bi, self.t_bw = stage, t_f, t_bi, t_bw
            self.act_numel = act_bytes // 4
            self.w = torch.nn.Parameter(torch.ones(1))
            self.anchor = torch.nn.Parameter(torch.zeros(1)) if stage == 0 else None

        def forward(self, x):
            stage = self.stage
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, stage),
                                                          lambda s: s.t):
                a = SleepInput.apply(x, self.anchor, self.t_f, self.t_bi, self.act_numel,
                                     stage)
            return a * SleepWeight.apply(self.w, self.t_bw, stage)

    return SyntheticStage


class PipeRank:
    """One pipeline rank: a gloo process group member that builds raylm's PipelineRuntime
    over synthetic stages and times its steps."""

    def __init__(self, rank: int, world: int, port: int):
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        self.runtime = None

    def build(self, schedule: str, cfg: dict):
        import torch
        import torch.distributed as dist

        from raylm.parallel.pipeline.runtime import PipelineRuntime
        from raylm.plan.partition import Partition, stage_ranks, virtual_stages

        p, m = self.world, cfg["m"]
        v = virtual_stages(schedule, cfg["virtual"])
        part = Partition(bounds=[(s, s + 1) for s in range(p * v)],
                         stage_rank=stage_ranks(schedule, p, v))
        stage_ids = part.stages_of(self.rank)
        Stage = _stage_functions()
        modules = [Stage(s, *stage_times(cfg, v), cfg["act_kib"] * 1024) for s in stage_ids]
        model = torch.nn.ModuleDict({f"stage{s}": mod for s, mod in zip(stage_ids, modules)})
        holders = {n: [self.rank] for n, _ in model.named_parameters()}
        self.model = model
        self.runtime = PipelineRuntime(
            model, modules, stage_ids, part, holders, schedule, m,
            lambda out, target: ((out - target) ** 2).mean(), dist.group.WORLD, self.rank,
            torch.device("cpu"), {})
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(m * cfg["mb_rows"], cfg["hidden"], generator=g)
        self.y = torch.zeros(m * cfg["mb_rows"], cfg["hidden"])
        return {"stages": stage_ids, "order": self._order() if self.rank == 0 else None}

    def _order(self) -> dict:
        """Every rank's compute actions, in the order torch's schedule runs them: the
        action lists of a multi-stage schedule (what its runtime executes)."""
        order = getattr(self.runtime.schedule, "pipeline_order_with_comms", None)
        if order is None:
            return None  # gpipe, 1f1b: see single_stage_order
        return {int(rank): [(a.computation_type.value, int(a.stage_index),
                             int(a.microbatch_index)) for a in actions
                            if a is not None and a.computation_type.value in COMPUTE]
                for rank, actions in order.items()}

    def run(self, warmup: int, steps: int) -> dict:
        import torch.distributed as dist

        times, events = [], []
        for i in range(warmup + steps):
            if i == warmup:
                PEAK.clear()
                PEAK.update(LIVE)
                SLEEP.update(ops=0, over_s=0.0)
            dist.barrier()
            EVENTS.clear()
            t0 = time.perf_counter()
            self.runtime.run(self.x, self.y, {})
            t1 = time.perf_counter()
            self.model.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append((t0, t1))
                events.append(list(EVENTS))
        return {"times": times, "events": events, "peak": dict(PEAK),
                "sleep_ops": SLEEP["ops"], "sleep_over_s": SLEEP["over_s"]}

    def plain(self, cfg: dict, v: int, warmup: int, steps: int) -> dict:
        """The synthetic stage alone in a plain loop, no pipeline and no runtime: m
        forwards, then m full backwards, each call timed (median over the timed steps).
        Every rank runs it at once, as in a pipeline step: the same sleeps, the same
        load on the machine, so each op costs here what it costs a pipeline rank minus
        what the runtime adds. A stage with an input gradient (stage 1's role)."""
        import torch

        Stage = _stage_functions()
        stage = Stage(1, *stage_times(cfg, v), cfg["act_kib"] * 1024)
        fwd, bwd = [], []
        for i in range(warmup + steps):
            xs = [torch.randn(cfg["mb_rows"], cfg["hidden"], requires_grad=True)
                  for _ in range(cfg["m"])]
            outs = []
            for x in xs:
                t0 = time.perf_counter()
                outs.append(stage(x))
                fwd.append(time.perf_counter() - t0)
            for out in outs:
                g = torch.ones_like(out)
                t0 = time.perf_counter()
                out.backward(g)
                bwd.append(time.perf_counter() - t0)
            if i < warmup:
                fwd.clear()
                bwd.clear()
        EVENTS.clear()
        return {"f_s": statistics.median(fwd), "b_s": statistics.median(bwd)}

    def close(self):
        import torch.distributed as dist

        self.runtime = None
        dist.destroy_process_group()
        return True


# ----------------------------------------------------------------------------------------
# Ideals, on the driver.

def _costs(t_f: float, t_bi: float, t_bw: float):
    def cost(kind: str, stage: int) -> float:
        if kind == "F":
            return t_f
        if kind == "B":
            return t_bi + t_bw
        if kind == "I":  # torch: stage 0 has no input gradient, its I does nothing ...
            return 0.0 if stage == 0 else t_bi
        return t_bi + t_bw if stage == 0 else t_bw  # ... and its W runs the whole backward

    return cost


def stage_costs(schedule: str, cfg: dict, v: int):
    return _costs(*stage_times(cfg, v))


def own_costs(schedule: str, cfg: dict, v: int, own: dict):
    """stage_costs with each op at the cost the synthetic stage has on its own (PipeRank
    .plain at the same v: its sleeps plus its own code, Python and autograd, and the
    sleeps' overshoot). A split backward's I and W each take half of what a full
    backward adds to its two sleeps; stage 0's I does nothing, its W is the whole
    backward (as in stage_costs)."""
    t_f, t_bi, t_bw = stage_times(cfg, v)
    extra_f = max(0.0, own["f_s"] - t_f)
    extra_b = max(0.0, own["b_s"] - (t_bi + t_bw))
    nominal, extra = _costs(t_f, t_bi, t_bw), _costs(extra_f, extra_b / 2, extra_b / 2)
    return lambda kind, stage: nominal(kind, stage) + extra(kind, stage)


def single_stage_order(schedule: str, p: int, m: int) -> dict:
    """The order ScheduleGPipe and Schedule1F1B run their ops in, as raylm's CPU ranks run
    them (raylm.parallel.pipeline.runtime: torch's order with the receives posted up
    front; their pipeline_order IR is only a drawing, and torch 2.13's 1F1B one numbers
    the last stage's micro-batches from 1). GPipe: all forwards, then all backwards.
    1F1B: min(m, p - s) forwards, then backward/forward pairs, then the remaining
    backwards."""
    from raylm.parallel.pipeline.runtime import GLOO_CLASSES

    order = GLOO_CLASSES[schedule].order
    return {s: [(kind, s, i) for kind, i in order(s, p, m)] for s in range(p)}


def simulate(order: dict, num_stages: int, cost) -> float:
    """Makespan of the ranks' action lists with the given costs: each rank runs its list
    in order, an op starts when its rank is free and its inputs exist (F(s) after F(s-1);
    B/I(s) after F(s) and B/I(s+1); W(s) after I(s)); communication is free."""
    done: dict = {}
    free = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}
    left = sum(len(a) for a in order.values())
    while left:
        progress = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                kind, s, mb = acts[pos[r]]
                if kind == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", s, mb)] + ([("G", s + 1, mb)] if s < num_stages - 1 else [])
                else:
                    deps = [("G", s, mb)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + cost(kind, s)
                free[r] = end
                done[("G" if kind in ("B", "I") else kind, s, mb)] = end
                pos[r] += 1
                left -= 1
                progress = True
        if not progress:
            raise RuntimeError("the schedule's action lists deadlock in the simulation")
    return max(free.values())


def expected_peak(order: dict) -> dict:
    """Micro-batches whose activation a stage holds at most, replaying the action order:
    +1 at F, -1 at a full backward B, and at W for a split one (I retains the graph)."""
    live: dict = {}
    peak: dict = {}
    for acts in order.values():
        for kind, s, _ in acts:
            if kind == "F":
                live[s] = live.get(s, 0) + 1
                peak[s] = max(peak.get(s, 0), live[s])
            elif kind in ("B", "W"):
                live[s] -= 1
    return peak


def breakdown(order: dict, events: list, t0: float) -> dict | None:
    """Where one measured step's time went, from the ranks' synthetic-work timestamps
    (events: (kind, stage, start, end), all ranks, one clock) laid on the action order.

    For every action: its rank was free at the end of its previous action (or at t0),
    its inputs were ready at the end of the actions it depends on; the wait between
    max(those) and the start of its synthetic work is overhead, charged to
      * handoff: an input from another rank came last (p2p over gloo, waking up, the
        schedule's code between the two ranks' work),
      * local: the rank itself came last (the schedule's and autograd's own code
        between two ops, and local hand-offs between two stages of a rank).
    Returns the mean of each per occurrence, and the time before the first and after
    the last action."""
    seen: dict = {}
    work: dict = {}  # (kind, stage, mb) -> (start, end) of a sleep
    for kind, s, a, b in sorted(events, key=lambda e: e[2]):
        mb = seen.get((kind, s), 0)
        seen[(kind, s)] = mb + 1
        work[(kind, s, mb)] = (a, b)

    def span(*keys):
        got = [work[k] for k in keys if k in work]
        return (min(a for a, _ in got), max(b for _, b in got)) if got else None

    timing: dict = {}
    for acts in order.values():
        for kind, s, mb in acts:
            if kind == "F":
                t = span(("F", s, mb))
            elif kind == "B" or (kind == "W" and s == 0):
                t = span(("I", s, mb), ("W", s, mb))
            elif kind == "I":
                t = None if s == 0 else span(("I", s, mb))
            else:
                t = span(("W", s, mb))
            if t is None and not (kind == "I" and s == 0):
                return None  # events missing: no breakdown
            timing[(kind, s, mb)] = t
    rank_of = {s: r for r, acts in order.items() for _, s, _ in acts}
    last = max(s for s in rank_of)
    hand, local, first = [], [], []
    for r, acts in order.items():
        free = t0
        for kind, s, mb in acts:
            t = timing[(kind, s, mb)]
            if t is None:  # stage 0's I: nothing runs
                timing[(kind, s, mb)] = (free, free)
                continue
            if kind == "F":
                deps = [("F", s - 1, mb)] if s > 0 else []
            elif kind in ("B", "I"):
                deps = [("F", s, mb)]
                if s < last:
                    up = ("I", s + 1, mb) if ("I", s + 1, mb) in timing else ("B", s + 1, mb)
                    deps.append(up)
            else:
                deps = [("I", s, mb)]
            ready = max([free] + [timing[d][1] for d in deps])
            remote = [d for d in deps if rank_of[d[1]] != r and timing[d][1] >= ready]
            wait = max(0.0, t[0] - ready)
            if not deps and free == t0:
                first.append(wait)
            elif remote:
                hand.append(wait)
            else:
                local.append(wait)
            free = t[1]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {"handoff_ms": 1000 * mean(hand), "handoffs": len(hand),
            "local_ms": 1000 * mean(local), "locals": len(local),
            "start_ms": 1000 * mean(first)}


def _ratio(a: float, b: float) -> float:
    """a / b, or NaN for an ideal of 0 (zero-cost stages)."""
    return a / b if b > 0 else float("nan")


def formula(schedule: str, cfg: dict, v: int) -> float:
    p, m, t = cfg["pp"], cfg["m"], (cfg["t_f"] + cfg["t_b"]) / 1000
    if schedule in ("gpipe", "1f1b"):
        return (m + p - 1) * t
    if schedule == "interleaved_1f1b":
        return (m + (p - 1) / v) * t
    return m * t  # zero_bubble


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from raylm.plan.partition import check_schedule, virtual_stages

    from benchmarks.results import write

    p, m = args.pp, args.microbatches
    cfg = dict(pp=p, m=m, t_f=args.t_f, t_b=args.t_b, w_frac=args.w_frac,
               virtual=args.virtual, act_kib=args.act_kib, mb_rows=args.mb_rows,
               hidden=args.hidden)
    for sched in args.schedules:
        check_schedule(sched, p, virtual_stages(sched, args.virtual), m)

    t_start = time.time()
    print(f"p={p} ranks, m={m} micro-batches of {args.mb_rows} x {args.hidden}; a rank's "
          f"share of the model costs t_f={args.t_f:g} ms forward, t_b={args.t_b:g} ms "
          f"backward (weight part {args.w_frac:g}); activation K={args.act_kib} KiB per "
          f"stage and micro-batch; {args.warmup} warm-up + {args.steps} timed steps; "
          f"{args.repeat} round(s)", flush=True)
    # address="local": a cluster of our own even when another one runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=True)
    actors = []
    runs: dict = {s: [] for s in args.schedules}
    info: dict = {}
    try:
        port = free_port()
        Actor = ray.remote(num_cpus=0, max_restarts=0)(PipeRank)
        actors = [Actor.remote(r, p, port) for r in range(p)]
        own: dict = {}  # v -> the synthetic stage's op costs on their own (PipeRank.plain)
        for v in sorted({virtual_stages(sched, args.virtual) for sched in args.schedules}):
            got = ray.get([a.plain.remote(cfg, v, 1, max(2, args.steps // 3))
                           for a in actors])
            own[v] = {k: statistics.median(g[k] for g in got) for k in ("f_s", "b_s")}
        for rnd in range(args.repeat):
            for sched in args.schedules:
                built = ray.get([a.build.remote(sched, cfg) for a in actors])
                res = ray.get([a.run.remote(args.warmup, args.steps) for a in actors])
                steps = [max(r["times"][i][1] for r in res) - min(r["times"][i][0] for r in res)
                         for i in range(args.steps)]
                peak = {s: r["peak"].get(s, 0)  # each rank's own stages only
                        for b, r in zip(built, res) for s in b["stages"]}
                ops = sum(r["sleep_ops"] for r in res)
                over = sum(r["sleep_over_s"] for r in res)
                if sched not in info:
                    v = virtual_stages(sched, args.virtual)
                    order = built[0]["order"] or single_stage_order(sched, p, m)
                    info[sched] = {"v": v, "order": order,
                                   "order_ops": {r: len(a) for r, a in order.items()},
                                   "sim_s": simulate(order, p * v, stage_costs(sched, cfg, v)),
                                   "own_sim_s": simulate(order, p * v,
                                                         own_costs(sched, cfg, v, own[v])),
                                   "formula_s": formula(sched, cfg, v),
                                   "expected_peak": expected_peak(order)}
                parts = [breakdown(info[sched]["order"],
                                   [e for r in res for e in r["events"][i]],
                                   min(r["times"][i][0] for r in res))
                         for i in range(args.steps)]
                parts = [x for x in parts if x is not None]
                split = ({k: statistics.mean(x[k] for x in parts) for k in parts[0]}
                         if parts else None)
                runs[sched].append({"median_s": statistics.median(steps),
                                    "mean_s": statistics.mean(steps), "steps_s": steps,
                                    "peak_bytes": peak, "breakdown": split,
                                    "sleep_over_ms": 1000 * over / max(1, ops)})
                print(f"  round {rnd + 1} {sched}: median step "
                      f"{runs[sched][-1]['median_s']:.3f} s", flush=True)
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- an actor that failed is killed below anyway
                pass
            ray.kill(a)
        if ray.is_initialized():
            ray.shutdown()
    wall = time.time() - t_start

    print()
    print("step = first rank's start to last rank's end of PipelineRuntime.run over the m "
          "micro-batches; median of the timed steps")
    print("ideal: formula = textbook (gpipe, 1f1b (m+p-1)(t_f+t_b); interleaved "
          "(m+(p-1)/v)(t_f+t_b); zero_bubble m(t_f+t_b));")
    print("       sim = torch's action order for the schedule with the stage costs and free "
          "communication (= formula for gpipe, 1f1b)")
    print("overhead per micro-batch = (measured - sim) / m; per op = (measured - sim) / "
          "(F+B, or F+I+W, ops a rank runs per step)")
    hdr = (f"{'schedule':<17} {'p':>2} {'v':>2} {'m':>3} {'measured s':>10} {'formula s':>9} "
           f"{'sim s':>7} {'/formula':>8} {'/sim':>6} {'/sim med':>8} {'ovh/mb ms':>9} "
           f"{'ovh/op ms':>9}")
    print(hdr)
    summary = {}
    for sched in args.schedules:
        best = min(runs[sched], key=lambda r: r["median_s"])
        med = statistics.median(r["median_s"] for r in runs[sched])
        i = info[sched]
        ops_per_rank = max(i["order_ops"].values())
        over = best["median_s"] - i["sim_s"]
        summary[sched] = {"measured_s": best["median_s"], "median_of_rounds_s": med,
                          "formula_s": i["formula_s"], "sim_s": i["sim_s"],
                          "ratio_formula": _ratio(best["median_s"], i["formula_s"]),
                          "ratio_sim": _ratio(best["median_s"], i["sim_s"]),
                          "ratio_sim_median_rounds": _ratio(med, i["sim_s"]),
                          "overhead_per_mb_ms": 1000 * over / m,
                          "overhead_per_op_ms": 1000 * over / ops_per_rank,
                          "ops_per_rank": ops_per_rank}
        s = summary[sched]
        print(f"{sched:<17} {p:>2} {i['v']:>2} {m:>3} {best['median_s']:>10.3f} "
              f"{i['formula_s']:>9.3f} {i['sim_s']:>7.3f} {s['ratio_formula']:>8.3f} "
              f"{s['ratio_sim']:>6.3f} {s['ratio_sim_median_rounds']:>8.3f} "
              f"{s['overhead_per_mb_ms']:>9.2f} {s['overhead_per_op_ms']:>9.2f}")
    print("(best round shown; '/sim med' = median of the rounds' medians over sim; "
          "ratios for zero-cost stages (--t_f 0 --t_b 0) are meaningless: read the overheads)")
    print()
    print("Where the overhead goes (best round, mean over its timed steps): the wait between "
          "an op's inputs being ready and its")
    print("synthetic work starting. handoff: an input from another rank came last (p2p "
          "over gloo, wake-up, schedule code);")
    print("local: the rank's own previous op came last (schedule and autograd code between "
          "two ops); sleep+: a sleep's overshoot")
    print(f"{'schedule':<17} {'handoff ms':>10} {'per step':>8} {'local ms':>8} "
          f"{'per step':>8} {'sleep+ ms':>9} {'per step':>8}")
    for sched in args.schedules:
        best = min(runs[sched], key=lambda r: r["median_s"])
        b = best["breakdown"]
        sleeps = 3 * m * info[sched]["v"]  # F: 1 sleep; B: 2 (I's and W's); I, W: 1
        if b is None:
            print(f"{sched:<17} (no timestamps)")
            continue
        summary[sched]["breakdown"] = dict(b, sleep_over_ms=best["sleep_over_ms"])
        print(f"{sched:<17} {b['handoff_ms']:>10.2f} {b['handoffs']:>8.0f} "
              f"{b['local_ms']:>8.2f} {b['locals']:>8.0f} {best['sleep_over_ms']:>9.2f} "
              f"{sleeps:>8}")
    print("(per step: occurrences over all ranks; sleeps per step per rank)")
    print()
    print("Against the stage's own cost: each op of the synthetic stage timed in a plain loop "
          "(no pipeline, no runtime; every rank at once,")
    print("the same sleeps and load), its sleeps plus its own Python and autograd code and "
          "the sleeps' overshoot. sim' = the schedule")
    print("played with those costs (free communication); measured / sim' and the overhead "
          "left are what the pipeline runtime adds")
    head = ("sim' s", "/sim'", "/sim' med", "ovh/op' ms")
    print(f"{'schedule':<17} {'F own ms':>8} {'B own ms':>8} {'sim s':>7} {head[0]:>7} "
          f"{'/sim':>6} {head[1]:>6} {head[2]:>9} {head[3]:>11}")
    for sched in args.schedules:
        i, s_ = info[sched], summary[sched]
        o = own[i["v"]]
        best = s_["measured_s"]
        s_["own_sim_s"] = i["own_sim_s"]
        s_["own_f_ms"], s_["own_b_ms"] = 1000 * o["f_s"], 1000 * o["b_s"]
        s_["ratio_own_sim"] = _ratio(best, i["own_sim_s"])
        s_["ratio_own_sim_median_rounds"] = _ratio(s_["median_of_rounds_s"], i["own_sim_s"])
        s_["overhead_per_op_own_ms"] = 1000 * (best - i["own_sim_s"]) / s_["ops_per_rank"]
        print(f"{sched:<17} {1000 * o['f_s']:>8.2f} {1000 * o['b_s']:>8.2f} "
              f"{i['sim_s']:>7.3f} {i['own_sim_s']:>7.3f} {s_['ratio_sim']:>6.3f} "
              f"{s_['ratio_own_sim']:>6.3f} {s_['ratio_own_sim_median_rounds']:>9.3f} "
              f"{s_['overhead_per_op_own_ms']:>11.2f}")
    print(f"(nominal: F {args.t_f:g} ms, B {args.t_b:g} ms per rank's share; divided by v for "
          "multi-stage ranks)")
    if GOAL[0] in summary:
        print(f"\n{GOAL[0]} p={p} m={m}: measured / ideal = {summary[GOAL[0]]['ratio_sim']:.3f} "
              f"(best round), {summary[GOAL[0]]['ratio_sim_median_rounds']:.3f} (median of "
              f"rounds)   goal <= {GOAL[1]}")

    print()
    kib = args.act_kib
    print(f"Peak saved activation per stage, KiB (K = {kib} KiB per micro-batch): autograd's "
          "saved buffers counted through saved_tensors_hooks, max over the timed steps;")
    print("expected = torch's action order replayed (+K at F, -K at the backward that frees "
          "it); gpipe's textbook m K, 1f1b's (p - s) K")
    for sched in args.schedules:
        best = min(runs[sched], key=lambda r: r["median_s"])
        exp = info[sched]["expected_peak"]
        stages = sorted(exp)
        cells = []
        for s in stages:
            meas = best["peak_bytes"].get(s, 0) // 1024
            e = exp[s] * kib
            txt = f"s{s} {meas}/{e}"
            if sched == "gpipe":
                txt += f" (mK {m * kib})"
            elif sched == "1f1b":
                txt += f" ((p-s)K {(p - s) * kib})"
            cells.append(txt)
        print(f"  {sched:<17} measured/expected: " + ", ".join(cells))
    print(f"\nwhole run {wall:.0f} s (Ray start-up and actors included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": runs,
                       "ideal": {k: {kk: vv for kk, vv in v.items()} for k, v in info.items()},
                       "wall_s": wall}, f, indent=2, default=str)
    peaks = {}  # schedule -> stage -> [measured, expected] KiB, the best round's
    for sched in args.schedules:
        best = min(runs[sched], key=lambda r: r["median_s"])
        peaks[sched] = {f"s{s}": [best["peak_bytes"].get(s, 0) // 1024,
                                  info[sched]["expected_peak"][s] * args.act_kib]
                        for s in sorted(info[sched]["expected_peak"])}
    figures = {"config": dict(cfg, steps=args.steps, warmup=args.warmup, rounds=args.repeat,
                              quick=args.quick),
               "schedules": {s: dict(summary[s], v=info[s]["v"]) for s in args.schedules},
               "peak_activation_kib": peaks, "wall_s": wall,
               "goal": {"schedule": GOAL[0], "max_ratio_sim": GOAL[1]}}
    print(f"written to {write('bench_pipeline' + ('-quick' if args.quick else ''), figures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
