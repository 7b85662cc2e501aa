"""RankWorker: the Ray actor that owns one rank of the layout.

It joins the torch.distributed world the driver arranged (``join``), has its engine built
(``build``: the model, its layout and optimizer, raylm.runtime.engine), reads its own
samples from the tokenized cache, and runs the steps the driver hands it. Gradients and
losses move between ranks over the process groups; the driver only sees scalars.
"""

from __future__ import annotations

import logging
import os
import time
import contextlib
from datetime import timedelta

import ray

from raylm import storage
from raylm.data.sampler import replica_schedule
from raylm.models.lora import save_lora
from raylm.parallel.mesh import build_mesh
from raylm.runtime.faults import Faults
from raylm.runtime.metrics import perplexity
from raylm.runtime.precision import save_in_dtype, saved_dtype
from raylm.runtime.profiling import StepClock, StepProfiler
from raylm.runtime.protocol import EvalResult, StepRequest, StepResult, StepTable, \
    WindowRequest

_NO_REGION = contextlib.nullcontext()

log = logging.getLogger("raylm")


# What a rank does in a step, in order (RankWorker.doing): a step that does not end, and
# its ranks furthest behind in this order, are what the others wait for.
STEP_PHASES = ("data", "forward and backward", "clip", "prepared", "optimizer step")


_frozen = False  # (_freeze_imports: once per process)


def _freeze_imports() -> None:
    """Import the engine's code, then set all the process holds aside from the garbage
    collector (gc.freeze): a full collection (leave_group, reset) then scans only what
    the runs made, not every object of torch's and transformers' imports. Once per
    process, before any process group exists: a group frozen in a reference cycle
    would never be collected, nor its connections closed."""
    global _frozen
    if _frozen:
        return
    import gc
    import importlib

    importlib.import_module("raylm.runtime.engine")
    gc.collect()  # (the imports' own garbage goes first)
    gc.freeze()
    _frozen = True


class RankWorker:
    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        # Before any process group exists: torch.distributed.nn.functional's collectives
        # take ``group=group.WORLD`` as default arguments, evaluated at import. Imported
        # after init_process_group (the engine imports it), they would hold the first
        # WORLD group for the life of the process, and its gloo connections would stay
        # open after the rank left it: a peer blocked on this rank would not be released.
        import torch.distributed.nn  # noqa: F401

        _freeze_imports()
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.engine = None  # raylm.runtime.engine.Engine, once built
        self.warm_model = (None, None)  # (on the meta device, model) built by warm_up
        self.prefetcher = None
        self.generation = 0  # of the process group this rank is in
        self.prepared = None  # the step whose update is prepared, not yet committed
        self.faults = Faults()  # injected faults (tests: raylm.runtime.faults)
        self.committed_step = None  # the last step this rank committed
        self.exported = None  # this rank's state in the object store (leave_group)
        self.keepers = []  # snapshot keepers (--snapshot_steps)
        self.snapshots = None  # raylm.runtime.snapshots.SnapshotSender, once it snapshots
        self.snapshot_s = 0.0  # time the snapshots took on this rank's critical path
        # When the last step returned, and the time of the calls run since (its commit,
        # a checkpoint, an evaluation): boundary_idle_s.
        self.returned_at, self.busy_s = None, 0.0
        self.optimizer_s = None  # the last optimizer step's time, or its marks (commit)
        self.profiler = None  # raylm.runtime.profiling.StepProfiler under --profile
        self.profiled = False
        self.store = None  # (address, client) of the group's rendezvous store (_store)
        # What this rank is doing, for the driver's heartbeats (ping): (step, index in
        # STEP_PHASES) in a step, (committed step, -1) with what otherwise.
        self.doing = (0, -1, "starting")
        self.stop_window = None  # the window (its first step) the driver asked to end
        self.sampler = (None, None)  # (its ObjectRef, the run's sampler): --step_protocol
        self.agreed = None  # (step, StepTable) of the last step agreed on (last_agreed)

    # -- heartbeat -------------------------------------------------------------------------
    @ray.method(concurrency_group="health")
    def ping(self, known: bool = False) -> tuple:
        """What this rank is doing (``doing``) and its TCP sockets (``local_endpoints``;
        None when ``known`` and unchanged since the last ping), answered on a thread of its
        own: a rank busy training answers; one frozen, or on a node cut off, does not
        (raylm.runtime.health)."""
        from raylm.runtime.health import local_endpoints

        endpoints = local_endpoints()  # (how a peer finds its connections to this rank)
        changed = not known or endpoints != getattr(self, "reported_endpoints", None)
        self.reported_endpoints = endpoints
        return getattr(self, "doing", (0, -1, "starting")), endpoints if changed else None

    @ray.method(concurrency_group="health")
    def ask_stop(self, first: int) -> bool:
        """End the window of steps from ``first`` (``run_steps``) early: this rank says
        so in its next step's row, and every rank stops after that step."""
        self.stop_window = first
        return True

    @ray.method(concurrency_group="health")
    def release(self, peer_endpoints, abort: bool = False) -> int:
        """Shut down this rank's connections to lost peers (their endpoints, from their
        last heartbeat), beside a training thread that may be blocked on them in a
        collective: that collective raises, and this rank keeps its state. ``abort``:
        abort its NCCL communicators too (raylm.runtime.health.abort_groups)."""
        from raylm.runtime.health import abort_groups, release_sockets

        shut = release_sockets(peer_endpoints)
        if abort:
            abort_groups()
        return shut

    def _doing_step(self, step: int, phase: int) -> None:
        self.doing = (step + 1, phase, STEP_PHASES[phase])

    def _doing(self, what: str) -> None:
        self.doing = (self.committed_step or 0, -1, what)

    # -- set-up ----------------------------------------------------------------------------
    def info(self) -> dict:
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "generation": self.generation, "committed_step": self.committed_step,
                "device": _device_name()}

    def _store(self, master: str, timeout: timedelta):
        """A client of the rendezvous store at ``master`` (the driver's: WorkerGroup
        .rendezvous), kept across the group's generations: a regroup opens no new
        connection (each costs torch a lookup of the peer's name)."""
        import torch.distributed as dist

        if self.store is None or self.store[0] != master:
            host, port = master.rsplit(":", 1)
            self.store = (master, dist.TCPStore(host, int(port), None, is_master=False,
                                                timeout=timeout, wait_for_workers=False))
        return self.store[1]

    def join(self, master: str, plan, collective_timeout_s: float,
             generation: int = 0) -> bool:
        """Join the world's process group at ``master`` and build the mesh of
        ``plan.dims``. Separate from ``build``: a rank can join a new group (another
        world size) and keep what it holds (``regroup``).

        The rendezvous keys carry the group's ``generation``: an actor of an older group
        (one the driver gave up on) can never complete a newer group's rendezvous."""
        self._doing(f"joining generation {generation} of its group")
        import torch
        import torch.distributed as dist

        self.plan = plan
        self.generation = generation
        self.collective_timeout_s = collective_timeout_s
        self.device = torch.device("cuda", 0) if plan.use_gpu else torch.device("cpu")
        _gloo_on_node_address()
        timeout = timedelta(seconds=collective_timeout_s)
        store = self._store(master, timeout)
        dist.init_process_group("nccl" if plan.use_gpu else "gloo",
                                store=dist.PrefixStore(f"raylm/generation-{generation}", store),
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        # One mesh, named dims; every parallelism takes its groups from it.
        self.mesh = build_mesh(plan.dims, self.device.type)
        return True

    def warm_up(self, spec, seed: int, on_meta: bool, master: str,
                collective_timeout_s: float) -> dict:
        """What a rank that will join a running group does before it joins, while the
        live ranks train on: the heavy imports (torch, transformers, the engine), its
        connection to the group's rendezvous at ``master``, and its initial model
        (raylm.runtime.engine.initial_model: the whole model, or its skeleton,
        ``on_meta``: raylm.runtime.engine.builds_on_meta), which ``build`` then takes
        instead of building one while the live ranks wait."""
        from raylm.runtime.engine import initial_model

        t0 = time.time()
        self._store(master, timedelta(seconds=collective_timeout_s))
        self.warm_model = (on_meta, initial_model(spec, seed, on_meta))
        return {"warm_up_s": time.time() - t0}

    def join_running(self, master: str, plan, rank: int, world_size: int, generation: int,
                     spec, dataset, train_cfg: dict, total_steps: int, src: int,
                     committed_step: int) -> dict:
        """A newcomer joins a running group at a step boundary: the process group, its
        engine, then a live replica's state (``src``; raylm.runtime.engine
        .Engine.broadcast_state, collective with the ranks' ``send_state``) and the LR
        schedule at ``committed_step``."""
        t0 = time.time()
        self.rank, self.world_size = rank, world_size
        self.join(master, plan, train_cfg["collective_timeout_s"], generation)
        t_join = time.time()
        self.build(spec, dataset, train_cfg, total_steps)
        t_build = time.time()
        self.engine.broadcast_state(src)
        self.engine.set_schedule_step(committed_step)
        self.committed_step = committed_step
        return {"rank": rank, "join_s": t_join - t0, "build_s": t_build - t_join,
                "state_s": time.time() - t_build}

    def send_state(self, src: int) -> bool:
        """The live ranks' side of a newcomer's ``join_running``."""
        self._state_settled()  # (the replicas other than ``src`` receive its state)
        self.engine.broadcast_state(src)
        return True

    def regroup(self, master: str, plan, rank: int, world_size: int, generation: int) -> dict:
        """Leave the old process group (a rank of it died) and join generation
        ``generation`` as ``rank`` of ``world_size`` under ``plan``, keeping the model
        and the optimizer state in memory (raylm.runtime.engine.Engine.regroup). A step
        that had not committed is dropped first."""
        import torch.distributed as dist

        t0 = time.time()
        self.prepared, self.returned_at = None, None
        if dist.is_initialized():  # (a group that grows: every rank leaves it well)
            self.leave_group(collect=False)
        self.rank, self.world_size = rank, world_size
        self.join(master, plan, self.collective_timeout_s, generation)
        self.faults.trip(self.rank, self.committed_step, "recovery", self.generation)
        self.engine.regroup(plan, rank, self.mesh)
        return {"rank": rank, "regroup_s": time.time() - t0}

    def build(self, spec, dataset, train_cfg: dict, total_steps: int) -> dict:
        """Build this rank's engine (model, layout, optimizer: raylm.runtime.engine) and
        open the data."""
        self._doing("building its engine")
        import torch

        from raylm.data.reader import Prefetcher, make_reader
        from raylm.runtime.engine import build_engine

        t0 = time.time()
        self.cfg = train_cfg
        # What a rebuild under another layout needs again.
        self.spec, self.dataset, self.total_steps = spec, dataset, total_steps
        self.faults = Faults(train_cfg.get("faults"))
        # A newcomer's model from its warm-up (the engine takes it if it suits the plan).
        warm, self.warm_model = self.warm_model, (None, None)
        self.engine = build_engine(self.plan, self.rank, self.mesh, self.device, spec,
                                   train_cfg, total_steps,
                                   bool(dataset is not None and dataset.line_by_line), warm)
        # Dropout differs per rank, and is reproducible per rank; tensor-parallel peers
        # share a seed (they compute the same replicated activations).
        torch.manual_seed(train_cfg["seed"] + 1 + self._seed_rank)
        self.measure_next = True  # the first step measures what the rank holds
        self.committed_step = 0  # (load_checkpoint: the checkpoint's)
        # The cache's reader, or --streaming's (blocks named with each step).
        self.reader = make_reader(dataset) if dataset is not None else None
        # The next step's batches are read, and split by the objective, meanwhile.
        self.prefetcher = (Prefetcher(self.reader, prepare=self._prepare)
                           if self.reader is not None else None)
        self.eval_reader = None
        if train_cfg.get("profile") and not self.profiled:
            self.profiler = StepProfiler(train_cfg["profile_dir"], self.rank,
                                         int(train_cfg.get("profile_steps") or 1),
                                         cuda=torch.cuda.is_available())
            self.profiled = True  # once per process (a rebuild does not trace again)
        return {"rank": self.rank, "setup_s": time.time() - t0,
                "parameters": sum(p.numel() for p in self.engine.model.parameters())}

    def _prepare(self, step: int, batch: dict) -> None:
        engine = self.engine  # (the prefetch thread: the engine of the moment)
        if engine is not None:
            engine.split(batch, step)

    @property
    def _seed_rank(self) -> int:
        return self.plan.dims.seed_index(self.rank)

    # -- the training step -----------------------------------------------------------------
    def train_step(self, req: StepRequest) -> StepResult:
        """Prepare the optimizer step after ``req.step`` committed ones, over this rank's
        micro-batches (sample ids from the driver); a commit applies it. The driver's
        commit of the step before, when it has not sent it on its own, comes with the
        request (``req.commit``) and is applied first.

        Read top to bottom: data (the next step's prefetched meanwhile), forward and
        backward over the micro-batches with the gradients summed over dp (the engine's:
        a loop, or a pipeline schedule), clip. Returns scalars only. The optimizer step
        waits for the driver's commit, sent once every rank prepared the step
        (raylm.runtime.protocol): a rank that dies mid-step leaves the survivors' state
        at the last committed step.
        """
        self._check_generation(req.generation)
        try:
            if req.commit is not None:
                self.commit(req.commit, req.generation)
            if self.prepared is not None:  # a missed commit must never go unnoticed
                raise RuntimeError(f"step {self.prepared} was prepared and neither "
                                   "committed nor dropped")
            self.engine.loss_scale = req.loss_scale
            if req.blocks is not None and hasattr(self.reader, "hold"):
                self.reader.hold(req.blocks)
            return self._train_step(req.step, req.micro_batch_ids, req.next_ids)
        except Exception as e:
            failure = f"rank {self.rank}, step {req.step + 1}: {type(e).__name__}: {e}"
        # Raised outside the handler, so no traceback keeps the step's frames (and the
        # collective work objects in them, which hold the process group) alive:
        # leave_group must be able to drop the group's last reference.
        raise RuntimeError(failure)

    # -- steps the ranks run on their own (--step_protocol ranks) --------------------------
    def stream_steps(self, req: WindowRequest):
        """Rank 0's part of ``run_steps``: each step's table of every rank's answer is
        yielded as it commits (the driver's one answer per step), then the final one."""
        yield from self._window(req)

    def run_steps(self, req: WindowRequest) -> dict:
        """Run steps ``req.first`` .. ``req.last`` - 1 without a call per step: each
        rank derives its micro-batches from the sampler and the step, and the ranks
        agree each step's commit among themselves (``_agree``). Returns this rank's
        committed step and what it measured."""
        final = None
        for final in self._window(req):
            pass
        return final

    def _window(self, req: WindowRequest):
        self._check_generation(req.generation)
        step = req.first
        try:
            if req.commit is not None:
                self.commit(req.commit, req.generation)
            if self.prepared is not None:
                raise RuntimeError(f"step {self.prepared} was prepared and neither "
                                   "committed nor dropped")
            if self.sampler[0] != req.sampler:
                self.sampler = (req.sampler, ray.get(req.sampler))
            sampler, dp = self.sampler[1], self.plan.dims.index(self.rank, "dp")
            self.engine.loss_scale = 1.0
            self.stop_window = None  # (an ask for an earlier window)
            ids = replica_schedule(sampler, self.plan, req.first)[dp]
            memory = None
            for step in range(req.first, req.last):
                nxt = (replica_schedule(sampler, self.plan, step + 1)[dp]
                       if step + 1 < req.steps else None)
                out = self._train_step(step, ids, nxt)
                table = self._agree(out, req.first, sampler.global_batch_size)
                self.agreed = (step, table)  # (every rank has it: last_agreed)
                self.faults.trip(self.rank, step, "agreed", self.generation)
                if self.rank == 0:  # (the step is decided: answered before it is applied)
                    yield table
                self.commit(step, req.generation)
                if out.memory is not None:
                    memory = (out.memory, out.peak_rss_bytes)
                if table.col("stop").any():
                    break
                ids = nxt
            final = {"committed_step": self.committed_step, "memory": memory}
        except Exception as e:
            failure = f"rank {self.rank}, step {step + 1}: {type(e).__name__}: {e}"
        else:
            yield final
            return
        raise RuntimeError(failure)  # (outside the handler: see train_step)

    def last_agreed(self):
        """(step, StepTable) of the last step this rank agreed on (--step_protocol
        ranks), or None: a recovery records from it a step whose answer was lost with
        rank 0."""
        return self.agreed

    def _agree(self, out: StepResult, first: int, batch_size: int) -> StepTable:
        """The step's commit, agreed among the ranks: every rank's row of answers is
        all-gathered. That completes on a rank only once every rank has prepared the
        step (a rank that failed never sends its row), so a rank that has the table may
        commit; each then has every rank's figures, and rank 0 answers for all. A rank
        whose gather fails does not commit (the driver's recovery finds the ranks'
        committed steps). --log_sample_ids: each replica's sample ids too."""
        import torch
        import torch.distributed as dist

        e = self.engine
        row = torch.tensor(StepTable.row(out, self.stop_window == first,
                                         e.speaks_for_replica),
                           dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        dist.all_gather(rows, row)
        table = StepTable(torch.stack(rows).cpu().numpy())
        if self.cfg.get("log_sample_ids"):
            mine = torch.full((batch_size,), -1, dtype=torch.int64, device=self.device)
            if out.sample_ids:
                mine[:len(out.sample_ids)] = torch.tensor(out.sample_ids)
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
            table.sample_ids = [[int(i) for i in ids.tolist() if i >= 0]
                                for ids, speaks in zip(every, table.col("speaks")) if speaks]
        return table

    def leave_group(self, export: bool = False, collect: bool = True):
        """After a failure: leave the process group for good, dropping every reference
        to it so that its connections close. Only that releases a survivor blocked on
        data from this rank (gloo's abort and shutdown do not close them; a process
        group's connections close when its last reference goes). Queued by the driver
        behind the call that failed. A full replica keeps its model and optimizer state;
        any other rank's engine is dropped (its model holds groups too).

        ``export``: first put this rank's state in Ray's object store, in checkpoint
        form (Engine.export_state), for the ranks of a new layout to read; returns what
        it wrote (``rebuild``), else True. ``collect``: collect the garbage at once, so
        that groups held in reference cycles close now (a full collection, of what the
        runs made: _freeze_imports). Not needed when no peer is blocked on this rank:
        Python collects them later."""
        self._doing("leaving its group")
        import gc

        import ray
        import torch.distributed as dist

        out = True
        if export and self.engine is not None:
            self.exported = self.engine.export_state()  # the objects live while we do
            out = {"metadata": self.exported, "step": self.committed_step,
                   "node_id": ray.get_runtime_context().get_node_id()}
        if self.engine is not None and self.engine.plan.full_replica_per_rank:
            self.engine.leave_group()  # keeps the model and optimizer state (regroup)
        else:
            # The state of a rank that is not a full replica carries on elsewhere (its
            # export above, a snapshot, a checkpoint), and its model holds groups of
            # its own (pipeline stages and tied weights, FSDP): the engine goes whole.
            self.engine = None
        self.mesh = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a broken group may not tear down cleanly
                log.warning("rank %d: leaving the group: %s", self.rank, e)
        if collect:
            gc.collect()
        return out

    def rebuild(self, master: str, plan, rank: int, world_size: int, generation: int,
                state, setup: dict | None = None) -> dict:
        """Carry on under a new layout (a survivor of a failure, a live rank of a group
        that grows, or a newcomer: ``setup``, the settings ``build`` takes): drop the
        engine, join generation ``generation`` as ``rank`` of ``world_size``, build the
        engine of ``plan`` and read its shards of ``state`` (the run's state in memory,
        as the live ranks exported it: raylm.checkpoint.memory) from the holders, each
        chunk from one on this node when there is one. Until that has loaded the rank
        has no committed step (a failure meanwhile cannot use its state)."""
        import gc

        import ray
        import torch.distributed as dist

        t0 = time.time()
        self.prepared, self.committed_step, self.returned_at = None, None, None
        if dist.is_initialized():
            self.leave_group()
        self.engine = None
        if self.prefetcher is not None:
            self.prefetcher.close()
        gc.collect()
        if setup is not None:
            self.spec, self.dataset = setup["spec"], setup["dataset"]
            self.cfg, self.total_steps = setup["train_cfg"], setup["total_steps"]
            self.collective_timeout_s = self.cfg["collective_timeout_s"]
        self.rank, self.world_size = rank, world_size
        self.join(master, plan, self.collective_timeout_s, generation)
        self.faults.trip(self.rank, state.step, "recovery", self.generation)
        self.build(self.spec, self.dataset, self.cfg, self.total_steps)
        fetched = self.engine.import_state(state, ray.get_runtime_context().get_node_id(),
                                           self._seed_rank)
        self.committed_step = state.step
        return {"rank": rank, "rebuild_s": time.time() - t0, **fetched}

    def reset(self, rank: int, world_size: int, num_threads: int) -> dict:
        """A kept process (raylm.runtime.kept) becomes rank ``rank`` of a new run: what
        the last run left (its process group, engine, threads, compiled graphs) is
        dropped, and the rank is as a new actor would be, with torch and the model code
        already imported."""
        import gc
        import sys

        import torch
        import torch.distributed as dist

        if self.snapshots is not None:
            self.snapshots.wait()  # (a send under way finishes)
        for part in (self.prefetcher, self.profiler):
            if part is not None:
                part.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        if "torch._dynamo" in sys.modules:  # the last run's compiled blocks and guards
            sys.modules["torch._dynamo"].reset()
            from torch._dynamo.utils import counters

            counters.clear()  # (compiled_graphs counts this run's)
        if "torch.distributed.tensor" in sys.modules:
            _forget_meshes()
        self.__dict__.clear()
        self.__init__(rank, world_size, num_threads)
        gc.collect()
        if torch.cuda.is_initialized():  # the cached blocks back to the GPU's other users
            torch.cuda.empty_cache()
        return self.info()

    def drop_export(self) -> bool:
        """The state this rank exported (leave_group) is no longer needed."""
        self.exported = None
        return True

    def _train_step(self, step: int, micro_batch_ids: list, next_ids) -> StepResult:
        self._doing_step(step, 0)
        self.faults.trip(self.rank, step, "step", self.generation)
        t0 = time.time()
        # Since the last step returned, less the calls run since (its commit, a
        # checkpoint, an evaluation): the rank idle at the step boundary, waiting for the
        # driver to gather every rank's answer and send the commit and this call.
        idle = t0 - self.returned_at - self.busy_s if self.returned_at else None
        e = self.engine
        batches = self.prefetcher.get(step, micro_batch_ids) if e.needs_data else []
        if next_ids is not None and e.needs_data:
            self.prefetcher.submit(step + 1, next_ids)
        t_data = time.time() - t0
        rounds = self.plan.micro_batches_per_rank
        batches = e.pad_rounds(batches, rounds, self.reader.read if self.reader else None)
        hooks = self.faults.arm_step(self.rank, step, self.generation, e.grad_sync, rounds)
        meter = self._meter()
        clock = StepClock(self.device)
        t_fb = clock.mark()
        self._doing_step(step, 1)
        with self._region("raylm.forward_backward"):
            sums = e.forward_backward(batches, step, rounds, meter)
        for hook in hooks:
            hook.remove()
        # (after the gradient sync, before the step is prepared)
        self._doing_step(step, 2)
        self.faults.trip(self.rank, step, "update", self.generation)
        t_clip = clock.mark()
        with self._region("raylm.clip"):
            prepared = e.prepare_update()  # clip (the norm over the whole model)
        t_end = clock.mark()
        # The step's figures, read once all its work is launched: on a GPU this is the
        # step's one wait for the device (the clip's kernels queued behind backward's).
        tokens, clip_s = float(sums.tokens), clock.span(t_clip, t_end)
        self.prepared = step
        out = StepResult(
            loss=float(sums.loss) / max(tokens, 1.0), tokens=int(tokens),
            local_tokens=sums.local_tokens, has_loss=e.has_loss,
            learning_rate=prepared.learning_rate, grad_norm=float(prepared.grad_norm),
            overflow=prepared.overflow, peak_rss_bytes=prepared.peak_rss_bytes,
            # Where the step's time went (raylm.runtime.profiling).
            data_wait_s=t_data, forward_backward_s=clock.span(t_fb, t_clip) - e.sync_s,
            grad_sync_s=e.sync_s, clip_s=clip_s,
            optimizer_s=self._optimizer_s(), step_s=0.0, boundary_idle_s=idle,
            peer_wait_s=e.count_wait_s + e.sync_s + clip_s,
            snapshot_s=self.snapshot_s, memory=self._memory(meter))
        out.step_s, self.snapshot_s = time.time() - t0, 0.0
        # Each sample once: from the first stage's first tensor-parallel rank.
        if self.cfg.get("log_sample_ids") and e.speaks_for_replica:
            out.sample_ids = [int(i) for ids in micro_batch_ids for i in ids if i >= 0]
        if self.profiler is not None and not self.profiler.step():
            self.profiler = None  # (its trace is written)
        self._doing_step(step, 3)
        self.returned_at, self.busy_s = time.time(), 0.0
        return out

    def _optimizer_s(self):
        """The last optimizer step's time (its commit's marks, read now), or None."""
        if isinstance(self.optimizer_s, tuple):
            self.optimizer_s = StepClock.span(*self.optimizer_s)
        return self.optimizer_s

    def _region(self, name: str):
        """A named region of --profile's trace (nothing when not tracing)."""
        return self.profiler.region(name) if self.profiler is not None else _NO_REGION

    def commit(self, step: int, generation: int = 0) -> bool:
        """Apply prepared step ``step``: optimizer, schedule (the driver sends this once
        every rank prepared it)."""
        self._check_generation(generation)
        if self.prepared != step:
            raise RuntimeError(f"rank {self.rank}: commit of step {step}, but the prepared "
                               f"step is {self.prepared}")
        self._doing_step(step, 4)
        self.faults.trip(self.rank, step, "commit", self.generation)
        t0 = time.time()
        self._state_settled()
        clock = StepClock(self.device)
        t_opt = clock.mark()
        with self._region("raylm.optimizer"):
            self.engine.apply_update()
        # (read at the next step's end: on a GPU the optimizer's kernels still run while
        # the next step's inputs are prepared, with no wait for them here)
        self.optimizer_s = (t_opt, clock.mark())
        self.prepared, self.committed_step = None, step + 1  # steps done
        every = self.cfg.get("snapshot_steps") or 0
        if every and self.committed_step % every == 0 and self.keepers:
            self._snapshot()
        self.busy_s += time.time() - t0
        return True

    def set_keepers(self, keepers: list) -> bool:
        """The snapshot keepers this rank sends to (raylm.runtime.snapshots)."""
        self.keepers = keepers
        return True

    def _snapshot(self) -> None:
        """Snapshot this rank's state of the committed step to the keepers, in the
        background (raylm.runtime.snapshots.SnapshotSender); what it costs the step shows
        in snapshot_s."""
        t0 = time.time()
        if self.snapshots is None:
            # (imported here: it imports torch.distributed.checkpoint, 0.7 s that the
            # driver, which imports this module for the actor class, does without)
            from raylm.runtime.snapshots import SnapshotSender

            self.snapshots = SnapshotSender()
        self.snapshots.send(self.engine.snapshot_state(), self.keepers, self.committed_step,
                            self.generation, self.rank, self.world_size)
        self.snapshot_s += time.time() - t0

    def _state_settled(self) -> None:
        """Before anything writes the state: a snapshot in flight may still be copying
        it (its wait counts in snapshot_s)."""
        if self.snapshots is not None:
            t0 = time.time()
            self.snapshots.wait_copied()
            self.snapshot_s += time.time() - t0

    def _check_generation(self, generation: int) -> None:
        # Fencing: a call meant for another group generation never runs a collective.
        if generation != self.generation:
            raise RuntimeError(f"rank {self.rank} is in group generation {self.generation}, "
                               f"not {generation}")

    def _measures(self) -> bool:
        """Whether this step measures what the rank holds: the first one after set-up at
        which the optimizer holds its state (AdamW makes it at its first step, which a
        step's commit applies after the step has reported: so on a fresh run, step 2)."""
        return self.measure_next and bool(self.engine.optimizer.state)

    def _meter(self):
        """On the step that measures (``_measures``): count the activations autograd
        saves (their peak over the step); otherwise nothing."""
        import contextlib

        if not self._measures():
            return contextlib.nullcontext()
        from raylm.runtime.memory import ActivationMeter

        return ActivationMeter(self.engine.model)

    def _memory(self, meter) -> dict | None:
        """What this rank holds (measured from its tensors), on the step that measures."""
        if not self._measures():
            return None
        from raylm.parallel.compile import compiled_graphs
        from raylm.parallel.recompute import checkpointed_blocks
        from raylm.runtime.memory import state_bytes

        self.measure_next = False
        return {**state_bytes(self.engine.model, self.engine.optimizer,
                                       self.engine.grad_sync.held_gradients()),
                         "replica_elements": self.engine.replica_elements(),
                         "replica_trained": self.engine.replica_elements(trained=True),
                         "activations": meter.peak,
                         "weight_copies": meter.copies_peak,
                         "checkpointed_blocks": checkpointed_blocks(self.engine.model),
                         "compiled_graphs": compiled_graphs(),
                         "compiled": self.engine.compiled,
                         "coords": self.plan.dims.coords(self.rank)}

    def state_digest(self) -> str:
        """A digest of this rank's parameters and optimizer state (equal on data-parallel
        replicas of a ZeRO-0 layout; tests compare them after a recovery)."""
        import hashlib

        import torch

        from raylm.parallel.data import local_tensor

        h = hashlib.sha256()
        for p in self.engine.model.parameters():
            h.update(local_tensor(p).detach().cpu().numpy().tobytes())
        for state in self.engine.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    h.update(v.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, micro_batch_ids: list, eval_dataset=None) -> EvalResult:
        """Summed loss and token count over this rank's eval batches, reduced over dp."""
        self._doing("evaluating")
        from raylm.data.reader import make_reader
        from raylm.parallel.data import all_reduce_sum

        t0 = time.time()
        reader = self.reader
        if eval_dataset is not None:
            if self.eval_reader is None:
                self.eval_reader = make_reader(eval_dataset)
            reader = self.eval_reader
        e = self.engine
        sums = e.evaluate(micro_batch_ids, reader.read)
        loss_sum, tokens, correct = all_reduce_sum([sums.loss_sum, sums.tokens,
                                                    sums.correct or 0],
                                                   e.dp_group, self.device)
        eval_loss = loss_sum / max(tokens, 1)
        self.busy_s += time.time() - t0
        return EvalResult(eval_loss, perplexity(eval_loss), int(tokens), e.has_loss,
                          # (image classification: top-1 hits)
                          int(correct) if e.counts_correct else None)

    # -- checkpoints and output ------------------------------------------------------------
    def save_checkpoint(self, path: str) -> bool:
        self._doing("saving a checkpoint")
        self.faults.trip(self.rank, self.committed_step, "checkpoint", self.generation)
        t0 = time.time()
        self.engine.save(path)
        self.busy_s += time.time() - t0
        return True

    def load_checkpoint(self, path: str, step: int) -> bool:
        self._doing("loading a checkpoint")
        self._state_settled()
        self.engine.load(path, step, self._seed_rank)
        self.committed_step = step
        return True

    def save_pretrained(self, output_dir: str) -> bool:
        """Rank 0 writes one ordinary Hugging Face model (safetensors), assembled by the
        engine from the ranks' shards and stages where the layout splits it."""
        self._doing("saving the model")
        model = self.engine.hf_model()  # collective over the ranks that hold shards
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per save in the driver's log is noise
            dtype = saved_dtype(self.cfg)
            # (an object-store output_dir: written here, then uploaded)
            with storage.written_dir(output_dir) as out:
                if self.spec.model_init is not None:  # a model of the user's own
                    from raylm.models.custom import save_custom

                    save_custom(model, out, dtype)
                elif self.spec.lora is not None:  # the adapter (and the merged model)
                    save_lora(model, self.spec, out, dtype,
                              lambda m, d: save_in_dtype(m, d, dtype), named_dir=output_dir)
                else:
                    save_in_dtype(model, out, dtype)
        return True


def _gloo_on_node_address() -> None:
    """gloo's connections on the address Ray reaches this node at. Left to itself, gloo
    binds to what the hostname resolves to: 127.0.0.1 or 127.0.1.1 on many machines,
    which ranks on other nodes (or in another network namespace) cannot reach. A
    GLOO_SOCKET_IFNAME of the user's own is kept."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    import ipaddress

    import psutil

    ip = ipaddress.ip_address(ray.util.get_node_ip_address())
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == ip:
                    os.environ["GLOO_SOCKET_IFNAME"] = name
                    return
            except ValueError:  # (a link-layer address)
                continue


def _forget_meshes() -> None:
    """Drop what DTensor cached of the last run's device meshes: its sharding caches
    (the C++ fast path's and Python's) and redistribute planners compare meshes by shape
    and dimension names, not by process group, so a kept rank would hand its new run's
    ops output specs on an old mesh whose groups are gone or named otherwise ("Could not
    resolve the process group registered under the name N"), and a mesh a failed run
    left on the stack of current meshes."""
    from torch.distributed import device_mesh
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    device_mesh._mesh_resources.mesh_stack.clear()


def _device_name() -> str:
    """The device a rank computes on: the GPU's name (peak FLOP/s for the mfu), or cpu."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
