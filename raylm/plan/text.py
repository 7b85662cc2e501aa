"""Plan figures in words: byte sizes, and a pipeline partition one line per stage (the
driver's log; `raylm plan` adds more, raylm.report.plan_report)."""

from __future__ import annotations

from typing import Optional

from raylm.plan.partition import Partition

BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weights, gradients, AdamW moments


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
