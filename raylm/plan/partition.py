"""Cutting a model's blocks into pipeline stages: balanced, or where the user says.

Works on a model built on the meta device (no weights), so the driver can partition and
explain any size of model before an actor starts. A stage is a contiguous range of the
model's blocks; the first stage also carries the embeddings and the last the final norm
and the head. The balance minimises the most expensive stage, where a block's cost is its
estimated forward FLOPs per token (matmuls and attention scores), ties broken by
parameters; the embeddings cost parameters but almost no compute, and the head costs
both (a large vocabulary is a large matmul).

Which rank runs which stage depends on the schedule: one stage per rank (GPipe, 1F1B),
round-robin ("loop", interleaved 1F1B: rank r runs r, r+p, r+2p, ...) or "V" (zero bubble:
rank r runs r and 2p-1-r, so the first and last stages share rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from raylm.errors import ConfigError
from raylm.models.units import Unit

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass
class Partition:
    """Stage boundaries over the blocks, and which pp rank runs each stage."""

    bounds: list  # (first_block, end_block) per stage, half-open
    stage_rank: list  # pp rank of each stage
    embed: Optional[Unit] = None  # the costs, where the planner computed them
    blocks: list = field(default_factory=list)  # Unit per block
    head: Optional[Unit] = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == pp_rank]

    def _stage_sum(self, s: int, attr: str):
        a, b = self.bounds[s]
        units = self.blocks[a:b] + ([self.embed] if s == 0 else []) + \
            ([self.head] if s == self.num_stages - 1 else [])
        return sum(getattr(u, attr) for u in units)

    def stage_params(self, s: int) -> int:
        return self._stage_sum(s, "params")

    def stage_trainable(self, s: int) -> int:
        return self._stage_sum(s, "trained")

    def stage_flops(self, s: int) -> float:
        return self._stage_sum(s, "flops")


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """The pp rank of each of the pp * virtual stages."""
    if schedule == "zero_bubble":  # V: down the ranks, then back up
        return list(range(pp)) + list(reversed(range(pp)))
    return [s % pp for s in range(pp * virtual)]


def virtual_stages(schedule: str, pp_virtual_stages: int) -> int:
    if schedule == "zero_bubble":
        return 2
    if schedule == "interleaved_1f1b":
        return max(2, pp_virtual_stages)
    return 1


def check_schedule(schedule: str, pp: int, virtual: int, microbatches: int) -> None:
    """The schedule's constraints, as one clear error before any actor starts."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"--pipeline_schedule {schedule}: choose one of "
                          f"{', '.join(PIPELINE_SCHEDULES)}")
    if schedule in ("1f1b", "zero_bubble") and microbatches < pp:
        raise ConfigError(
            f"--pipeline_schedule {schedule} needs at least as many micro-batches per step "
            f"as pipeline stages: --gradient_accumulation_steps {microbatches} < --pp {pp} "
            "(raise --gradient_accumulation_steps or use --pipeline_schedule gpipe)")
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"--pipeline_schedule interleaved_1f1b runs micro-batches in rounds of --pp "
                f"{pp}: --gradient_accumulation_steps {microbatches} must be below {pp} or "
                f"a multiple of it")
    if schedule != "interleaved_1f1b" and virtual > 1 and schedule != "zero_bubble":
        raise ConfigError("--pp_virtual_stages applies to --pipeline_schedule "
                          "interleaved_1f1b only")


def balance(costs: list, num_stages: int, first_extra: tuple, last_extra: tuple) -> list:
    """Contiguous split of ``costs`` (one (flops, params) pair per block) into
    ``num_stages`` non-empty ranges minimising the largest stage, compared as
    (flops, params); the first stage adds ``first_extra``, the last ``last_extra``.

    Exact dynamic programme, O(stages x blocks^2): a few milliseconds for hundreds of
    blocks.
    """
    n = len(costs)
    prefix = [(0.0, 0)]
    for f, p in costs:
        prefix.append((prefix[-1][0] + f, prefix[-1][1] + p))

    def cost(a, b, s):
        f = prefix[b][0] - prefix[a][0]
        p = prefix[b][1] - prefix[a][1]
        if s == 0:
            f, p = f + first_extra[0], p + first_extra[1]
        if s == num_stages - 1:
            f, p = f + last_extra[0], p + last_extra[1]
        return (f, p)

    inf = (float("inf"), float("inf"))
    # best[s][b]: minimal max-cost splitting blocks[:b] into stages 0..s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, b, 0)
    for s in range(1, num_stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                c = max(best[s - 1][a], cost(a, b, s))
                if c < best[s][b]:
                    best[s][b], cut[s][b] = c, a
    bounds, b = [], n
    for s in range(num_stages - 1, 0, -1):
        a = cut[s][b]
        bounds.append((a, b))
        b = a
    bounds.append((0, b))
    return list(reversed(bounds))


def parse_pp_split(text) -> Optional[list]:
    """``--pp_split "3,6,9"`` -> [3, 6, 9] (None when unset); one-line ConfigError when it
    is not a list of block indices."""
    if not text:
        return None
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--pp_split {text}: expected comma-separated block indices, "
                          "e.g. 3,6,9") from None


def manual_bounds(split: list, num_blocks: int, num_stages: int) -> list:
    """``--pp_split 2,4``: the block indices where stages 1, 2, ... begin."""
    if len(split) != num_stages - 1:
        raise ConfigError(f"--pp_split needs {num_stages - 1} boundary(ies) for {num_stages} "
                          f"stages, got {len(split)}")
    edges = [0] + list(split) + [num_blocks]
    for a, b in zip(edges, edges[1:]):
        if not a < b:
            raise ConfigError(f"--pp_split {','.join(map(str, split))}: boundaries must "
                              f"increase strictly within 1..{num_blocks - 1} (the model has "
                              f"{num_blocks} blocks) so that every stage has a block")
    return list(zip(edges, edges[1:]))


def partition(embed: Unit, blocks: list, head: Unit, pp: int, schedule: str = "1f1b",
              virtual: int = 1, split: Optional[list] = None) -> Partition:
    num_stages = pp * virtual
    if num_stages > len(blocks):
        raise ConfigError(
            f"pp={pp}{f' x {virtual} virtual stages' if virtual > 1 else ''} = {num_stages} "
            f"stages, but the model has only {len(blocks)} blocks to divide")
    if split:
        bounds = manual_bounds(split, len(blocks), num_stages)
    else:
        bounds = balance([(u.flops, u.params) for u in blocks], num_stages,
                         (embed.flops, embed.params), (head.flops, head.params))
    return Partition(bounds=bounds, stage_rank=stage_ranks(schedule, pp, virtual),
                     embed=embed, blocks=blocks, head=head)
