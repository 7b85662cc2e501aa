"""The driver: plans the layout, starts the rank actors, hands out steps.

The run moves through explicit states (raylm.runtime.controller, each change logged):
planning and the first start here, then running, resizing, recovering and finishing,
each a handler in ``Driver._train``. The driver never touches tensors: it sends each
rank the sample ids of its micro-batches and gets scalars back. Its parts:

- the step loop: raylm.runtime.steps (StepLoop); the step protocol and the commit:
  raylm.runtime.protocol;
- the rank actors: raylm.runtime.group (WorkerGroup);
- records, log lines and the summary: raylm.runtime.reporting;
- evaluation, checkpoints and the saved model: raylm.runtime.outputs;
- recovery and growth: raylm.runtime.elastic, deciding by raylm.runtime.policy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import ray

from raylm import storage
from raylm.checkpoint.manager import CheckpointManager, read_trainer_state
from raylm.config import TrainConfig
from raylm.data.sampler import GlobalBatchSampler
from raylm.errors import ConfigError, TrainingFailed
from raylm.models.loading import model_line
from raylm.models.lora import lora_line, lora_model_dirs
from raylm.plan.layout import Plan, plan_run
from raylm.plan.text import describe_partition
from raylm.runtime import cluster, faults, kept
from raylm.runtime.best import BestTracker
from raylm.runtime.console import console
from raylm.runtime.controller import Controller, State, Transition
from raylm.runtime.elastic import Growth, Recovery
from raylm.runtime.group import WorkerFailure, WorkerGroup, first_line
from raylm.runtime.health import Heartbeats
from raylm.runtime.metrics import MetricsLog, Progress, open_metrics
from raylm.runtime.outputs import Outputs
from raylm.runtime.policy import FailurePolicy, RunRecord, ScalingPolicy
from raylm.runtime.precision import LossScale
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.inputs import Data, Inputs
from raylm.runtime.output_dir import OutputDir, start_output_dir
from raylm.runtime.prepare import degenerate, prepare_data, total_steps
from raylm.runtime.reporting import Reporter
from raylm.runtime.steps import StepLoop

log = logging.getLogger("raylm")


@dataclass
class TrainResult:
    """What ``train`` returns: where the model went, the final metrics (as
    ``all_results.json``), each optimizer step's record and the failures recovered from."""

    output_dir: str
    metrics: dict
    history: list = field(default_factory=list)  # one dict per optimizer step
    failures: int = 0


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
    def __init__(self, cfg: TrainConfig, callbacks: tuple = (), model_init=None,
                 compute_loss_func=None, tp_plan=None, datasets: Optional[dict] = None):
        self.cfg = cfg
        self.faults = faults.injected()  # (tests: raylm.runtime.faults.inject)
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
        self.stream = None  # --streaming's TokenStream (raylm.data.stream)
        # The rank actors, where each sits and what each said of itself.
        self.group = WorkerGroup(cfg.collective_timeout_s, cfg.huge_pages,
                                 Heartbeats(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s))
        # Recovery after a failure and growth onto new capacity (raylm.runtime.elastic).
        self.recovery: Optional[Recovery] = None
        self.growth: Optional[Growth] = None
        # The state machine of a training run (raylm.runtime.controller), the failure
        # policy's last decision, the group's size when a failure began (for the resize
        # event once recovered) and what a restart from a checkpoint starts.
        self.controller: Optional[Controller] = None
        self.decision = None
        self.failed_at_size: Optional[int] = None
        self.restart = None
        # Where the run is (step, plan, latest checkpoint, failures, history), and the
        # policies that decide what a failure or a smaller cluster means.
        self.record = RunRecord()
        self.failure_policy = FailurePolicy(cfg.max_failures)
        self.scaling: Optional[ScalingPolicy] = None  # from the first plan's size
        self.metrics: Optional[MetricsLog] = None
        self.report: Optional[Reporter] = None  # the step records, log lines and summary
        self.loop: Optional[StepLoop] = None  # the step loop of a training run
        # Evaluations, checkpoints, the best of them and the saved model; where they go
        # (--output_dir, and the driver's local stage of an object-store one).
        self.outputs: Optional[Outputs] = None
        self.out: Optional[OutputDir] = None
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
    def _enter(self, state: State, detail: str = "") -> None:
        log.info("driver: %s%s", state.value, f" ({detail})" if detail else "")
        self.state = state
        # Heartbeats are watched while the run trains (raylm.runtime.health).
        self.group.watch(state is State.RUNNING)

    @property
    def workers(self) -> list:
        return self.group.actors

    @property
    def worker_info(self) -> list[dict]:
        return self.group.infos

    @property
    def worker_pids(self) -> list[int]:
        return [i["pid"] for i in self.group.infos]

    @property
    def newcomers(self):
        """Ranks warming up to join (Growth.newcomers), or None."""
        return self.growth.newcomers if self.growth is not None else None

    @property
    def grow_check_s(self) -> float:
        """How often the step loop looks for new capacity (tests set it)."""
        return self.growth.check_s

    @grow_check_s.setter
    def grow_check_s(self, seconds: float) -> None:
        self.growth.check_s = seconds

    def run(self) -> TrainResult:
        cfg = self.cfg
        self._enter(State.PLANNING)
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
        log.info("%s", model_line(cfg, inputs.spec))
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
            for warning in degenerate(cfg, data, plan.global_batch_size, plan.dp):
                log.warning("%s", warning)
            if inputs.spec.lora is not None:
                log.info("%s", lora_line(inputs.spec))
            if plan.zero_stage and plan.dp > 1:
                try:
                    from raylm.report.ownership import ownership_lines, zero_ownership

                    owners = zero_ownership(inputs.spec, plan, inputs.block_size,
                                            rows_limit=0)
                    for line in ownership_lines(owners, plan.dp):
                        log.info("%s", line)
                except Exception as e:  # the log line must never stop a run
                    log.warning("ZeRO ownership unavailable: %s", e)
            self.out = OutputDir(cfg.output_dir, cfg.sync_interval_s)
            if cfg.should_train:
                return self._train(inputs, data, plan)
            return self._evaluate_only(inputs, data, plan)
        finally:
            try:
                if self.stream is not None:  # Ray Data's executor stops with the run
                    self.stream.close()
                self._teardown(offer_ranks=self.finished and not owns_ray)
                if self.metrics is not None:
                    self.metrics.close()  # (the sinks a failed run left open)
                if asked:
                    cluster.request_workers(0, cfg.cpus_per_worker, cfg.use_gpu)
                if owns_ray:
                    if early is not None:
                        early.shutdown()
                    else:
                        cluster.stop_local()
            finally:
                if self.out is not None:  # an object store's last upload (a finished
                    self.out.close(strict=self.finished)  # run fails if it fails)

    def plan(self, inputs: Inputs, capacity: int) -> Plan:
        """The run's layout on a cluster that can hold ``capacity`` ranks: raylm's one
        planning function (what `raylm plan` prints for the same flags); a resumed run
        keeps its global batch, whatever the layout now."""
        record = inputs.resumed_fingerprint or {}
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
        t0 = time.time()
        n = plan.world_size
        times = {"placement": 0.0}
        group = self.group
        with _timed(times, "processes"):
            reused = group.take_kept(plan)
        if not reused:
            while True:
                group.pg = cluster.reserve(n, plan.cpus_per_worker, plan.use_gpu,
                                           timeout_s=30, group=plan.dims.node_group_size)
                if group.pg is not None:
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
                group.start(plan, n)
        log.info("placed %s", group.placement())
        for i in group.infos:
            log.debug("rank %d: pid %d on node %s (%s)", i["rank"], i["pid"],
                      i["node_id"][:8], i["ip"])
        with _timed(times, "process_group"):
            group.regroup(lambda master, generation: [
                w.join.remote(master, plan, self.cfg.collective_timeout_s, generation)
                for w in group.actors])
        with _timed(times, "engines"):
            group.call("build", inputs.spec, data.train, self._rank_settings(), steps)
        if restore:
            with _timed(times, "restore"):
                group.call("load_checkpoint", restore, restore_step)
            log.info("restored %s (step %d)", restore, restore_step)
        if "engines" not in self.startup:  # the run's first group (not a recovery's)
            self.startup.update(times)
        self._send_keepers()
        return plan

    def _offer_ranks(self) -> bool:
        """Leave this run's ranks up for the next (raylm.keep_ranks), with the places of
        those it lost, when they all reset."""
        if not (kept.keeping() and len(self.group) and self.newcomers is None):
            return False
        # (each drops its engine now, memory and GPU memory, rather than at the next run)
        return self.group.offer_for_next_run(self.record.plan)

    def _send_keepers(self) -> None:
        """Tell each rank which snapshot keepers to send to (after every group change)."""
        self.group.send_keepers(self.snapshots)

    def _rank_settings(self) -> dict:
        """The settings a rank's engine is built from (and the injected faults)."""
        return {**self.cfg.to_dict(), "faults": self.faults,
                "steps_per_epoch": self.steps_per_epoch,
                "profile_dir": storage.join(self.out.dest, "profile")}

    def state_digests(self) -> list:
        """Each rank's digest of its parameters and optimizer state at the last
        committed step (RankWorker.state_digest; tests compare replicas)."""
        return self.group.call("state_digest")

    def _teardown(self, offer_ranks: bool = False) -> None:
        """Stop the ranks (``offer_ranks``: left up for the next run where they can be)."""
        if offer_ranks:
            self._offer_ranks()
        self.group.stop()
        if self.growth is not None:
            self.growth.drop()
        if self.snapshots is not None:
            self.snapshots.close()

    # -- training --------------------------------------------------------------------------
    def _train(self, inputs: Inputs, data: Data, plan: Plan) -> TrainResult:
        cfg = self.cfg
        ckpt = CheckpointManager(self.out.dest)
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
        best = BestTracker(cfg.metric_for_best_model, cfg.greater_is_better,
                           cfg.early_stopping_patience, cfg.early_stopping_threshold,
                           state.get("evaluations", ()), state.get("saved", ()))
        # fp16's loss scale where the run starts (a checkpoint keeps it); after that each
        # step's record keeps the state after it (loss_scale).
        self.scale_start = (LossScale(**state["loss_scale"]) if state.get("loss_scale")
                            else LossScale(float(cfg.initial_loss_scale)))
        fingerprint = start_output_dir(cfg, self.out, plan.global_batch_size, inputs)
        ckpt.clear_partial()
        self.metrics = open_metrics(cfg, self.out.local, start_step)
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
                         storage.join(self.out.dest, "profile"))
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
        self._enter(State.STARTING, f"{plan.world_size} rank(s)")
        run.plan = self._start_group(plan, inputs, data, steps, restore, start_step)
        log.info("%s", startup_line(self.startup))
        run.step = start_step
        self.progress = Progress(steps, start_step, cfg.disable_tqdm)
        self.report = Reporter(cfg, run, self.metrics, self.progress, steps, inputs.spec,
                               inputs.block_size, self.out.local)
        self.report.measure_flops(self.group.infos[0].get("device", "cpu"))
        out = self.outputs = Outputs(cfg, self.group, run, self.metrics, self.progress,
                                     inputs.spec, ckpt, best, out=self.out)
        elastic = (cfg, self.group, run, self.scaling, self.snapshots, inputs.spec,
                   inputs.block_size)
        self.recovery = Recovery(*elastic, outputs=out, report=self.report)
        self.growth = Growth(*elastic, setup=lambda: (
            self.spec, self.dataset, self._rank_settings(), self.total_steps))
        self.loop = StepLoop(self, sampler, steps, data, fingerprint)
        self.out.start()  # (an object store's: the driver's files uploaded as they grow)
        t_start = time.time()
        if run.step >= steps:
            log.info("the run is already complete (step %d of %d)", run.step, steps)
        final: dict = {}

        # -- the states' handlers: each does its state's work and names the next ------------
        def running():
            if self.loop.run():
                return Transition(State.RESIZING,
                                  f"{len(self.newcomers[0])} rank(s) joining")
            return Transition(State.FINISHING, f"step {run.step}")

        def resizing():
            before = run.plan.world_size
            self.growth.join()
            self.report.resize_event(before)
            return self._onward(steps)

        def recovering():
            return self._recover(self.controller.error, steps)

        def starting():  # again, from the latest checkpoint
            plan, restore, restore_step = self.restart
            run.plan = self._start_group(plan, inputs, data, steps, restore, restore_step)
            run.step, run.checkpoint = restore_step, restore
            run.history = [h for h in run.history if h["step"] <= restore_step]
            out.truncate_after(restore_step)
            self.report.truncate_after(restore_step)
            return self._recovered(steps)

        def finishing():
            # The end of the run: evaluate and save; a failure here recovers too (from the
            # final checkpoint, so nothing is redone).
            train_runtime = time.time() - t_start
            if cfg.should_eval and data.eval is not None:
                if out.last_eval[0] != run.step:  # (an early stop just evaluated)
                    best.observe(run.step, out.evaluate(data))
                final.update(out.last_eval[1])
            out.save_model()
            self.progress.close()
            self.metrics.close()
            out.save_tokenizer(self.out.dest)
            for sub in lora_model_dirs(self.spec, self.out.dest):  # (LoRA's whole models)
                out.save_tokenizer(sub)
            final.update(self.report.summary(sampler, data.stream, train_runtime,
                                             self.startup, self.loop.sent_ahead))
            if best.evaluations:  # the Trainer's trainer_state names
                final.update({"best_metric": best.best_metric,
                              "best_global_step": best.best_step,
                              "best_model_checkpoint": storage.shown(out.best_path())})
            if self.loop.stopped_early:
                final["stopped_early"] = True
            storage.write_bytes(os.path.join(self.out.local, "all_results.json"),
                                json.dumps(final, indent=2).encode())
            return Transition(State.FINISHED, f"step {run.step}, output in {cfg.output_dir}")

        def finished():
            self.finished = True

        def failed():
            self._teardown()
            raise TrainingFailed(self.decision.reason) from self.controller.error

        self.controller = Controller(
            {State.RUNNING: running, State.RESIZING: resizing, State.RECOVERING: recovering,
             State.STARTING: starting, State.FINISHING: finishing, State.FINISHED: finished,
             State.FAILED: failed},
            self._enter, WorkerFailure, self._on_failure)
        self.controller.run(self._onward(steps), after=State.STARTING)
        return TrainResult(output_dir=self.out.dest, metrics=final,
                           history=run.history, failures=run.failures)

    def _onward(self, steps: int) -> Transition:
        """Running while steps remain (and no early stop), else finishing."""
        run = self.record
        if run.step < steps and not self.loop.stopped_early:
            return Transition(State.RUNNING, f"step {run.step + 1} of {steps}")
        return Transition(State.FINISHING, f"step {run.step}")

    def _on_failure(self, failure: WorkerFailure) -> Transition:
        """A rank failed: recorded, counted, and the failure policy's reason."""
        run = self.record
        if self.failed_at_size is None:  # (a failure during a recovery: the first one's)
            self.failed_at_size = run.plan.world_size
        self.report.event("replace" if failure.replacing else "failure",
                          first_line(failure))
        if not failure.replacing:
            run.failures += 1
        self.decision = self.failure_policy.decide(run.failures, str(failure))
        return Transition(State.RECOVERING, "replacing a straggler" if failure.replacing
                          else self.decision.reason)

    def _recovered(self, steps: int) -> Transition:
        """The run carries on after a recovery (a resize event if the group changed)."""
        self.report.resize_event(self.failed_at_size)
        self.failed_at_size = None
        return self._onward(steps)

    def loss_scale(self) -> Optional[LossScale]:
        """fp16's loss scale for the next step (None without --fp16): the state after
        the last step of the run's history (which a restore rewinds with the steps), else
        the one the run started from."""
        if not self.cfg.fp16:
            return None
        last = self.record.history[-1] if self.record.history else {}
        if "loss_scale_after" in last:
            return LossScale(**last["loss_scale_after"])
        return self.scale_start

    def _recover(self, failure: WorkerFailure, steps: int) -> Transition:
        """Carry out the policies' decisions on a rank failure: give up, or carry on
        with the survivors (raylm.runtime.elastic.Recovery), or else restart the group
        on what the cluster holds now, from the latest checkpoint."""
        run = self.record
        survivors = self.recovery.settle(failure)
        if not self.decision.restart:
            return Transition(State.FAILED, self.decision.reason)
        if self.recovery.carry_on(survivors):
            return self._recovered(steps)
        self._teardown()
        restore = self.outputs.ckpt.latest()
        restore_step = read_trainer_state(restore)["step"] if restore else 0
        log.warning("restoring %s: %d step(s) will be redone",
                    restore or "the initial model (no checkpoint yet)", run.step - restore_step)
        live_n = cluster.wait_for_capacity(self.scaling.target, run.plan.cpus_per_worker,
                                           run.plan.use_gpu,
                                           group=run.plan.dims.node_group_size)
        plan = self.scaling.after_failure(run.plan, live_n)
        self.restart = (plan, restore, restore_step)
        return Transition(State.STARTING, f"{plan.world_size} rank(s)")

    # -- evaluation only -------------------------------------------------------------------
    def _evaluate_only(self, inputs: Inputs, data: Data, plan: Plan) -> TrainResult:
        os.makedirs(self.out.local, exist_ok=True)
        self.out.fetch()  # (an object store's metrics.jsonl goes on)
        self.metrics = open_metrics(self.cfg, self.out.local)
        self.progress = Progress(0, 0, True)
        self._enter(State.STARTING, f"{plan.world_size} rank(s)")
        self.record.plan = self._start_group(plan, inputs, data, 1, None, 0)
        self.record.step = 0
        self._enter(State.RUNNING, "evaluation")
        self.outputs = Outputs(self.cfg, self.group, self.record, self.metrics,
                               self.progress, out=self.out)
        out = self.outputs.evaluate(data)
        storage.write_bytes(os.path.join(self.out.local, "eval_results.json"),
                            json.dumps(out, indent=2).encode())
        # (the Trainer's save_metrics writes all_results.json too; raylm's adds the start-up)
        storage.write_bytes(os.path.join(self.out.local, "all_results.json"),
                            json.dumps({**out, "startup_s": self.startup}, indent=2).encode())
        self.metrics.close()
        self._enter(State.FINISHED, f"eval_loss {out['eval_loss']:.4f}, " + (
            f"accuracy {out['eval_accuracy']:.4f}" if "eval_accuracy" in out else
            f"perplexity {out['perplexity']:.2f}"))
        self.finished = True
        return TrainResult(output_dir=self.out.dest, metrics=out)


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


def train(config: TrainConfig, callbacks: tuple = (), model_init=None,
          compute_loss_func=None, tp_plan=None, train_dataset=None,
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
    (raylm.data.given)."""
    if not isinstance(config, TrainConfig):
        raise ConfigError("train() takes a raylm.TrainConfig")
    with console(config.log_level):
        return Driver(config, callbacks, model_init=model_init,
                      compute_loss_func=compute_loss_func, tp_plan=tp_plan,
                      datasets={"train_dataset": train_dataset,
                                "eval_dataset": eval_dataset}).run()
