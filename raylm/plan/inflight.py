"""Micro-batches in flight: how many micro-batches' activations each pipeline stage (and
each pp rank) holds at its peak under a schedule. GPipe holds all of them; 1F1B
(stages - stage index); interleaved 1F1B and zero bubble are replayed from torch's own
schedule tables (a rank's stages peak at different times)."""

from __future__ import annotations

import functools


def in_flight(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, num_stages - stage)


@functools.lru_cache(maxsize=256)
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
        events.append(tuple(ev))
    return tuple(events)


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
