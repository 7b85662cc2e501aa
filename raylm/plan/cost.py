"""The cost model: per-rank memory and step time of a layout, from a ModelShape, a
Partition and the Hardware. Pure arithmetic (the planner calls it for every candidate).

Memory per rank, fp32 training with AdamW (Adam moments exp_avg and exp_avg_sq):

* states, for the Psi parameters a rank holds (its pipeline stages; a weight shared by
  two stages of one rank once; tensor-parallel shards 1/tp, replicated norms and
  row-parallel biases whole):
      zero_stage 0: parameters 4 Psi, gradients 4 Psi, optimizer 8 Psi bytes
      zero_stage 1: optimizer 8 Psi / dp               (ZeRO, Rajbhandari et al. 2020)
      zero_stage 2: gradients 4 Psi / dp too
      zero_stage 3: parameters 4 Psi / dp too, plus two blocks gathered at a time
                    (--reshard_after_forward False, and under a pipeline: all Psi
                    gathered during a step, and their gradients unsharded, 4 Psi,
                    when a rank runs more than one micro-batch a step)
* mixed precision (--bf16/--fp16, ``Hardware.compute_bytes`` 2): the states stay fp32
  (master weights, gradients, AdamW); activations as raylm.plan.activations lays out
  (norms and the residual stream fp32, matmul inputs and outputs in 2 bytes); autocast's
  copies of the rank's matrices in 2 bytes, once per step (``weight_copies``), or under
  ZeRO-3 the gathered blocks in 2 bytes (FSDP2's MixedPrecisionPolicy) instead;
* activations: what one micro-batch's forward saves for backward
  (raylm.plan.activations), times the micro-batches a rank holds at its peak: 1 without
  a pipeline (gradient accumulation runs them one by one), per schedule with one
  (raylm.plan.inflight.peak_in_flight: GPipe all, 1F1B stages - stage index, interleaved
  and zero bubble replayed from torch's schedule tables);
* workspace: transient and pipeline buffers: the logits and their gradient on the stage
  with the head (2 x tokens x vocab / tp, plus the cached output under a pipeline), a
  block's widest gradient elsewhere, and torch.distributed.pipelining's per-micro-batch
  receive buffers (activations into a non-first stage, gradients into a non-last one);
  with activation checkpointing, one block's recomputed activations.

Step time per optimizer step (one rank's view; ranks of a pipeline wait for the slowest):

* compute: 3 x forward FLOPs (forward + backward) of the rank's stages, per token, over
  tp, / worker FLOP/s (the precision's: raylm.plan.hardware); forward FLOPs per token are the partition's unit FLOPs (2 per
  weight of every matrix, 4 x seq x heads x head_dim for attention scores and their
  weighted sum, in the blocks that attend: not a Mamba block's state-space mixer,
  raylm.models.units.attends);
* tensor parallelism: 4 all-reduces of a micro-batch's activations (matmul outputs: in
  the compute dtype) per block (2 forward,
  2 backward; reduce-scatter + all-gather under sequence parallelism move as much), one
  more at the embedding and at the head, ring cost 2(tp-1)/tp x bytes / node link +
  2(tp-1) x latency: tp groups sit inside one node;
* pipeline: per micro-batch, the activation sent forward and its gradient sent back at
  each stage boundary (node link when a dp replica fits in a node, else network), and a
  fixed overhead per stage (the schedule's Python and p2p set-up: Hardware); the
  schedule takes (m + (pp-1)/v) x the slowest rank's micro-batch time for m micro-batches,
  v = 1 (GPipe, 1F1B), v virtual stages (interleaved 1F1B), ~3 for zero bubble (its
  weight-gradient work fills most of the bubble);
* data parallelism: the ring all-reduce of the rank's gradients, 2(dp-1)/dp x 4 Psi /
  bandwidth (2 Psi with --reduce_dtype bfloat16), overlapped with the last micro-batch's backward without a pipeline (its
  last 4 MiB bucket never is) and after the schedule with one. Under ZeRO (a
  reduce-scatter or all-gather is half an all-reduce): stage 1 reduce-scatters the
  gradients at the last micro-batch (overlapped as above) and all-gathers the updated
  parameters after the optimizer step (exposed); stage 2 reduce-scatters after every
  micro-batch (each overlapped with that micro-batch's backward), then the same
  all-gather; stage 3 all-gathers each block's parameters in every micro-batch's forward
  and backward (prefetched: what the forward's third of the compute, and the backward's
  two thirds, do not hide counts) and reduce-scatters every micro-batch's gradients, with
  no all-gather after the step (--reshard_after_forward False: the first forward's
  all-gather only and the last backward's reduce-scatter, once a step each, the gathered
  parameters and unsharded gradients held through the step; a pipeline's schedule
  reduce-scatters once a step too);
* the optimizer step and gradient clipping stream ~32 bytes per parameter it updates;
* activation checkpointing: full adds each block's forward again, selective its
  element-wise ops, memory-bound (``recompute_time``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from raylm.plan.dims import ParallelDims
from raylm.plan.hardware import Hardware
from raylm.plan.partition import Partition
from raylm.plan.inflight import peak_in_flight
from raylm.plan.shape import ModelShape
from raylm.plan.zero import theory_bytes

FP32 = 4
BUCKET_BYTES = 4 * 2**20  # raylm.parallel.data's gradient buckets


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims  # ranks along each axis
    micro_batch_size: int
    microbatches: int  # per data-parallel replica and step
    schedule: str = "1f1b"
    virtual: int = 1  # stages per pp rank
    sequence_parallel: bool = False
    zero_stage: int = 0
    recompute: str = "none"  # activation checkpointing: none, selective or full
    reshard_after_forward: bool = True  # zero_stage 3 (False: parameters gathered all step)

    dp = property(lambda self: self.dims.dp)
    tp = property(lambda self: self.dims.tp)
    pp = property(lambda self: self.dims.pp)
    world_size = property(lambda self: self.dims.world_size)


@dataclass
class Memory:
    """Predicted bytes one rank holds at its peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    workspace: float
    in_flight: int = 1  # micro-batches whose activations the rank holds at its peak
    param_count: float = 0  # parameters (elements) the rank holds
    weight_copies: float = 0.0  # autocast's compute-dtype copies of the matrices

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.weight_copies + self.workspace

    def to_dict(self) -> dict:
        return {**asdict(self), "states": self.states, "total": self.total}


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, and where they go."""

    step: float
    compute: float  # the slowest rank's forward+backward, all micro-batches
    tp_comm: float  # its tensor-parallel all-reduces
    pp_comm: float  # its pipeline sends
    bubble: float  # pipeline fill and drain
    dp_comm: float  # exposed gradient all-reduce
    optimizer: float
    tokens_per_s: float
    bubble_fraction: float = 0.0
    parts: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("parts")
        return d


def single_stage(shape: ModelShape) -> Partition:
    """The whole model as one stage (pp = 1)."""
    return Partition(bounds=[(0, shape.num_blocks)], stage_rank=[0], embed=shape.embed,
                     blocks=list(shape.blocks), head=shape.head)


def _rank_stage_params(shape: ModelShape, part: Partition, pp: int) -> list:
    """Per pp rank: (parameters held, of which tensor-parallel sharded, of which
    trained)."""
    last = part.num_stages - 1
    out = []
    for r in range(pp):
        stages = part.stages_of(r)
        total = split = trained = 0
        for s in stages:
            a, b = part.bounds[s]
            total += part.stage_params(s)
            trained += part.stage_trainable(s)
            split += sum(shape.block_split[a:b])
            split += shape.embed_split if s == 0 else 0
            split += shape.head_split if s == last else 0
        if 0 in stages and last in stages and shape.tied:  # one table, once
            if trained == total:
                trained -= shape.tied
            total -= shape.tied
            split -= shape.tied
        out.append((total, split, min(trained, total)))
    return out


def stage_activation_bytes(shape: ModelShape, part: Partition, layout: Layout,
                           hw: Hardware) -> list:
    """Activation bytes one micro-batch leaves on each stage."""
    tokens = layout.micro_batch_size * shape.seq_len
    rec, tp, sp, low = shape.recipe, layout.tp, layout.sequence_parallel, hw.compute_bytes
    block = rec.block_bytes(tokens, shape.seq_len, tp, sp, hw.mask_bytes, layout.recompute,
                            low)
    last = part.num_stages - 1
    acts = []
    for s, (a, b) in enumerate(part.bounds):
        act = (b - a) * block + rec.stage_bytes(shape.seq_len)
        if s == 0:
            act += rec.embed_bytes(tokens, tp, sp, hw.mask_bytes)
        if s == last:
            act += rec.head_bytes(tokens, shape.seq_len, tp, sp, low)
        acts.append(act)
    return acts


def cast_params(shape: ModelShape, part: Partition, stages: list) -> float:
    """Elements of the matrices a rank's ``stages`` multiply by, whole (tensor
    parallelism divides them): what autocast casts to its dtype once per step. The
    blocks' sharded matrices and the output head; an embedding table is looked up, not
    multiplied (unless tied to the head)."""
    last = part.num_stages - 1
    n = 0.0
    for s in stages:
        a, b = part.bounds[s]
        n += sum(shape.block_split[a:b]) + (shape.head_split if s == last else 0)
    return n


def rank_memory(shape: ModelShape, part: Partition, layout: Layout, hw: Hardware) -> list:
    """Memory of each pp rank (every dp/tp replica of a pp rank holds the same)."""
    dp, tp, pp, zero = layout.dp, layout.tp, layout.pp, layout.zero_stage
    m = layout.microbatches
    acts = stage_activation_bytes(shape, part, layout, hw)
    if pp == 1:
        held, rank_act = [1], [acts[0]]
    else:
        held, rank_act = peak_in_flight(layout.schedule, part.stage_rank, m, acts)
    tokens = layout.micro_batch_size * shape.seq_len
    low = hw.compute_bytes
    boundary = tokens * shape.hidden * FP32 / (tp if layout.sequence_parallel else 1)
    logits = 2 * tokens * shape.vocab / tp * FP32
    widest = 2 * tokens * max(shape.intermediate / tp, shape.hidden) * FP32
    # A checkpointed block's recomputed activations, while its backward runs.
    recomputed = shape.recipe.recompute_bytes(tokens, shape.seq_len, tp,
                                              layout.sequence_parallel, hw.mask_bytes,
                                              layout.recompute, low)
    last = part.num_stages - 1
    biggest = max((u.params for u in shape.blocks), default=0)  # (ZeRO-3's unit)
    out = []
    for r, (total, split, trained) in enumerate(_rank_stage_params(shape, part, pp)):
        psi = (total - split) + split / tp  # elements this rank holds
        # Frozen parameters (a LoRA run's base) have no gradient and no optimizer state;
        # tensor parallelism shards its share of the trained ones (the adapters).
        share = shape.trained_split_share
        trained_psi = psi if trained >= total else \
            min(psi, trained * (1 - share) + trained * share / tp)
        stages = part.stages_of(r)
        states = theory_bytes(psi, zero, dp, param_bytes=FP32,
                              trainable=trained_psi)  # (ValueError: no such stage)
        params, grads, opt = states["parameters"], states["gradients"], states["optimizer"]
        work = logits * (1.5 if pp > 1 else 1.0) if last in stages else widest
        if any(part.bounds[s][1] > part.bounds[s][0] for s in stages):
            work += recomputed
        copies = 0.0
        if zero >= 3 and (pp > 1 or not layout.reshard_after_forward):
            # torch's pipeline schedule runs every backward but the step's last without
            # resharding or reducing (PipelineStage.backward_maybe_with_nosync): the
            # stage's parameters end up gathered, whatever --reshard_after_forward, and
            # its gradients accumulate unsharded (fp32) until one reduce-scatter after
            # the last micro-batch. --reshard_after_forward False does the same without
            # a pipeline (raylm.parallel.zero.fsdp.FSDPGradients); with one micro-batch a
            # step its one backward reduces each block's gradient as it comes.
            unsharded = trained_psi if pp > 1 or m > 1 else biggest / tp
            work += low * psi + FP32 * unsharded
        elif zero >= 3:
            # Two blocks gathered (in the compute dtype under mixed precision), one
            # block's gradient (fp32).
            work += low * 2 * biggest / tp + FP32 * biggest / tp
        elif low < FP32:
            copies = low * cast_params(shape, part, stages) / tp
        if pp > 1:  # torch pipelining's receive buffers, one per micro-batch
            for s in stages:
                work += m * boundary * ((s > 0) + (s < last))
        out.append(Memory(parameters=params, gradients=grads, optimizer=opt,
                          activations=rank_act[r], workspace=work,
                          in_flight=max(held[s] for s in stages), param_count=psi,
                          weight_copies=copies))
    return out


def recompute_time(shape: ModelShape, layout: Layout, hw: Hardware, tokens: int) -> float:
    """Seconds one block's activation checkpointing adds to a micro-batch: full runs its
    forward again (its FLOPs); selective recomputes only element-wise ops, memory-bound:
    what they bring back, written once and read once."""
    if layout.recompute == "none":
        return 0.0
    if layout.recompute == "full":
        mean_flops = sum(u.flops for u in shape.blocks) / max(1, len(shape.blocks))
        return mean_flops * tokens / layout.tp / hw.worker_flops
    again = shape.recipe.recompute_bytes(tokens, shape.seq_len, layout.tp,
                                         layout.sequence_parallel, hw.mask_bytes,
                                         layout.recompute, hw.compute_bytes)
    return 2 * again / hw.memory_bw


def allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` workers."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def step_time(shape: ModelShape, part: Partition, layout: Layout, hw: Hardware,
              ranks: list) -> StepTime:
    """The step time of ``layout``; ``ranks``: rank_memory's result (parameters held)."""
    dp, tp, pp, m = layout.dp, layout.tp, layout.pp, layout.microbatches
    tokens = layout.micro_batch_size * shape.seq_len
    act_bytes = tokens * shape.hidden * FP32  # the residual stream (pipeline sends)
    matmul_out = tokens * shape.hidden * hw.compute_bytes  # (tp all-reduces)
    one_node = layout.world_size <= hw.workers_per_node
    replica_in_node = tp * pp <= hw.workers_per_node
    pp_bw, pp_lat = ((hw.node_link_bw, hw.latency_node) if replica_in_node
                     else (hw.network_bw, hw.latency_network))
    dp_bw, dp_lat = ((hw.node_link_bw, hw.latency_node) if one_node
                     else (hw.network_bw, hw.latency_network))
    tp_msg = allreduce_time(matmul_out, tp, hw.node_link_bw, hw.latency_node)
    p2p_msg = act_bytes / (tp if layout.sequence_parallel else 1) / pp_bw + pp_lat
    last = part.num_stages - 1
    per_rank = []
    for r in range(pp):
        stages = part.stages_of(r)
        flops = sum(part.stage_flops(s) for s in stages)
        compute = 3 * flops * tokens / tp / hw.worker_flops
        blocks = sum(part.bounds[s][1] - part.bounds[s][0] for s in stages)
        compute += blocks * recompute_time(shape, layout, hw, tokens)
        n_ar = 4 * blocks + (0 in stages) + (last in stages)
        tp_c = n_ar * tp_msg if tp > 1 else 0.0
        sends = sum((s < last) + (s > 0) for s in stages) if pp > 1 else 0
        pp_c = sends * p2p_msg + (len(stages) * hw.stage_overhead if pp > 1 else 0.0)
        zero3 = kept = 0.0
        if layout.zero_stage >= 3 and dp > 1:
            # The parameters' all-gather, each block's prefetched behind the compute
            # before it: behind the forward (a third of the compute), and again behind
            # the backward (two thirds) when they were freed after the forward.
            gather = (dp - 1) / dp * hw.compute_bytes * ranks[r].param_count / dp_bw
            forward = max(0.0, gather - compute / 3)
            if layout.reshard_after_forward:  # both, in every micro-batch
                zero3 = forward + max(0.0, gather - 2 * compute / 3)
            else:  # kept from the step's first forward to its last backward: once a step
                kept = forward
        per_rank.append((compute + tp_c + pp_c + zero3, compute, tp_c, pp_c, kept))
    slow = max(range(pp), key=lambda r: per_rank[r][0])
    t_mb, compute, tp_c, pp_c, _ = per_rank[slow]
    gathered_once = max(k[4] for k in per_rank)
    v = {"interleaved_1f1b": layout.virtual, "zero_bubble": 3}.get(layout.schedule, 1)
    bubble = (pp - 1) / v * t_mb if pp > 1 else 0.0
    pipe = m * t_mb + bubble

    grads = max(hw.reduce_bytes * r.param_count for r in ranks)
    zero = layout.zero_stage if dp > 1 else 0
    if zero == 0:
        dp_full = allreduce_time(grads, dp, dp_bw, dp_lat)
        if dp > 1 and pp == 1:
            tail = allreduce_time(min(grads, BUCKET_BYTES), dp, dp_bw, dp_lat)
            dp_c = max(dp_full - 2 / 3 * per_rank[0][1], tail)  # vs the last backward
        else:
            dp_c = dp_full
    else:
        # Reduce-scatter (gradients) and all-gather (parameters): half an all-reduce each.
        half = allreduce_time(grads, dp, dp_bw, dp_lat) / 2
        tail = allreduce_time(min(grads, BUCKET_BYTES), dp, dp_bw, dp_lat) / 2
        backward = 2 / 3 * compute  # one micro-batch's backward on the slowest rank
        hidden = (lambda t: max(t - backward, tail)) if pp == 1 else (lambda t: t)
        # Stage 1, and stage 3 accumulating its gradients unsharded (under a pipeline,
        # or with --reshard_after_forward False): once, at the last micro-batch.
        once = zero == 1 or (zero >= 3 and (pp > 1 or not layout.reshard_after_forward))
        scatters = 1 if once else m
        dp_c = scatters * hidden(half) + (half if zero in (1, 2) else 0.0)
        dp_c += gathered_once  # --reshard_after_forward False: the step's one gather
    updated = max(r.param_count for r in ranks) / (dp if layout.zero_stage >= 1 else 1)
    opt = 32 * updated / hw.memory_bw
    step = pipe + dp_c + opt
    return StepTime(step=step, compute=m * compute, tp_comm=m * tp_c, pp_comm=m * pp_c,
                    bubble=bubble, dp_comm=dp_c, optimizer=opt,
                    tokens_per_s=dp * m * tokens / step,
                    bubble_fraction=bubble / pipe if pipe else 0.0)
