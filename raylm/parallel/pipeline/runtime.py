"""One rank's part of a pipeline: its stage modules, the schedule, tied-weight gradients.

torch.distributed.pipelining runs the schedules (PipelineStage, ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleZBVZeroBubble); raylm adds the stage modules
(raylm.parallel.pipeline.stages), which rank runs which stage (raylm.plan.partition), and
what torch's tracer-based split gets wrong: a weight used by two stages on two ranks
(GPT-2's ``wte``, used by the embedding and by ``lm_head``) exists once per rank and its
gradient is summed between those ranks every step. The gradient norm for clipping is
summed over the pipeline with each such weight counted once.

Gradients are not scaled by the schedule (``scale_grads=False``): the loss function already
divides by the global batch's label-token count, as the unpipelined step does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

# (torch's helpers for a list of P2POps: issue them without coalescing, wait for them)
from torch.distributed.pipelining.schedules import _batch_p2p, _ComputationType, _wait_batch_p2p

from raylm.models.dropout import DropoutSites
from raylm.parallel.data import local_tensor
from raylm.plan.partition import Partition


class _PrepostedReceives:
    """A one-stage-per-rank schedule run in torch's order, with every receive of the step
    posted when the step starts and every send left running until it ends (gloo only).

    gloo completes a send only once its receiver has posted the matching receive (a
    rendezvous), and torch's schedules post each receive just before the op that needs
    it and wait for a send together with the next receive (Schedule1F1B's
    fwd_send_bwd_recv and bwd_send_fwd_recv). On gloo that ties every hand-off to the
    peer reaching the same point: a rank done with its op waits for its neighbour to
    finish its own before either goes on, and the data moves only then. With all
    receives posted up front (torch already gives each micro-batch its own receive
    buffers, so this costs no memory) a send completes as soon as it is written and an
    input is waiting when its op starts (benchmarks/bench_pipeline.py).

    Not on NCCL: its point-to-point ops between two ranks run in order on one stream,
    so a send queued behind that peer's pre-posted receives would wait for them forever;
    GPU stages keep torch's own schedules. Multi-stage schedules (interleaved, ZB-V):
    _RecvsFirst."""

    @staticmethod
    def order(stage: int, stages: int, m: int) -> list:
        """The ops ("F" or "B", micro-batch) stage ``stage`` of ``stages`` runs in a step
        of ``m`` micro-batches, in torch's order for the schedule."""
        raise NotImplementedError

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None,
                           losses=None, return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0],
                               target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, m = self._stage, self._n_microbatches
        # (after _initialize_stage: its metadata exchange with the neighbours is done)
        fwd_recvs = [_batch_p2p(stage.get_fwd_recv_ops(i)) for i in range(m)]
        bwd_recvs = [_batch_p2p(stage.get_bwd_recv_ops(i)) for i in range(m)]
        sends = []
        for op, i in self.order(stage.stage_index, stage.num_stages, m):
            if op == "F":
                _wait_batch_p2p(fwd_recvs[i])
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i],
                                                 save_forward_output=return_outputs)
                sends += _batch_p2p(stage.get_fwd_send_ops(i))
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            elif self._has_backward:
                _wait_batch_p2p(bwd_recvs[i])
                stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i),
                                         last_backward=i == m - 1)
                sends += _batch_p2p(stage.get_bwd_send_ops(i))
        _wait_batch_p2p(sends)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(m if self.scale_grads else 1)


class PrepostedGPipe(_PrepostedReceives, ScheduleGPipe):
    """ScheduleGPipe's order (every forward, then every backward) with _PrepostedReceives."""

    @staticmethod
    def order(stage: int, stages: int, m: int) -> list:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


class Preposted1F1B(_PrepostedReceives, Schedule1F1B):
    """Schedule1F1B's order with _PrepostedReceives: stage s runs min(m, stages - s)
    forwards, then one backward and one forward in turn, then the backwards left."""

    @staticmethod
    def order(stage: int, stages: int, m: int) -> list:
        warmup = min(m, stages - stage)
        order = [("F", i) for i in range(warmup)]
        for b in range(m):
            order.append(("B", b))
            if warmup + b < m:
                order.append(("F", warmup + b))
        return order


class _RecvsFirst:
    """A multi-stage schedule (torch's action runtime: interleaved 1F1B, ZB-V) with every
    receive of the step posted when it starts (gloo only), as _PrepostedReceives does
    for one stage per rank: each rank's lowered action list gets its RECV_F and RECV_B
    actions moved to the front, in the order they had (so the receives from one peer
    still match its sends one by one; the runtime waits for each at the op that needs
    it, and for the sends at the step's end). Done where torch lowers the schedule, so a
    lowering done again is reordered too."""

    def _prepare_schedule_with_comms(self, *args, **kwargs):
        super()._prepare_schedule_with_comms(*args, **kwargs)
        recv = (_ComputationType.RECV_F, _ComputationType.RECV_B)
        for rank, actions in self.pipeline_order_with_comms.items():
            first = [a for a in actions if a is not None and a.computation_type in recv]
            rest = [a for a in actions if a is None or a.computation_type not in recv]
            self.pipeline_order_with_comms[rank] = first + rest


class RecvsFirstInterleaved1F1B(_RecvsFirst, ScheduleInterleaved1F1B):
    pass


class RecvsFirstZBV(_RecvsFirst, ScheduleZBVZeroBubble):
    pass


SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")
# On gloo (CPU stages): the same schedules with their receives posted up front.
GLOO_CLASSES = {"gpipe": PrepostedGPipe, "1f1b": Preposted1F1B,
                "interleaved_1f1b": RecvsFirstInterleaved1F1B, "zero_bubble": RecvsFirstZBV}


class PipelineRuntime:
    def __init__(self, model, modules: list, stage_ids: list, part: Partition, holders: dict,
                 schedule: str, num_microbatches: int, loss_fn, pp_group, pp_rank: int,
                 device, tied_groups: dict):
        self.model = model
        self.part = part
        self.pp_group = pp_group
        self.pp_rank = pp_rank
        self.stage_ids = stage_ids
        self.has_first = 0 in stage_ids
        self.has_last = part.num_stages - 1 in stage_ids
        self.num_microbatches = num_microbatches
        self.device = device  # (evaluation's receive buffers: NCCL takes GPU tensors only)
        self.stages = [PipelineStage(m, s, part.num_stages, device, group=pp_group)
                       for m, s in zip(modules, stage_ids)]
        cls = SCHEDULE_CLASSES[schedule]
        if torch.device(device).type == "cpu":
            cls = GLOO_CLASSES.get(schedule, cls)
        target = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(target, n_microbatches=num_microbatches, loss_fn=loss_fn,
                            scale_grads=False)
        self.modules = modules
        # T5: the stage that embeds the decoder's input is fed decoder_input_ids.
        self.needs_decoder_inputs = any(
            getattr(getattr(m, "stage", m), "runs_dec_embed", False) for m in modules)
        # Only the first stage is fed input ids, only the last labels.
        self.needs_data = self.has_first or self.has_last or self.needs_decoder_inputs
        names = dict(model.named_parameters())
        # Tied weights on this rank, and the group of pp ranks each is summed over.
        self.tied = [(names[n], tied_groups[tuple(r)]) for n, r in holders.items()
                     if n in names and len(r) > 1]
        # For the gradient norm: a weight held by several ranks counts on the lowest only.
        self.norm_params = [p for n, p in names.items()
                            if p.requires_grad and holders.get(n, [pp_rank])[0] == pp_rank]

    def sample_dropout(self, seed: int) -> None:
        """Draw each stage's dropout masks per sample (raylm.models.dropout), each stage
        module with its own sites."""
        for m in self.modules:
            m.dropout = [seed, None, DropoutSites(), None]

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
        for m in self.modules:
            m.train(mode)

    def run(self, input_ids, labels, kwargs: dict, step=None, shards=None) -> list:
        """One training pass over ``num_microbatches`` micro-batches (the step's rows,
        stacked; the schedule splits them) of step ``step`` (``shards``: a
        tensor-parallel rank's ShardView of them). Returns the last stage's
        per-micro-batch losses (empty on other ranks)."""
        for m in self.modules:
            if m.dropout is not None:
                m.dropout[1], m.dropout[3] = step, shards
        args = (input_ids,) if self.has_first else ()
        losses: list = []
        self.schedule.step(*args, target=labels if self.has_last else None,
                           losses=losses if self.has_last else None, **kwargs)
        return losses

    def forward_only(self, input_ids, labels, kwargs: dict, loss_fn, modules=None) -> list:
        """Evaluation: each micro-batch forward through the stages in order, with plain
        send/recv between ranks.

        Not the training schedule's eval mode: zero-bubble schedules cannot run without
        backward in torch 2.13, and evaluation has no bubble worth scheduling away.
        ``modules`` replaces this rank's stage modules (an eval-mode export)."""
        modules = dict(zip(self.stage_ids, modules or self.modules))
        n = self.num_microbatches
        chunks = lambda t: list(torch.chunk(t, n)) if t is not None else [None] * n  # noqa: E731
        ids_mb, labels_mb = chunks(input_ids), chunks(labels)
        kw_mb = [{k: v[i] for k, v in ((k, chunks(v)) for k, v in kwargs.items())}
                 for i in range(n)]
        rank_of, last = self.part.stage_rank, self.part.num_stages - 1
        losses = []
        for i in range(n):
            local = None
            for s in range(self.part.num_stages):
                if rank_of[s] != self.pp_rank:
                    continue
                if s == 0:
                    args = (ids_mb[i],)
                elif rank_of[s - 1] == self.pp_rank:
                    args = local
                else:
                    args = self._recv(rank_of[s - 1])
                out = modules[s](*args, **kw_mb[i])
                out = out if isinstance(out, tuple) else (out,)
                if s == last:
                    losses.append(loss_fn(out[0], labels_mb[i]))
                elif rank_of[s + 1] == self.pp_rank:
                    local = out
                else:
                    self._send(out, rank_of[s + 1])
        return losses

    def _send(self, tensors: tuple, peer: int) -> None:
        meta = [(tuple(t.shape), t.dtype) for t in tensors]
        dist.send_object_list([meta], group_dst=peer, group=self.pp_group)
        for t in tensors:
            dist.send(t.contiguous(), group_dst=peer, group=self.pp_group)

    def _recv(self, peer: int) -> tuple:
        box = [None]
        dist.recv_object_list(box, group_src=peer, group=self.pp_group)
        out = []
        for shape, dtype in box[0]:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, group_src=peer, group=self.pp_group)
            out.append(t)
        return tuple(out)

    def sync_tied_grads(self, grad_of=None) -> None:
        """Sum the gradients of a weight held by several stages over its holders.
        ``grad_of(p)``: the tensor to sum instead of ``p.grad`` (ZeRO 1/2: the rows this
        rank owns; holders with the same dp and tp coordinates own the same rows)."""
        for p, group in self.tied:
            g = p.grad if grad_of is None else grad_of(p)
            if g is not None:
                dist.all_reduce(local_tensor(g), op=dist.ReduceOp.SUM, group=group)
