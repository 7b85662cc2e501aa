"""The driver: plans the layout, starts the rank actors, hands out steps, recovers.

States (logged on every change, so a failure's path reads straight from the log):

    planning -> starting -> running -> finished
                    ^           |
                    +- recovering <- (a rank or its node died)

The driver never touches tensors: it sends each rank the sample ids of its micro-batches
and gets scalars back. Where the run is lives in one ``RunRecord`` (step, plan, latest
checkpoint, group generation, failures, history); what a failure means is decided by
policy objects (raylm.runtime.policy): past ``max_failures`` the run gives up; else the
survivors carry on from the first of these that holds the whole state (``_recover``):
their own memory (full replicas regroup with a smaller dp; replicated stages or shards
are re-laid out from the object store), the newest in-memory snapshot
(``--snapshot_steps``, raylm.runtime.snapshots), or the latest checkpoint (the group
restarted on the live nodes). The global batch stays the run's throughout.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.checkpoint.manager import TRAINER_STATE, CheckpointManager, read_trainer_state
from raylm.config import TrainConfig
from raylm.data.sampler import (GlobalBatchSampler, micro_batches, padded_step_schedule,
                                rank_share, step_schedule)
from raylm.data.stream import DataStreamError
from raylm.errors import ConfigError, TrainingFailed
from raylm.models.lora import lora_line, lora_model_dirs, point_adapter_at_own_base
from raylm.models.objectives import PREDICTS_A_SAMPLE
from raylm.plan.layout import Plan, plan_run
from raylm.plan.text import describe_partition, human_bytes
from raylm.runtime import cluster, kept
from raylm.runtime.best import BestTracker
from raylm.runtime.metrics import MetricsLog, Progress, open_metrics, perplexity
from raylm.runtime.policy import FailurePolicy, RunRecord, ScalingPolicy
from raylm.runtime.precision import LossScale
from raylm.runtime.profiling import WindowBreakdown, slowest_breakdown
from raylm.runtime.prepare import (Data, Inputs, check_inputs, prepare_data,
                                   start_output_dir, total_steps)
from raylm.runtime.worker import RankWorker

log = logging.getLogger("raylm")

# How long the survivors of a failure get to return from the failed step (Driver._live_ranks).
SURVIVOR_GRACE_S = 10.0


@dataclass
class TrainResult:
    output_dir: str
    metrics: dict
    history: list = field(default_factory=list)  # one dict per optimizer step
    failures: int = 0


class WorkerFailure(Exception):
    pass


# A run's start-up, in order (Driver.startup): bad-input checks, connecting to (or
# starting) Ray, planning, the data (tokenized or found in the cache), the placement group,
# the rank processes (the actors started: Python, torch and raylm imported), their process
# group, the engines (model, layout, optimizer; transformers' model code imported), and a
# resumed run's checkpoint.
STARTUP_PARTS = (("inputs", "inputs"), ("ray", "Ray"), ("plan", "plan"), ("data", "data"),
                 ("placement", "placement"), ("processes", "rank processes"),
                 ("process_group", "process group"), ("engines", "engines"),
                 ("restore", "checkpoint"))


@contextlib.contextmanager
def _timed(into: dict, key: str):
    """Seconds the block took, into ``into[key]``."""
    t0 = time.time()
    try:
        yield
    finally:
        into[key] = time.time() - t0


def startup_line(startup: dict) -> str:
    """'started in 8.1 s: inputs 0.0 s, Ray 0.0 s, ...' (the parts measured)."""
    parts = [(title, startup[key]) for key, title in STARTUP_PARTS if key in startup]
    return (f"started in {sum(t for _, t in parts):.1f} s: "
            + ", ".join(f"{title} {t:.1f} s" for title, t in parts))


class Driver:
    def __init__(self, cfg: TrainConfig, callbacks: tuple = (), faults: tuple = (),
                 model_init=None, compute_loss_func=None, tp_plan=None,
                 datasets: Optional[dict] = None):
        self.cfg = cfg
        # Injected faults (tests): dicts of rank, step (committed steps before it), phase
        # ("step": before its forward, "sync": during its gradient sync, "update": after
        # it, "commit", "checkpoint", "recovery"; "overflow" does not kill: the rank's
        # gradients become inf after its sync, as an fp16 overflow) and group generation
        # (default 1).
        self.faults = [dict(f) for f in faults]
        # Each callback may define on_step_end(driver, step, record); tests use it to
        # kill a rank mid-run.
        self.callbacks = list(callbacks)
        self.model_init = model_init  # a model of the user's own (raylm.models.custom)
        self.compute_loss_func = compute_loss_func  # the user's loss (objectives.UserLoss)
        self.tp_plan = tp_plan  # model_init's tensor-parallel plan (raylm.models.custom)
        # train_dataset / eval_dataset given to train() (raylm.data.given)
        self.datasets = {k: v for k, v in (datasets or {}).items() if v is not None}
        self.state = None
        self.steps_per_epoch = None  # the sampler's, once training starts
        self.stream_warned = False  # --streaming's slow-pipeline warning, once
        self.stream = None  # --streaming's TokenStream (raylm.data.stream)
        self.workers: list = []
        self.worker_info: list[dict] = []
        self.inflight: list = []  # the ranks' calls of the step under way
        # The step every rank prepared whose commit is not sent yet: it rides on the next
        # step's call (one Ray call per rank and step), or goes on its own before anything
        # else reads or changes the ranks' state (_send_commit).
        self.uncommitted: Optional[int] = None
        # Growth: placement groups of ranks that joined a running group, and newcomers
        # warming up (actors, their placement group, their warm-up calls).
        self.growth_pgs: list = []
        self.newcomers = None
        self.grow_check_s = 1.0  # how often the step loop looks for new capacity
        self.sent_ahead = 0  # steps sent before the driver's work on the step before
        self.last_grow_check = 0.0
        self.pg = None
        # Where each rank actor sits, parallel to self.workers: (placement group, bundle).
        # A lost rank's bundle stays reserved in its group, for a newcomer to take.
        self.slots: list = []
        # Where the run is (step, plan, latest checkpoint, group generation, failures,
        # history), and the policies that decide what a failure or a smaller cluster means.
        self.record = RunRecord()
        self.failure_policy = FailurePolicy(cfg.max_failures)
        self.scaling: Optional[ScalingPolicy] = None  # from the first plan's size
        self.ckpt: Optional[CheckpointManager] = None
        self.metrics: Optional[MetricsLog] = None
        self.flops_per_token = self.peak_flops = None  # for the mfu, when the peak is known
        self.best: Optional[BestTracker] = None  # the evaluations and the best of them
        self.stopped_early = False  # --early_stopping_patience ran out
        self.last_eval = (None, {})  # (step, results) of the latest evaluation
        self.progress: Optional[Progress] = None
        self.spec, self.block_size = None, None
        self.dataset, self.total_steps = None, 0  # what a rank joining a running group needs
        # In-memory snapshots on other nodes (--snapshot_steps): raylm.runtime.snapshots.
        self.snapshots = None
        if cfg.snapshot_steps:
            # (imported here: it imports torch.distributed.checkpoint, 0.7 s of every
            # driver's start otherwise)
            from raylm.runtime.snapshots import Snapshots

            self.snapshots = Snapshots(cfg.snapshot_steps)
        # Where the run's start-up went, in seconds (STARTUP_PARTS; the first step's time
        # is its history's): the log's "started in" line and all_results.json's startup_s.
        self.startup: dict = {}
        # Whether this run finished (then its ranks may stay up for the next run:
        # raylm.keep_ranks).
        self.finished = False

    # -- state machine ---------------------------------------------------------------------
    def _enter(self, state: str, detail: str = "") -> None:
        log.info("driver: %s%s", state, f" ({detail})" if detail else "")
        self.state = state

    @property
    def worker_pids(self) -> list[int]:
        return [i["pid"] for i in self.worker_info]

    def run(self) -> TrainResult:
        cfg = self.cfg
        self._enter("planning")
        # A dataset given is read (through Ray Data) while checking the inputs: Ray first.
        ray_first = bool(self.datasets)
        owns_ray = False
        if ray_first:
            with _timed(self.startup, "ray"):
                owns_ray = cluster.connect(cfg.address)
        early = None  # the run's own local cluster, started during the last input check

        def start_ray():
            nonlocal early
            if not ray_first and cluster.starts_local(cfg.address):
                early = cluster.EarlyStart()

        try:
            with _timed(self.startup, "inputs"):
                # (no cluster needed for the flags and files: fails fast on bad input)
                inputs = check_inputs(cfg, model_init=self.model_init,
                                      compute_loss_func=self.compute_loss_func,
                                      tp_plan=self.tp_plan, datasets=self.datasets,
                                      on_checked=start_ray)
        except BaseException:
            if owns_ray:
                cluster.stop_local()
            if early is not None:
                early.shutdown()
            raise
        if not ray_first:
            with _timed(self.startup, "ray"):
                owns_ray = cluster.connect(cfg.address, early)
        asked = False
        try:
            group = cfg.tp or 1
            if cfg.max_workers:
                # An autoscaling cluster launches nodes for the bundles asked for; any
                # cluster runs with what it has within the bounds.
                asked = cluster.request_workers(cfg.max_workers, cfg.cpus_per_worker,
                                                cfg.use_gpu, group)
            if cfg.snapshot_steps and len([n for n in ray.nodes() if n["Alive"]]) < 2:
                raise ConfigError(
                    f"--snapshot_steps {cfg.snapshot_steps}: a rank's snapshot is kept on "
                    "its own node and on another one, and this cluster has a single node: "
                    "add a node, or drop --snapshot_steps (checkpoints: --save_steps)")
            cap = cluster.capacity(cfg.cpus_per_worker, cfg.use_gpu, group)
            if cfg.min_workers and cap < cfg.min_workers:
                cap = cluster.wait_for_workers(cfg.min_workers, cfg.cpus_per_worker,
                                               cfg.use_gpu, group, cfg.collective_timeout_s)
            largest = cluster.largest_node(cfg.cpus_per_worker, cfg.use_gpu)
            if 0 < largest < group:
                raise ConfigError(
                    f"--tp {group}: a tensor-parallel group stays on one node, and the "
                    f"largest node here holds {largest} rank(s) of {cfg.cpus_per_worker:g} "
                    f"CPU{' and 1 GPU' if cfg.use_gpu else ''}: lower --tp or "
                    "--cpus_per_worker, or add larger nodes")
            if cfg.max_workers:
                cap = min(cap, cfg.max_workers)
            with _timed(self.startup, "plan"):
                plan = self.plan(inputs, cap)
            with _timed(self.startup, "data"):
                data = prepare_data(cfg, inputs)  # (stops kept ranks before tokenizing)
            self.stream = data.stream
            if owns_ray and data.stream is None and not asked:
                # The data are ready and Ray Data is done with this cluster of raylm's own
                # (with a request for workers out, its coordinator holds the request).
                cluster.stop_ray_data_actors()
            self.scaling = ScalingPolicy(target=plan.world_size, min_workers=cfg.min_workers,
                                         max_workers=cfg.max_workers)
            log.info("plan: %s", plan.describe())
            if inputs.spec.lora is not None:
                log.info("%s", lora_line(inputs.spec))
            if plan.zero_stage and plan.dp > 1:
                try:
                    from raylm.report.ownership import ownership_lines, zero_ownership

                    for line in ownership_lines(zero_ownership(inputs.spec, plan,
                                                               inputs.block_size), plan.dp):
                        log.info("%s", line)
                except Exception as e:  # the log line must never stop a run
                    log.warning("ZeRO ownership unavailable: %s", e)
            if cfg.should_train:
                return self._train(inputs, data, plan)
            return self._evaluate_only(inputs, data, plan)
        finally:
            if self.stream is not None:  # Ray Data's executor stops with the run
                self.stream.close()
            self._teardown(keep=self.finished and not owns_ray)
            if self.metrics is not None:
                self.metrics.close()  # (the sinks a failed run left open)
            if asked:
                cluster.request_workers(0, cfg.cpus_per_worker, cfg.use_gpu)
            if owns_ray:
                if early is not None:
                    early.shutdown()
                else:
                    cluster.stop_local()

    def plan(self, inputs: Inputs, capacity: int) -> Plan:
        """The run's layout on a cluster that can hold ``capacity`` ranks: raylm's one
        planning function (what `raylm plan` prints for the same flags); a resumed run
        keeps its global batch, whatever the layout now."""
        record = inputs.run_record or {}
        plan, part = plan_run(self.cfg, capacity, inputs.spec, inputs.block_size,
                              global_batch_size=record.get("global_batch_size"))
        if part is not None:
            for line in describe_partition(part, plan.schedule, plan.micro_batches_per_rank):
                log.info("%s", line)
        return plan

    # -- group lifecycle -------------------------------------------------------------------
    def _start_group(self, plan: Plan, inputs: Inputs, data: Data, steps: int,
                     restore: Optional[str], restore_step: int) -> Plan:
        """Reserve bundles, start one actor per rank, join them, restore state."""
        self._enter("starting", f"{plan.world_size} rank(s)")
        t0 = time.time()
        n = plan.world_size
        times = {"placement": 0.0}
        with _timed(times, "processes"):
            reused = self._take_kept(plan)
        if not reused:
            while True:
                self.pg = cluster.reserve(n, plan.cpus_per_worker, plan.use_gpu,
                                         timeout_s=30, group=plan.dims.node_group_size)
                if self.pg is not None:
                    break
                fewer = self.scaling.fewer(plan, n)
                if fewer is None:
                    raise TrainingFailed("could not place a single rank actor on the cluster")
                log.warning("could not place %d rank(s) within 30 s; trying %d", n, fewer)
                n = fewer
            if n != plan.world_size:
                plan = plan.resized(n)
                log.info("re-planned: %s", plan.describe())
            times = {"placement": time.time() - t0}
            with _timed(times, "processes"):
                self.slots = [(self.pg, plan.dims.node_group(r)) for r in range(n)]
                self.workers = _rank_actors(plan, self.slots, range(n), n,
                                            self.cfg.huge_pages)
                self.worker_info = self._wait([w.info.remote() for w in self.workers])
        for i in self.worker_info:
            log.info("rank %d: pid %d on node %s (%s)", i["rank"], i["pid"],
                     i["node_id"][:8], i["ip"])
        with _timed(times, "process_group"):
            master = self._master_address()
            self.record.generation += 1
            self._wait([w.join.remote(master, plan, self.cfg.collective_timeout_s,
                                      self.record.generation) for w in self.workers])
        with _timed(times, "engines"):
            self._wait([w.build.remote(inputs.spec, data.train, self._rank_settings(), steps)
                        for w in self.workers])
        if restore:
            with _timed(times, "restore"):
                self._wait([w.load_checkpoint.remote(restore, restore_step)
                            for w in self.workers])
            log.info("restored %s (step %d)", restore, restore_step)
        if "engines" not in self.startup:  # the run's first group (not a recovery's)
            self.startup.update(times)
        self._send_keepers()
        return plan

    def _take_kept(self, plan: Plan) -> bool:
        """Start with the rank processes a last run kept (raylm.keep_ranks), each as
        the rank ``plan`` puts on its node (a tensor-parallel group on one node). False,
        with them stopped, when there are none of this shape, they cannot be placed so,
        or one does not answer."""
        ranks = kept.take(plan.world_size, plan.cpus_per_worker, plan.use_gpu,
                          self.cfg.huge_pages)
        if ranks is None:
            return False
        order = _place(plan, ranks.node_ids)
        try:
            if order is None:
                raise WorkerFailure("the kept ranks' nodes do not hold the layout")
            self.worker_info = self._wait(
                [ranks.actors[i].reset.remote(r, plan.world_size, plan.torch_threads)
                 for r, i in enumerate(order)], timeout_s=60)
        except WorkerFailure as e:
            log.info("not using the kept rank processes: %s", e)
            ranks.release()
            return False
        self.workers = [ranks.actors[i] for i in order]
        self.slots = [ranks.slots[i] for i in order]
        self.pg, self.growth_pgs = ranks.pgs[0], ranks.pgs[1:]
        log.info("%d rank process(es) kept from the last run", len(self.workers))
        return True

    def _keep(self) -> bool:
        """Leave this run's ranks up for the next (raylm.keep_ranks): when it finished
        without a failure (every bundle holds its rank) and they all reset."""
        if not (kept.keeping() and self.workers and self.record.failures == 0
                and self.newcomers is None and len(self.slots) == len(self.workers)):
            return False
        n = len(self.workers)
        try:
            # Each drops its engine now (memory, GPU memory) rather than at the next run.
            self._wait([w.reset.remote(r, n, self.record.plan.torch_threads)
                        for r, w in enumerate(self.workers)], timeout_s=60)
        except WorkerFailure:
            return False
        kept.offer(kept.KeptRanks(
            actors=self.workers, slots=self.slots,
            node_ids=[i["node_id"] for i in self.worker_info],
            pgs=[pg for pg in [self.pg] + self.growth_pgs if pg is not None],
            cpus_per_worker=self.record.plan.cpus_per_worker,
            use_gpu=self.record.plan.use_gpu, cluster=cluster.cluster_id(),
            huge_pages=self.cfg.huge_pages))
        self.workers, self.pg, self.growth_pgs, self.slots = [], None, [], []
        return True

    def _send_keepers(self) -> None:
        """Tell each rank which snapshot keepers to send to (after every group change)."""
        if self.snapshots is None:
            return
        self._wait([w.set_keepers.remote(self.snapshots.keepers_for(i["node_id"]))
                    for w, i in zip(self.workers, self.worker_info)])

    def _master_address(self) -> str:
        """host:port of a new process group's rendezvous, hosted by rank 0."""
        timeout_s = self.cfg.collective_timeout_s
        port = self._wait([self.workers[0].host_store.remote(timeout_s)])[0]
        return f"{self.worker_info[0]['ip']}:{port}"

    def _rank_settings(self) -> dict:
        """The settings a rank's engine is built from (and the injected faults)."""
        return {**self.cfg.to_dict(), "faults": self.faults,
                "steps_per_epoch": self.steps_per_epoch,
                "profile_dir": os.path.join(os.path.abspath(self.cfg.output_dir), "profile")}

    def _send_commit(self) -> None:
        """Send the decided commit on its own (before an evaluation, a checkpoint, the
        saved model, a regroup); a commit that fails fails the rank's next call."""
        if self.uncommitted is not None:
            step, self.uncommitted = self.uncommitted, None
            self.inflight = [w.commit.remote(step, self.record.generation)
                             for w in self.workers]

    def state_digests(self) -> list:
        """Each rank's digest of its parameters and optimizer state at the last
        committed step (RankWorker.state_digest; tests compare replicas)."""
        self._send_commit()
        return self._wait([w.state_digest.remote() for w in self.workers])

    def _teardown(self, keep: bool = False) -> None:
        if keep:
            self._keep()
        _kill(self.workers)
        self.workers = []
        for pg in [self.pg] + self.growth_pgs:
            _remove(pg)
        self.pg, self.growth_pgs, self.slots = None, [], []
        self._drop_newcomers()
        if self.snapshots is not None:
            self.snapshots.close()

    def _wait(self, refs: list, timeout_s: Optional[float] = None) -> list:
        """Results of ``refs`` in order; the first failure of any rank raises at once."""
        timeout_s = timeout_s or self.cfg.collective_timeout_s + 60
        pending = list(refs)
        deadline = time.time() + timeout_s
        got = {}
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1,
                                          timeout=max(0.0, deadline - time.time()))
                if not ready:
                    raise WorkerFailure(f"no answer from the ranks in {timeout_s:.0f} s")
                got[ready[0]] = ray.get(ready[0])  # raises if that rank failed
            return [got[ref] for ref in refs]
        except (RayActorError, RayTaskError, GetTimeoutError) as e:
            raise WorkerFailure(_first_line(e)) from e

    def _live_ranks(self) -> tuple[list[int], list[str]]:
        """(indices of the ranks that answer, descriptions of those that do not). An
        actor answers after the calls queued before (an actor runs its calls in order):
        a survivor answers once its failed step has returned: at once, or once a peer
        it waits on has left the group (RankWorker.leave_group closes that peer's
        connections). One that does not within SURVIVOR_GRACE_S counts as lost (a rank
        hung in its own code, say); the wait for it is bounded by that, not by the
        collective timeout."""
        refs = [w.info.remote() for w in self.workers]
        live, dead = [], []
        deadline = time.time() + SURVIVOR_GRACE_S
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.time()))
                live.append(i)
            except Exception:
                info = self.worker_info[i] if i < len(self.worker_info) else {}
                dead.append(f"rank {i} (pid {info.get('pid')}, node "
                            f"{str(info.get('node_id'))[:8]})")
        return live, dead

    # -- training --------------------------------------------------------------------------
    def _train(self, inputs: Inputs, data: Data, plan: Plan) -> TrainResult:
        cfg = self.cfg
        self.ckpt = CheckpointManager(cfg.output_dir)
        restore = inputs.resume_from
        state = read_trainer_state(restore) if restore else {}
        start_step = state.get("step", 0)
        if data.stream is not None:  # --streaming (raylm.data.stream): --max_steps steps
            sampler = data.stream
            sampler.batch = plan.global_batch_size
            _check_stream_room(plan, sampler.task_cpus, cfg.streaming is None)
            steps = cfg.max_steps
            # Masked LM and span corruption draw per (seed, epoch, sample id); a stream
            # has no fixed epoch length, so under it the key's "epoch" is the step: a
            # sample gets fresh masks each time it is trained on (as HF's collator draws
            # per batch), the same on every layout, resume and redone step.
            self.steps_per_epoch = 1
            if restore:
                if not state.get("stream"):
                    raise ConfigError(f"--streaming: the checkpoint {restore} was saved by a "
                                      "run that tokenized into the cache; resume it with "
                                      "--streaming false")
                sampler.restore(state["stream"])
            sampler.prefetch(start_step)  # Ray Data starts while the ranks do
        else:
            sampler = GlobalBatchSampler(data.train_ids, plan.global_batch_size,
                                         cfg.order_seed)
            steps = total_steps(cfg, sampler.steps_per_epoch)
            self.steps_per_epoch = sampler.steps_per_epoch  # (masked LM draws per epoch)
        self.best = BestTracker(cfg.metric_for_best_model, cfg.greater_is_better,
                                cfg.early_stopping_patience, cfg.early_stopping_threshold,
                                state.get("evaluations", ()), state.get("saved", ()))
        # fp16's loss scale where the run starts (a checkpoint keeps it); after that each
        # step's record keeps the state after it (_loss_scale).
        self.scale_start = (LossScale(**state["loss_scale"]) if state.get("loss_scale")
                            else LossScale(float(cfg.initial_loss_scale)))
        self.stopped_early = False
        fingerprint = start_output_dir(cfg, plan.global_batch_size, inputs)
        self.ckpt.clear_partial()
        self.metrics = open_metrics(cfg, start_step)
        self.metrics.truncate_after(start_step)
        if restore:
            log.info("resuming from %s at step %d of %d", restore, start_step, steps)
        if cfg.profile:
            first = start_step + 3  # (the first step is not traced, the second warms up)
            if first + cfg.profile_steps - 1 > steps:
                log.warning("--profile traces steps %d-%d, past the run's last step (%d): "
                            "no trace will be written", first,
                            first + cfg.profile_steps - 1, steps)
            else:
                log.info("--profile: tracing steps %d-%d on every rank into %s", first,
                         first + cfg.profile_steps - 1,
                         os.path.join(cfg.output_dir, "profile"))
        if data.stream is not None:
            log.info("training %d step(s) on a stream of %d piece(s) of data, shuffled in "
                     "windows of %d samples", steps, len(sampler.pieces), sampler.window)
        else:
            log.info("training %d step(s): %d sample(s), %d step(s) per epoch", steps,
                     sampler.num_samples, sampler.steps_per_epoch)

        self.spec, self.block_size = inputs.spec, inputs.block_size
        self.dataset, self.total_steps = data.train, steps
        run = self.record
        run.checkpoint = restore
        run.plan = self._start_group(plan, inputs, data, steps, restore, start_step)
        log.info("%s", startup_line(self.startup))
        run.step = start_step
        self.flops_per_token = self._flops_per_token()
        self.progress = Progress(steps, start_step, cfg.disable_tqdm)
        t_start = time.time()
        if run.step >= steps:
            log.info("the run is already complete (step %d of %d)", run.step, steps)
        final, train_runtime = {}, 0.0
        while True:
            try:
                while run.step < steps and not self.stopped_early:  # again after growth
                    self._enter("running", f"step {run.step + 1} of {steps}")
                    self._run_steps(sampler, steps, data, fingerprint)
                train_runtime = time.time() - t_start
                # The end of the run: evaluate and save; a failure here recovers too
                # (from the final checkpoint, so nothing is redone).
                if cfg.should_eval and data.eval is not None:
                    if self.last_eval[0] != run.step:  # (an early stop just evaluated)
                        self._eval(data)
                        self.best.observe(run.step, self.last_eval[1])
                    final.update(self.last_eval[1])
                self._send_commit()
                self._save_model()
                break
            except WorkerFailure as failure:
                size = run.plan.world_size
                while failure is not None:  # a failure during a recovery recovers again
                    self._event("failure", _first_line(failure))
                    try:
                        self._recover(failure, inputs, data, steps)
                        failure = None
                    except WorkerFailure as again:
                        failure = again
                self._resize_event(size)
        self.progress.close()
        self.metrics.close()
        self._save_tokenizer(cfg.output_dir)
        for sub in lora_model_dirs(self.spec, cfg.output_dir):  # (LoRA's whole models)
            self._save_tokenizer(sub)
        trained = [h for h in run.history]
        tokens = sum(h.get("throughput_tokens", h["tokens"]) for h in trained)
        final.update({
            "global_step": run.step,
            "train_samples": (sampler.num_samples if data.stream is None
                              else run.step * run.plan.global_batch_size),
            "train_loss": (sum(h["loss"] for h in trained) / len(trained)) if trained else None,
            "final_loss": trained[-1]["loss"] if trained else None,
            "train_runtime": train_runtime,
            "train_tokens_per_second": tokens / train_runtime if train_runtime > 0 else 0.0,
            "failures": run.failures,
            "world_size": run.plan.world_size,
            # steps sent to the ranks as soon as the step before answered (_run_steps)
            "steps_sent_ahead": self.sent_ahead,
            "startup_s": {**self.startup, **({"first_step": trained[0]["step_time_s"]}
                                             if trained else {})},
        })
        if data.stream is not None:  # samples Ray Data tokenized and the ranks could read
            final["stream_samples_read"] = data.stream.stats.samples
            # blocks whose ids the driver read in its own node's store, and on others'
            final["stream_blocks_read_here"] = data.stream.stats.blocks_read_here
            final["stream_blocks_read_there"] = data.stream.stats.blocks_read_there
        if self.best.evaluations:  # the Trainer's trainer_state names
            final.update({"best_metric": self.best.best_metric,
                          "best_global_step": self.best.best_step,
                          "best_model_checkpoint": self._best_path()})
        if self.stopped_early:
            final["stopped_early"] = True
        with open(os.path.join(cfg.output_dir, "all_results.json"), "w") as f:
            json.dump(final, f, indent=2)
        self._enter("finished", f"step {run.step}, output in {cfg.output_dir}")
        self.finished = True
        return TrainResult(output_dir=os.path.abspath(cfg.output_dir), metrics=final,
                           history=run.history, failures=run.failures)

    def _run_steps(self, sampler: GlobalBatchSampler, steps: int, data: Data,
                   fingerprint: dict) -> None:
        cfg, run = self.cfg, self.record
        plan = run.plan
        window_tokens, window_start, window_steps = 0, time.time(), 0
        window_stream_wait = 0.0
        window_parts = WindowBreakdown()

        @functools.lru_cache(maxsize=4)  # (a step's ids go out twice: to prefetch, to run)
        def schedule(step):
            if step >= steps:
                return None
            if plan.pp > 1:  # a fixed number of equal micro-batches, filled up
                out = padded_step_schedule(sampler.global_batch(step), plan.dp,
                                           plan.micro_batch_size, plan.micro_batches_per_rank)
            else:
                out = step_schedule(sampler.global_batch(step), plan.dp, plan.micro_batch_size)
            # As lists of ints: Ray sends them in about 0.1 ms less a call than numpy
            # arrays (pickled out of band), and the call is on the step boundary.
            return [[m.tolist() for m in mbs] for mbs in out]

        def submit(step, scale):
            # Each rank gets its replica's micro-batches for the step after `step` done
            # ones and, to prefetch, for the one after (every stage of a pipeline gets the
            # same ids).
            cur, nxt = schedule(step), schedule(step + 1)
            # --streaming: the Ray Data blocks both steps read (each rank fetches them
            # from the object store; the driver only passes references).
            blocks = (sampler.blocks([step, step + 1 if nxt else None])
                      if data.stream is not None else None)
            commit, self.uncommitted = self.uncommitted, None
            return [w.train_step.remote(step, cur[plan.dims.index(r, "dp")],
                                        nxt[plan.dims.index(r, "dp")] if nxt else None,
                                        run.generation, commit, scale, blocks)
                    for r, w in enumerate(self.workers)]

        per_epoch = sampler.steps_per_epoch

        def saves_after(step):
            return cfg.at(cfg.save_strategy, cfg.save_steps, step, per_epoch, last=steps)

        def evaluates_after(step):  # mid-run evaluations; the final one follows the loop
            return bool(cfg.at(cfg.eval_strategy_now(), cfg.eval_steps, step, per_epoch)
                        and step < steps and cfg.should_eval and data.eval is not None)

        def logs_after(step):
            return cfg.at(cfg.logging_strategy, cfg.logging_steps, step, per_epoch,
                          last=steps)

        def stream_wait():
            return data.stream.stats.wait_s if data.stream is not None else 0.0

        def send(step, scale):
            """Send ``step`` to every rank (with the last step's commit); the driver's
            wait for the stream's blocks meanwhile."""
            waited = stream_wait()
            self.inflight = submit(step, scale.scale if scale else 1.0)
            return stream_wait() - waited

        def may_send_ahead(step):
            """Whether the step after ``step`` done ones can be sent as soon as ``step``'s
            answers are in, before the driver's own work on them (the record, the log,
            the progress bar, the look for room to grow): nothing is due between the two
            steps that reads or changes the ranks' state or the plan (an evaluation, a
            checkpoint, newcomers to take in, a callback, the run's end). The ranks get
            the same calls in the same order either way: only the driver's own work
            moves off the step boundary, which the ranks sit idle through."""
            return (step < steps and not self.callbacks and self.newcomers is None
                    and not evaluates_after(step) and not saves_after(step))

        t_last = time.time()
        self.last_grow_check = time.time()
        sent, ahead = None, (None, 0.0)  # the step sent ahead, (its scale, stream wait)
        while run.step < steps:
            if sent == run.step:
                scale, waited = ahead
            else:
                if self._grow_at_boundary():
                    self._resize_event(plan.world_size)
                    return  # the caller runs the remaining steps under the larger plan
                # Every rank prepares the step (forward, backward, gradient sync, clip);
                # once all have, it is committed: each rank applies it first thing in
                # its next call, the next step's or a commit of its own. A step that
                # fails on any rank commits on none.
                scale = self._loss_scale()
                try:
                    waited = send(run.step, scale)
                except DataStreamError:
                    self._stop_on_data_error(sampler, fingerprint)
                    raise
            results = self._wait(self.inflight)
            self.uncommitted = run.step
            run.step += 1
            out = _loss_result(results)
            overflow = _overflow(results)
            now = time.time()
            wall, t_last = now - t_last, now
            # fp16: the scale's state after this step (the next step's: _loss_scale)
            after = scale.after(overflow, cfg.loss_scale_window) if scale else None
            data_error = None
            if may_send_ahead(run.step):
                try:
                    ahead, sent = (after, send(run.step, after)), run.step
                    self.sent_ahead += 1
                except DataStreamError as e:  # raised once this step is recorded
                    data_error = e
                else:  # (no newcomers: this only looks for room, and may start some)
                    self._grow_at_boundary()
            # Throughput counts the tokens the model read: a causal LM's labels are its
            # inputs (shifted), masked LM's and span corruption's a sample of them.
            read = (len(sampler.global_batch(run.step - 1)) * self.block_size
                    if self.spec.objective in PREDICTS_A_SAMPLE else out["tokens"])
            rec = {"step": run.step, "epoch": round(sampler.epoch_of(run.step), 4),
                   "loss": out["loss"], "learning_rate": out["learning_rate"],
                   "grad_norm": out["grad_norm"], "tokens": out["tokens"],
                   "throughput_tokens": read, "tokens_per_second": read / wall,
                   "step_time_s": wall,
                   # the ranks' reads, and the driver's wait for the stream's next blocks
                   "data_wait_s": max(r["data_wait_s"] for r in results) + waited,
                   "snapshot_s": max(r.get("snapshot_s", 0.0) for r in results),
                   # The step boundary's cost: the rank that answered last waited least.
                   "boundary_idle_s": min((r["boundary_idle_s"] for r in results
                                           if r.get("boundary_idle_s") is not None),
                                          default=None),
                   "breakdown": slowest_breakdown(results),
                   "peak_rss_bytes": [r["peak_rss_bytes"] for r in results],
                   "world_size": plan.world_size}
            if scale is not None:  # fp16: the scale used, and the state after the step
                rec.update({"loss_scale": scale.scale, "skipped": overflow,
                            "loss_scale_after": after.to_dict()})
                if overflow:
                    log.warning("step %d: fp16 gradients overflowed: skipped on every rank; "
                                "loss scale %g -> %g", run.step, scale.scale, after.scale)
            if run.history and run.history[-1]["step"] >= run.step:  # a step run again
                run.history = [h for h in run.history if h["step"] < run.step]
            run.history.append(rec)  # (not a copy of the whole history every step)
            if data.stream is not None:
                rec["stream_wait_s"] = waited
                data.stream.release_before(run.step)
                self._stream_rate_check(rec, plan.global_batch_size)
            if cfg.log_sample_ids:
                with open(os.path.join(cfg.output_dir, "samples.jsonl"), "a") as f:
                    f.write(json.dumps({"step": run.step, "ranks": [
                        r["sample_ids"] for r in results if "sample_ids" in r]}) + "\n")
            if "memory" in results[0]:
                self._memory_report(results)
            window_tokens += read
            window_steps += 1
            window_stream_wait += waited
            window_parts.add(rec["breakdown"])
            self.progress.update(run.step, rec["loss"], rec["tokens_per_second"])
            if logs_after(run.step):
                # Speed over the steps since the last log (with their boundaries).
                elapsed = max(time.time() - window_start, 1e-9)
                entry = {"step": run.step, "epoch": rec["epoch"], "loss": rec["loss"],
                         "learning_rate": rec["learning_rate"],
                         "grad_norm": rec["grad_norm"],
                         **({"loss_scale": scale.scale} if scale is not None else {}),
                         "step_time_s": elapsed / window_steps,
                         "tokens_per_second": window_tokens / elapsed,
                         "world_size": plan.world_size,
                         # seconds per step, of the slowest rank (runtime.profiling)
                         "breakdown": window_parts.take()}
                if data.stream is not None:  # the driver's wait for Ray Data, per step
                    entry["stream_wait_s"] = window_stream_wait / window_steps
                    window_stream_wait = 0.0
                mfu = self._mfu(entry["tokens_per_second"], plan.world_size)
                if mfu is not None:
                    entry["mfu"] = mfu
                self.metrics.append(entry)
                self.progress.write(
                    f"step {run.step}/{steps}  loss {rec['loss']:.4f}  "
                    f"lr {rec['learning_rate']:.3g}  grad_norm {rec['grad_norm']:.3g}  "
                    f"{entry['tokens_per_second']:,.0f} tokens/s"
                    + (f"  mfu {mfu:.1%}" if mfu is not None else ""))
                window_tokens, window_start, window_steps = 0, time.time(), 0
            if data_error is not None:
                self._stop_on_data_error(sampler, fingerprint)
                raise data_error
            if evaluates_after(run.step):
                self.best.observe(run.step, self._eval(data))
            if saves_after(run.step):
                self._save_checkpoint(sampler, fingerprint)
            if self.best.should_stop():
                self.stopped_early = True
                log.warning("early stopping at step %d of %d: %s (--early_stopping_patience "
                            "%d)", run.step, steps, self.best.describe(),
                            cfg.early_stopping_patience)
                return
            for cb in self.callbacks:
                if hasattr(cb, "on_step_end"):
                    cb.on_step_end(self, run.step, rec)

    # -- growing at a step boundary ------------------------------------------------------------
    def _grow_at_boundary(self) -> bool:
        """Between steps: look for capacity beyond the group (every ``grow_check_s``);
        start newcomers that warm up while training goes on; once they are warm, grow
        the group: the live ranks regroup with them in a new generation and send them a
        live replica's state. True when the group grew."""
        run, plan = self.record, self.record.plan
        if self.newcomers is None:
            if time.time() - self.last_grow_check < self.grow_check_s:
                return False
            self.last_grow_check = time.time()
            cluster.refresh_request()  # (an autoscaler request lapses unless renewed)
            group = plan.dims.node_group_size
            room = plan.world_size + len(self._free_slots(group)) + \
                cluster.free_ranks(plan.cpus_per_worker, plan.use_gpu, group)
            n = self.scaling.grow_to(plan, room)
            if n is not None:
                self._start_newcomers(plan, n - plan.world_size)
            return False
        actors, pg, warm, slots = self.newcomers
        if len(ray.wait(warm, num_returns=len(warm), timeout=0)[0]) < len(warm):
            return False  # still warming up: train on
        t0 = time.time()
        try:
            ray.get(warm)
        except Exception as e:  # a newcomer that failed to start is not used
            log.warning("a rank that was to join failed to start (%s): not growing", e)
            self._drop_newcomers()
            return False
        self.newcomers = None
        self._send_commit()
        n = plan.world_size + len(actors)
        if not plan.full_replica_per_rank:
            return self._grow_relayout(actors, pg, slots, t0)
        new_plan = plan.resized(n)
        if pg is not None:
            self.growth_pgs.append(pg)
        infos = ray.get([a.info.remote() for a in actors])
        run.generation += 1
        master = self._master_address()
        old = self.workers
        refs = [w.regroup.remote(master, new_plan, r, n, run.generation)
                for r, w in enumerate(old)]
        refs += [a.join_running.remote(master, new_plan, len(old) + i, n, run.generation,
                                       self.spec, self.dataset, self._rank_settings(),
                                       self.total_steps,
                                       0, run.step)
                 for i, a in enumerate(actors)]
        refs += [w.send_state.remote(0) for w in old]
        self.workers, self.slots = old + actors, self.slots + slots
        self.worker_info = self.worker_info + [dict(i, rank=len(old) + k)
                                               for k, i in enumerate(infos)]
        # (A failure here is a rank failure like any other.)
        joined = self._wait(refs)[len(old):len(old) + len(actors)]
        run.plan = new_plan
        self._send_keepers()
        log.info("re-planned: %s", new_plan.describe())
        log.warning("grew in memory to %d rank(s) (generation %d): the live ranks paused "
                    "%.2f s for the regroup and the state transfer (newcomers, slowest: "
                    "group %.2f s, engine %.2f s, state %.2f s)", n, run.generation,
                    time.time() - t0, *(max(j[k] for j in joined)
                                        for k in ("join_s", "build_s", "state_s")))
        return True

    def _grow_relayout(self, actors: list, pg, slots: list, t0: float) -> bool:
        """Grow a layout whose ranks are not full replicas (pipeline stages, tensor-
        parallel shards, ZeRO partitions): re-plan for the larger group, then the live
        ranks export their state to the object store and leave their group, and all of
        them, newcomers too, rebuild under the new layout reading their shards from it
        (as a recovery does: ``_relayout_in_memory``). Nothing is redone."""
        from raylm.checkpoint.memory import merge

        run = self.record
        n = run.plan.world_size + len(actors)
        new_plan = self._replan(n, grow=True)
        infos = ray.get([a.info.remote() for a in actors])
        everyone = self.workers + actors
        info = self.worker_info + [dict(i) for i in infos]
        order = _place(new_plan, [i["node_id"] for i in info]) \
            if new_plan is not None and new_plan.world_size == n else None
        if order is None:
            log.warning("no layout of %d rank(s) on these nodes: not growing", n)
            self.newcomers = (actors, pg, [], slots)
            self._drop_newcomers()
            return False
        if pg is not None:
            self.growth_pgs.append(pg)
        old_workers, all_slots = self.workers, self.slots + slots
        state = merge(self._wait([w.leave_group.remote(True) for w in old_workers]))
        self.workers = [everyone[i] for i in order]
        self.slots = [all_slots[i] for i in order]
        self.worker_info = [dict(info[i], rank=r) for r, i in enumerate(order)]
        run.generation += 1
        run.plan = new_plan
        master = self._master_address()
        setup = {"spec": self.spec, "dataset": self.dataset,
                 "train_cfg": self._rank_settings(), "total_steps": self.total_steps}
        self._wait([w.rebuild.remote(master, new_plan, r, n, run.generation, state,
                                     None if order[r] < len(old_workers) else setup)
                    for r, w in enumerate(self.workers)])
        ray.get([w.drop_export.remote() for w in old_workers])
        self._send_keepers()
        log.info("re-planned: %s", new_plan.describe())
        log.warning("grew in memory to %d rank(s) (generation %d), re-laid out from the "
                    "live ranks' state: they paused %.2f s for the export, the rebuild "
                    "and the state transfer (%s)", n, run.generation, time.time() - t0,
                    human_bytes(state.nbytes()))
        return True

    def _start_newcomers(self, plan: Plan, k: int) -> None:
        """Place ``k`` new rank actors (whole replicas) and start their warm-up; training
        goes on. They take the places lost ranks left in the run's bundles first, then a
        new placement group; a tensor-parallel group's newcomers share a bundle (a
        node)."""
        group = plan.dims.node_group_size
        slots, pg = self._free_slots(group)[:k], None
        if len(slots) < k:
            pg = cluster.reserve(k - len(slots), plan.cpus_per_worker, plan.use_gpu,
                                 timeout_s=2, group=group)
            if pg is not None:
                slots += [(pg, i // group) for i in range(k - len(slots))]
        slots = slots[:len(slots) - len(slots) % plan.dims.replica_size]
        if not slots:
            _remove(pg)
            return
        grown = plan.resized(plan.world_size + len(slots))
        actors = _rank_actors(grown, slots, range(plan.world_size, grown.world_size),
                              grown.world_size, self.cfg.huge_pages)
        from raylm.runtime.engine import builds_on_meta

        warm = [a.warm_up.remote(self.spec, self.cfg.seed, builds_on_meta(grown, self.spec))
                for a in actors]
        self.newcomers = (actors, pg, warm, slots)
        log.info("capacity for %d more rank(s): starting them (they join at a step "
                 "boundary once warm)", len(slots))

    def _free_slots(self, group: int = 1) -> list:
        """The places in the run's bundles that no rank holds (lost ranks'), one
        (placement group, bundle) per rank, in whole groups of ``group`` per bundle (a
        tensor-parallel group shares one)."""
        taken = collections.Counter(self.slots + list(self.newcomers[3] if self.newcomers
                                                      else ()))
        plan = self.record.plan
        free = []
        for pg in [self.pg] + self.growth_pgs:
            for b, bundle in enumerate(pg.bundle_specs if pg is not None else ()):
                places = cluster.ranks_fitting(bundle, plan.cpus_per_worker, plan.use_gpu,
                                               0) - taken[(pg, b)]
                free += [(pg, b)] * (places - places % group)
        return free

    def _drop_newcomers(self) -> None:
        if self.newcomers is None:
            return
        actors, pg, _, _ = self.newcomers
        _kill(actors)
        _remove(pg)
        self.newcomers = None

    def _flops_per_token(self) -> Optional[float]:
        """Training FLOPs per token (3x the forward's: the backward is twice it) when the
        ranks' peak is known (--peak_tflops, or a known GPU), else None: no mfu."""
        from raylm.plan.hardware import peak_flops

        self.peak_flops = peak_flops(self.worker_info[0].get("device", "cpu"),
                                     self.cfg.peak_tflops, self.cfg.bf16 or self.cfg.fp16)
        if self.peak_flops is None:
            return None
        from raylm.plan.planner import shape_of

        shape = shape_of(self.spec, self.block_size)
        return 3 * sum(u.flops for u in (shape.embed, *shape.blocks, shape.head))

    def _mfu(self, tokens_per_second: float, world_size: int) -> Optional[float]:
        """Model FLOPs utilisation: the model's training FLOPs at this speed over the
        ranks' peak (activation recomputation not counted, as PaLM defines it)."""
        if self.flops_per_token is None:
            return None
        return tokens_per_second * self.flops_per_token / (self.peak_flops * world_size)

    def _event(self, event: str, detail: str) -> None:
        """A failure or a resize in metrics.jsonl (``raylm plot`` marks them)."""
        self.metrics.append({"step": self.record.step, "event": event,
                             "world_size": self.record.plan.world_size, "detail": detail})

    def _resize_event(self, before: int) -> None:
        """A resize event when the group is no longer ``before`` ranks."""
        plan = self.record.plan
        if plan.world_size != before:
            self._event("resize", f"{before} -> {plan.world_size} rank(s) "
                        f"({plan.dims.describe()})")

    def _memory_report(self, results: list) -> None:
        """Log each rank's measured memory next to the planner's prediction, and keep both
        in output_dir/memory.json (the first step after each start of the group at
        which the optimizer holds its state: step 2 of a fresh run)."""
        from raylm.plan.planner import evaluate_layout
        from raylm.plan.zero import theory_bytes

        plan, cfg = self.record.plan, self.cfg
        try:
            fixed = dataclasses.replace(cfg, gradient_accumulation_steps=plan.micro_batches_per_rank,
                                        pipeline_schedule=plan.schedule,
                                        sequence_parallel=plan.sequence_parallel,
                                        zero_stage=plan.zero_stage,
                                        activation_checkpointing=plan.recompute,
                                        gradient_checkpointing=False)
            predicted = evaluate_layout(fixed, plan.dp, plan.tp, plan.pp, self.spec,
                                        self.block_size)
        except Exception as e:  # the report must never stop a run
            log.warning("memory prediction unavailable: %s", e)
            predicted = None
        ranks = []
        for r in results:
            m = r["memory"]
            pred = None
            if predicted is not None and not predicted.problem:
                pred = predicted.ranks[m["coords"]["pp"]].to_dict()
            ranks.append({"measured": {k: m[k] for k in MEASURED},
                          "coords": m["coords"], "predicted": pred,
                          "replica_elements": m.get("replica_elements"),
                          "replica_trained": m.get("replica_trained"),
                          "checkpointed_blocks": m.get("checkpointed_blocks"),
                          "compiled_graphs": m.get("compiled_graphs"),
                          "compiled": m.get("compiled"),
                          # The ZeRO paper's per-rank model states for the elements the
                          # rank's replica holds (fp32, AdamW).
                          "zero_theory": theory_bytes(m.get("replica_elements") or 0,
                                                      plan.zero_stage, plan.dp,
                                                      trainable=m.get("replica_trained")),
                          "peak_rss_bytes": r.get("peak_rss_bytes")})
            meas = sum(ranks[-1]["measured"].values())
            log.info("memory rank %d (dp %d, pp %d, tp %d): parameters %s, gradients %s, "
                     "optimizer %s, activations %s, weight copies %s = %s%s", len(ranks) - 1,
                     m["coords"]["dp"], m["coords"]["pp"], m["coords"]["tp"],
                     *(human_bytes(m[k]) for k in MEASURED), human_bytes(meas),
                     f" (predicted {human_bytes(sum(pred[k] for k in PREDICTED))})"
                     if pred else "")
        with open(os.path.join(cfg.output_dir, "memory.json"), "w") as f:
            json.dump({"layout": {**plan.dims.to_dict(), "zero_stage": plan.zero_stage,
                                  "sequence_parallel": plan.sequence_parallel,
                                  "recompute": plan.recompute,
                                  "reshard_after_forward": plan.reshard_after_forward},
                       "precision": "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32",
                       "step": self.record.step, "ranks": ranks}, f, indent=2)

    def _stop_on_data_error(self, sampler, fingerprint: dict) -> None:
        """--streaming met a piece it cannot read: the steps trained since the last
        checkpoint are saved first (when the run saves at all), so nothing trained is
        lost. (Resuming that checkpoint needs the same files: a changed file changes
        the stream, and the resume says so.)"""
        run = self.record
        saved = [step for step, _ in self.ckpt.list()]
        if self.cfg.save_strategy == "no" or run.step == 0 or run.step in saved:
            return
        try:
            self._save_checkpoint(sampler, fingerprint)
        except Exception as e:  # the data error is what the user must see
            log.warning("could not save the steps trained before the data error: %s", e)

    def _stream_rate_check(self, rec: dict, batch: int) -> None:
        """Once per run: when training waits on the stream for more than a tenth of its
        steps' time (over the last 10 steps), say what rate the pipeline reaches and what
        training needs."""
        recent = [h for h in self.record.history[-10:] if "stream_wait_s" in h]
        if self.stream_warned or len(recent) < 10:
            return
        wait = sum(h["stream_wait_s"] for h in recent)
        total = sum(h["step_time_s"] for h in recent)
        if wait > 0.1 * total:
            self.stream_warned = True
            reached = len(recent) * batch / max(total, 1e-9)
            needed = len(recent) * batch / max(total - wait, 1e-9)
            log.warning("--streaming: the data pipeline keeps up with %.1f samples/s, and "
                        "training needs %.1f: steps wait %.0f%% of their time for data "
                        "(more CPUs for Ray Data, --preprocessing_num_workers, or build the "
                        "cache first with `raylm tokenize`)", reached, needed,
                        100 * wait / max(total, 1e-9))

    def _save_checkpoint(self, sampler: GlobalBatchSampler, fingerprint: dict) -> None:
        run = self.record
        self._send_commit()
        tmp = self.ckpt.begin(run.step)
        model_only = self.cfg.save_only_model
        if model_only:  # a Hugging Face model directory, as the final model is saved
            self._wait([w.save_pretrained.remote(tmp) for w in self.workers])
            self._save_tokenizer(tmp)
        else:
            self._wait([w.save_checkpoint.remote(tmp) for w in self.workers])
        path = self.ckpt.commit(tmp, run.step, {
            "step": run.step, "epoch": sampler.epoch_of(run.step),
            "global_batch_size": run.plan.global_batch_size,
            # --streaming: where the stream continues (raylm.data.stream)
            "stream": (sampler.state_at(run.step) if hasattr(sampler, "state_at")
                       else None),
            "world_size": run.plan.world_size,
            "layout": run.plan.dims.to_dict(),
            "run": fingerprint,
            "model_only": model_only,
            # The evaluations so far (the best one and the patience follow from them),
            # as the Trainer keeps best_metric in its trainer_state.json.
            "evaluations": self.best.evaluations,
            "saved": self.best.saved + [run.step],
            "best_metric": self.best.best_metric,
            "best_global_step": self.best.best_step,
            "loss_scale": (self._loss_scale() or LossScale()).to_dict()
            if self.cfg.fp16 else None,
        })
        self.best.mark_saved(run.step)  # once committed: a failed save has no checkpoint
        if not model_only:
            run.checkpoint = path
        self.ckpt.rotate(self.cfg.save_total_limit, protect=self._best_path())
        log.info("checkpoint saved: %s%s", path, " (model only)" if model_only else "")

    def _loss_scale(self) -> Optional[LossScale]:
        """fp16's loss scale for the next step (None without --fp16): the state after
        the last step of the run's history (which a restore rewinds with the steps), else
        the one the run started from."""
        if not self.cfg.fp16:
            return None
        last = self.record.history[-1] if self.record.history else {}
        if "loss_scale_after" in last:
            return LossScale(**last["loss_scale_after"])
        return self.scale_start

    def _best_path(self) -> Optional[str]:
        """The checkpoint of the best evaluation that has one (kept by rotation)."""
        step = self.best.best_checkpoint_step
        return self.ckpt.path_for(step) if step is not None else None

    def _save_model(self) -> None:
        """The final model into output_dir: with --load_best_model_at_end that of the
        best checkpoint (loaded into the ranks, in whatever layout they have now, or
        copied as it is when the checkpoint is model-only), else the ranks' own."""
        out = os.path.abspath(self.cfg.output_dir)
        best, step = self._best_path(), self.best.best_checkpoint_step
        if self.cfg.load_best_model_at_end and best and step != self.record.step:
            if not os.path.isfile(os.path.join(best, TRAINER_STATE)):
                log.warning("the best checkpoint %s is gone: saving the last model", best)
            elif read_trainer_state(best).get("model_only"):
                for name in os.listdir(best):
                    src = os.path.join(best, name)
                    if os.path.isdir(src):  # (a LoRA run's base_model/, merged/)
                        shutil.copytree(src, os.path.join(out, name), dirs_exist_ok=True)
                    elif name != TRAINER_STATE:
                        shutil.copy2(src, os.path.join(out, name))
                point_adapter_at_own_base(out)
                log.info("saved the model of the best checkpoint, %s (%s)", best,
                         self.best.describe())
                return
            else:
                self._wait([w.load_checkpoint.remote(best, step) for w in self.workers])
                log.info("loaded the best checkpoint, %s, to save its model (%s)", best,
                         self.best.describe())
        self._wait([w.save_pretrained.remote(out) for w in self.workers])

    def _eval(self, data: Data) -> dict:
        """Evaluate: the loss and perplexity over every evaluation sample, and with
        several validation sets each set's as well (eval_<name>_loss, as the Trainer
        names the metrics of a dict of eval datasets); the overall loss is the
        token-weighted mean of the sets'."""
        self._send_commit()
        step = self.record.step
        sets = data.eval_sets or [(None, data.eval_ids)]
        results, loss_sum, tokens = {}, 0.0, 0
        for name, ids in sets:
            out = self._eval_ids(data, ids)
            loss_sum += out["eval_loss"] * out["eval_tokens"]
            tokens += out["eval_tokens"]
            if name is not None:
                results[f"eval_{name}_loss"] = out["eval_loss"]
                results[f"eval_{name}_perplexity"] = out["perplexity"]
        loss = loss_sum / max(tokens, 1) if len(sets) > 1 else out["eval_loss"]
        results = {"eval_loss": loss, "eval_samples": len(data.eval_ids), **results}
        if "eval_correct" in out:  # image classification: top-1 accuracy (no perplexity)
            results["eval_accuracy"] = out["eval_correct"] / max(out["eval_tokens"], 1)
        else:
            results["perplexity"] = perplexity(loss)
        self.metrics.append({"step": step, **results})
        self.progress.write(f"eval at step {step}: loss {loss:.4f}  " + (
                            f"accuracy {results['eval_accuracy']:.4f}"
                            if "eval_accuracy" in results else
                            f"perplexity {results['perplexity']:.2f}") + "".join(
                                f"  {name} {results[f'eval_{name}_loss']:.4f}"
                                for name, _ in data.eval_sets))
        self.last_eval = (step, results)
        return results

    def _eval_ids(self, data: Data, ids) -> dict:
        plan = self.record.plan
        eval_ds = data.eval if data.eval is not data.train else None
        refs = [w.evaluate.remote(self._eval_batches(ids, plan.dims.index(r, "dp")), eval_ds)
                for r, w in enumerate(self.workers)]
        return _loss_result(self._wait(refs))

    def _eval_batches(self, eval_ids, dp_index: int) -> list:
        plan = self.record.plan
        share = rank_share(eval_ids, dp_index, plan.dp)
        if plan.pp == 1:
            return micro_batches(share, self.cfg.per_device_eval_batch_size)
        # A pipeline evaluates in chunks of its training step's shape, filled up.
        chunk = plan.micro_batch_size * plan.micro_batches_per_rank
        return [padded_step_schedule(share[i:i + chunk], 1, plan.micro_batch_size,
                                     plan.micro_batches_per_rank)[0]
                for i in range(0, len(share), chunk)]

    def _recover(self, failure: WorkerFailure, inputs: Inputs, data: Data, steps: int) -> None:
        """Carry out the policies' decisions on a rank failure: give up, or carry on
        with the survivors in memory (a smaller data-parallel group, or a re-planned
        layout read from the survivors' exported state: nothing redone), or from the
        newest whole snapshot in the keepers' memory, or else restart the group on what
        the cluster holds now, from the latest checkpoint."""
        run = self.record
        run.failures += 1
        decision = self.failure_policy.decide(run.failures, str(failure))
        self._enter("recovering", decision.reason)
        t0 = time.time()
        # Every rank leaves the broken group as soon as its failed call returns; that
        # closes its connections and releases a survivor still blocked on it. Where the
        # layout keeps copies of its state on several ranks (but not the whole state on
        # every rank), each first puts its state in the object store for a new layout.
        plan = run.plan
        export = plan.zero_stage == 0 and plan.dp > 1 and not plan.full_replica_per_rank
        leaving = [w.leave_group.remote(export) for w in self.workers]
        self.inflight += leaving
        live, dead = self._live_ranks()
        for ref in self.inflight:  # the failed step's calls: their errors are known now
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                log.info("  %s", _first_line(e))
        self.inflight = []
        log.warning("rank failure at step %d: %s%s", run.step + 1, failure,
                    f"; dead: {', '.join(dead)}" if dead else "")
        if not decision.restart:
            self._teardown()
            raise TrainingFailed(decision.reason) from failure
        if self._shrink_in_memory(live, t0):
            return
        if export and self._relayout_in_memory(live, [leaving[i] for i in live], t0):
            return
        if not export and not plan.full_replica_per_rank:
            log.warning("the %s layout%s keeps one copy of each rank's state: the lost "
                        "rank(s)' state has no live copy", plan.dims.describe(),
                        f" at ZeRO-{plan.zero_stage}" if plan.zero_stage else "")
        if self.snapshots is not None and self._from_snapshot(live, t0):
            return
        self._teardown()
        restore = self.ckpt.latest()
        restore_step = read_trainer_state(restore)["step"] if restore else 0
        log.warning("restoring %s: %d step(s) will be redone",
                    restore or "the initial model (no checkpoint yet)", run.step - restore_step)
        live_n = cluster.wait_for_capacity(self.scaling.target, run.plan.cpus_per_worker,
                                           run.plan.use_gpu,
                                           group=run.plan.dims.node_group_size)
        plan = self.scaling.after_failure(run.plan, live_n)
        run.plan = self._start_group(plan, inputs, data, steps, restore, restore_step)
        run.step, run.checkpoint = restore_step, restore
        run.history = [h for h in run.history if h["step"] <= restore_step]
        self.best.truncate_after(restore_step)
        self.metrics.truncate_after(restore_step)
        self.progress.reset_to(restore_step)

    def _shrink_in_memory(self, live: list[int], t0: float) -> bool:
        """Carry on with the surviving ranks, their model and optimizer state kept in
        memory: the old group is left, the survivors join a new generation of a smaller
        data-parallel group, and the step that failed (committed nowhere) is run again
        under the new layout. True when done; False when the layout or the survivors'
        state does not allow it (the caller restarts from a checkpoint)."""
        run, plan = self.record, self.record.plan
        n = self.scaling.shrink_to(plan, len(live))
        if n is None or not live:
            return False
        if not plan.full_replica_per_rank:
            return False  # (_relayout_in_memory, or a restart)
        try:
            states = self._wait([self.workers[i].info.remote() for i in live])
        except WorkerFailure:
            return False
        if any(st["committed_step"] != run.step for st in states):
            log.warning("survivors disagree on the last committed step (%s, driver %d): "
                        "restarting from the latest checkpoint",
                        [st["committed_step"] for st in states], run.step)
            return False
        new_plan = plan.resized(n)
        keep = live[:n]
        _kill([w for i, w in enumerate(self.workers) if i not in keep])
        self.workers = [self.workers[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        self.worker_info = [dict(states[live.index(i)], rank=r) for r, i in enumerate(keep)]
        t_replan = time.time()
        run.generation += 1
        try:
            master = self._master_address()
            self._wait([w.regroup.remote(master, new_plan, r, n, run.generation)
                        for r, w in enumerate(self.workers)])
        except WorkerFailure as e:
            log.warning("regrouping the survivors failed (%s): restarting", e)
            return False
        run.plan = new_plan
        self._send_keepers()
        log.info("re-planned: %s", new_plan.describe())
        log.warning("shrank in memory to %d rank(s) (generation %d) in %.2f s "
                    "(detect and settle %.2f s, regroup %.2f s): 0 committed steps redone; "
                    "step %d runs again under the new layout", n, run.generation,
                    time.time() - t0, t_replan - t0, time.time() - t_replan, run.step + 1)
        return True

    def _relayout_in_memory(self, live: list[int], exports: list, t0: float) -> bool:
        """Carry on with the surviving ranks of a layout whose state has copies on
        several ranks (pipeline stages or tensor-parallel shards, data-parallel replicas
        of them at ZeRO stage 0): when every piece of the state has a live copy, re-plan
        for the survivors and rebuild them under the new layout, each reading its
        shards of the state the survivors exported from the object store (one on its
        own node first). Nothing is read from disk and no committed step is redone.
        True when done; False when some state has no live copy or no layout fits (the
        caller restarts from a checkpoint)."""
        from raylm.checkpoint.memory import merge, uncovered

        run, plan = self.record, self.record.plan
        have = {(plan.dims.coords(i)["pp"], plan.dims.coords(i)["tp"]) for i in live}
        lost = [f"pp={p} tp={t}" for p in range(plan.pp) for t in range(plan.tp)
                if (p, t) not in have]
        if lost:
            log.warning("no live copy of the state of %s: restarting from the latest "
                        "checkpoint", ", ".join(lost))
            return False
        try:
            state = merge(ray.get(exports))
        except Exception as e:
            log.warning("the survivors' state cannot be used (%s): restarting", e)
            return False
        if state.step != run.step or uncovered(state):
            log.warning("the survivors' state is at step %s (driver %d), %d tensor(s) "
                        "not covered: restarting", state.step, run.step,
                        len(uncovered(state)))
            return False
        return self._relayout(live, state, t0, "the survivors' memory")

    def _from_snapshot(self, live: list[int], t0: float) -> bool:
        """Carry on with the survivors from the newest whole snapshot in the keepers'
        memory (--snapshot_steps) when it is newer than the latest checkpoint: the
        steps since it are redone. False when there is none."""
        run = self.record
        state = self.snapshots.latest(run.step)
        ckpt = self.ckpt.latest() if self.ckpt else None
        ckpt_step = read_trainer_state(ckpt)["step"] if ckpt else 0
        if state is None or state.step <= ckpt_step:
            log.warning("no snapshot newer than the latest checkpoint (step %d)", ckpt_step)
            return False
        if not self._relayout(live, state, t0, f"the snapshot of step {state.step}"):
            return False
        redo = run.step - state.step
        run.step = state.step
        run.history = [h for h in run.history if h["step"] <= state.step]
        self.best.truncate_after(state.step)
        self.metrics.truncate_after(state.step)
        self.progress.reset_to(state.step)
        log.warning("restored the snapshot of step %d from memory: %d step(s) will be "
                    "redone", state.step, redo)
        return True

    def _relayout(self, live: list[int], state, t0: float, source: str) -> bool:
        """Re-plan for the survivors and rebuild them under the new layout, each
        reading its shards of ``state`` (raylm.checkpoint.memory.MemoryState) from the
        object store, a holder on its own node first. False when no layout fits."""
        run = self.record
        new_plan = self._replan(len(live))
        order = _place(new_plan, [self.worker_info[i]["node_id"] for i in live]) \
            if new_plan is not None else None
        if order is None:
            log.warning("no layout for %d survivor(s) on their nodes: restarting",
                        len(live))
            return False
        keep = [live[k] for k in order]
        t_replan = time.time()
        log.info("re-planned: %s", new_plan.describe())
        old_workers, old_info = self.workers, self.worker_info
        self.workers = [old_workers[i] for i in keep]
        self.slots = [self.slots[i] for i in keep]
        self.worker_info = [dict(old_info[i], rank=r) for r, i in enumerate(keep)]
        run.generation += 1
        run.plan, n = new_plan, new_plan.world_size
        try:
            master = self._master_address()
            results = self._wait([w.rebuild.remote(master, new_plan, r, n, run.generation,
                                                   state)
                                  for r, w in enumerate(self.workers)])
        except WorkerFailure as e:
            # A rank of the new group failed while rebuilding: the survivors' states
            # are no longer whole (they have no committed step until they load).
            _kill([old_workers[i] for i in live if i not in keep])
            raise WorkerFailure(f"during the recovery: {e}") from e
        # The exported state is read: its holders drop it; ranks beyond the layout go.
        ray.get([old_workers[i].drop_export.remote() for i in keep])
        _kill([w for i, w in enumerate(old_workers) if i not in keep])
        local = sum(r["local"] for r in results)
        remote = sum(r["remote"] for r in results)
        self._send_keepers()
        log.warning("re-laid out in memory on %d rank(s) (generation %d) from %s in %.2f "
                    "s (detect and export %.2f s, rebuild and state transfer %.2f s; %s of "
                    "state, %d chunk(s) read on the same node, %d from another)", n,
                    run.generation, source, time.time() - t0, t_replan - t0,
                    time.time() - t_replan, human_bytes(state.nbytes()), local, remote)
        if state.step == run.step:
            log.warning("0 committed steps redone; step %d runs again under the new layout",
                        run.step + 1)
        return True

    def _replan(self, workers: int, grow: bool = False) -> Optional[Plan]:
        """The layout for at most ``workers`` live ranks (``grow``: exactly that many,
        whole replicas the scaling policy chose), the run's global batch: the planner's
        choice when the flags leave the layout to it, else the flags' pp x tp on as many
        whole replicas as fit (raylm.plan.layout.plan_run, as at the start). None when
        none fits or it would be fewer than --min_workers."""
        plan = self.record.plan
        searched = not (self.cfg.dp or self.cfg.tp or self.cfg.pp)
        n = workers if searched or grow else self.scaling.shrink_to(plan, workers)
        if not n or n < max(1, self.cfg.min_workers):
            return None
        cfg = dataclasses.replace(self.cfg, num_workers=n, dp=0)
        try:
            new_plan, part = plan_run(cfg, n, self.spec, self.block_size,
                                      global_batch_size=plan.global_batch_size)
        except ConfigError as e:
            log.warning("no layout for %d rank(s): %s", n, e)
            return None
        if part is not None:
            for line in describe_partition(part, new_plan.schedule,
                                           new_plan.micro_batches_per_rank):
                log.info("%s", line)
        return new_plan

    # -- evaluation only -------------------------------------------------------------------
    def _evaluate_only(self, inputs: Inputs, data: Data, plan: Plan) -> TrainResult:
        os.makedirs(self.cfg.output_dir, exist_ok=True)
        self.metrics = open_metrics(self.cfg)
        self.progress = Progress(0, 0, True)
        self.record.plan = self._start_group(plan, inputs, data, 1, None, 0)
        self.record.step = 0
        self._enter("running", "evaluation")
        out = self._eval(data)
        with open(os.path.join(self.cfg.output_dir, "eval_results.json"), "w") as f:
            json.dump(out, f, indent=2)
        self.metrics.close()
        self._enter("finished", f"eval_loss {out['eval_loss']:.4f}, " + (
            f"accuracy {out['eval_accuracy']:.4f}" if "eval_accuracy" in out else
            f"perplexity {out['perplexity']:.2f}"))
        self.finished = True
        return TrainResult(output_dir=os.path.abspath(self.cfg.output_dir), metrics=out)

    def _save_tokenizer(self, directory: str) -> None:
        from raylm.data.tokenized import load_tokenizer

        if self.spec.objective == "image_classification":  # (no tokenizer: its images')
            from raylm.models.vision import save_image_processor

            save_image_processor(self.spec, directory)
            return
        # The tokenizer resolve_model loaded (cached), saved beside the model.
        load_tokenizer(self.spec.tokenizer_dir).save_pretrained(directory)


def _rank_actors(plan: Plan, slots: list, ranks, world_size: int, huge_pages: bool) -> list:
    """Start the rank actors of ``ranks``, each in its slot of ``slots`` (placement
    group, bundle); ``huge_pages``: --huge_pages."""
    actor = ray.remote(RankWorker)
    env = cluster.rank_runtime_env(huge_pages)
    return [actor.options(
        num_cpus=plan.cpus_per_worker, num_gpus=1 if plan.use_gpu else 0, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle),
        **({"runtime_env": env} if env else {}),
    ).remote(rank, world_size, plan.torch_threads) for rank, (pg, bundle) in zip(ranks, slots)]


def _place(plan: Plan, nodes: list) -> Optional[list]:
    """Which survivor (index into ``nodes``, their node ids) takes each rank of
    ``plan``: the ranks a node group must hold on one node (a tensor-parallel group)
    from survivors on one node; None when the survivors' nodes cannot hold the plan."""
    size, free = plan.dims.node_group_size, {}
    for i, node in enumerate(nodes):
        free.setdefault(node, []).append(i)
    order = []
    for _ in range(plan.world_size // size):
        node = next((k for k, v in free.items() if len(v) >= size), None)
        if node is None:
            return None
        order += free[node][:size]
        free[node] = free[node][size:]
    return order


def _kill(actors: list) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already dead
            pass


def _remove(pg) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed
            pass


# What memory.json holds of each rank, measured (raylm.runtime.memory) and predicted
# (raylm.plan.cost.Memory): the same parts.
MEASURED = ("parameters", "gradients", "optimizer", "activations", "weight_copies")
PREDICTED = ("states", "activations", "weight_copies")


def _overflow(results: list) -> bool:
    """Whether the step's fp16 gradients overflowed: every rank sees the same global
    norm, so every rank says the same (anything else is a bug, not a decision)."""
    flags = {bool(r.get("overflow")) for r in results}
    if len(flags) > 1:
        raise RuntimeError("ranks disagree on whether the step's gradients overflowed")
    return flags.pop()


def _loss_result(results: list) -> dict:
    """The result of a rank that computed the loss (under a pipeline, a last stage)."""
    return next((r for r in results if r.get("has_loss", True)), results[0])


def _check_stream_room(plan: Plan, task_cpus: float, chosen: bool) -> None:
    """--streaming tokenizes while the ranks train: Ray Data's tasks need CPUs the ranks
    do not reserve, or the stream never starts (Ray queues them forever). ``chosen``:
    streaming was raylm's choice (--streaming unset, a large corpus)."""
    total = ray.cluster_resources().get("CPU", 0.0)
    reserved = plan.world_size * plan.cpus_per_worker
    if total - reserved < task_cpus:
        raise ConfigError(
            f"--streaming: the {plan.world_size} rank(s) reserve {reserved:g} of the "
            f"cluster's {total:g} CPUs, and Ray Data's tokenizing tasks need {task_cpus:g} "
            "each while training runs: lower --cpus_per_worker or --num_workers, or add "
            "CPUs" + (" (streaming was chosen for training data over 1 GiB; "
                      "--streaming false tokenizes it into the cache first)"
                      if chosen else ""))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def train(config: TrainConfig, callbacks: tuple = (), faults: tuple = (),
          model_init=None, compute_loss_func=None, tp_plan=None, train_dataset=None,
          eval_dataset=None) -> TrainResult:
    """Train (and/or evaluate) as ``config`` says; returns final metrics and output path.
    ``model_init``: a model of your own in place of the config's Hugging Face model, a
    callable with no arguments returning a ``torch.nn.Module`` whose ``forward(input_ids)``
    gives the logits (raylm.models.custom says what applies to it).
    ``compute_loss_func(outputs, labels, num_items_in_batch)``: your own loss, as the HF
    Trainer's (``outputs.logits``: the model's logits) (raylm.models.objectives.UserLoss).
    ``tp_plan``: model_init's tensor-parallel plan, ``{module pattern: style}`` as
    transformers' ``base_model_tp_plan`` (``{"blocks.*.up": "colwise", "blocks.*.down":
    "rowwise"}``; raylm.models.custom.check_tp_plan).
    ``train_dataset`` / ``eval_dataset``: the data as a ``ray.data.Dataset`` or a
    ``datasets.Dataset`` with a text column, in place of --train_file / --validation_file
    (raylm.data.given). ``faults``: injected rank failures, for tests (see Driver)."""
    if not isinstance(config, TrainConfig):
        raise ConfigError("train() takes a raylm.TrainConfig")
    return Driver(config, callbacks, faults, model_init=model_init,
                  compute_loss_func=compute_loss_func, tp_plan=tp_plan,
                  datasets={"train_dataset": train_dataset,
                            "eval_dataset": eval_dataset}).run()
