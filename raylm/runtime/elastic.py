"""Elasticity: carrying on after a rank failure with what survives, and growing onto
capacity that appears. Both act on the worker group and the run record; what a failure
or a larger cluster means (give up, how many ranks) is raylm.runtime.policy's.

After a failure the survivors carry on from the first of these that holds the whole
state: their own memory (full replicas regroup with a smaller dp; replicated stages or
shards are re-laid out from the object store), or the newest in-memory snapshot
(--snapshot_steps, raylm.runtime.snapshots). Failing those, the driver restarts the group
from the latest checkpoint. The global batch stays the run's throughout.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple, Optional

import ray

from raylm.checkpoint.manager import read_trainer_state
from raylm.errors import ConfigError
from raylm.plan.layout import Plan, plan_run
from raylm.plan.text import describe_partition, human_bytes
from raylm.runtime import cluster
from raylm.runtime.group import WorkerFailure, WorkerGroup, first_line, kill, place, remove, \
    start_actors
from raylm.runtime.policy import ScalingPolicy

log = logging.getLogger("raylm")


class Elastic:
    """What recovery and growth share: the group, the run, the scaling policy, the
    snapshots' keepers and the planner for a new size."""

    def __init__(self, cfg, group: WorkerGroup, record, scaling: ScalingPolicy, snapshots,
                 spec, block_size: int):
        self.cfg, self.group, self.record = cfg, group, record
        self.scaling, self.snapshots = scaling, snapshots
        self.spec, self.block_size = spec, block_size

    def _adopt(self, plan: Plan) -> None:
        """The group runs ``plan`` now: the snapshot keepers follow, the log says so."""
        self.record.plan = plan
        self.group.send_keepers(self.snapshots)
        log.info("re-planned: %s", plan.describe())

    def replan(self, workers: int, grow: bool = False) -> Optional[Plan]:
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


class Recovery(Elastic):
    """Carrying on after a rank failure without a restart: ``settle`` lets every rank
    leave the broken group and finds the survivors; ``carry_on`` tries memory, then a
    snapshot. ``outputs`` and ``report`` rewind when steps are redone."""

    def __init__(self, *args, outputs, report):
        super().__init__(*args)
        self.outputs, self.report = outputs, report

    def settle(self, failure: WorkerFailure) -> "Survivors":
        """Every rank leaves the broken group as soon as its failed call returns; that
        closes its connections and releases a survivor still blocked on it. Where the
        layout keeps copies of its state on several ranks (but not the whole state on
        every rank), each first puts its state in the object store for a new layout."""
        run, plan = self.record, self.record.plan
        t0 = time.time()
        if failure.lost:  # frozen or stuck: ended first, their peers released
            self.group.end(failure.lost)
        if plan.use_gpu:  # (NCCL: nothing raises on a lost peer; not run on 2+ GPUs yet)
            self.group.abort()
        export = plan.zero_stage == 0 and plan.dp > 1 and not plan.full_replica_per_rank
        failed = self.group.inflight  # (the failed calls: their errors are known soon)
        leaving = self.group.send(lambda r, w: w.leave_group.remote(export))
        live, dead, infos = self.group.live(failure.lost)
        for ref in failed + leaving:
            try:
                ray.get(ref, timeout=0)
            except Exception as e:
                log.info("  %s", first_line(e))
        log.warning("%s at step %d: %s%s", "a straggler replaced" if failure.replacing
                    else "rank failure", run.step + 1, failure,
                    f"; dead: {', '.join(dead)}" if dead else "")
        self._catch_up(live, infos)
        return Survivors(live, [leaving[i] for i in live], export, t0)

    def _catch_up(self, live: list[int], infos: list[dict]) -> None:
        """--step_protocol ranks: the ranks commit on their own, and rank 0 answers for a
        step just before it commits it, so its answer can be lost with it. Survivors
        that all committed the step after the last one recorded carry on from it, its
        answer taken from a survivor's copy of the step's table (``lost_answer``, which
        the step loop records). Survivors that disagree leave the run at the driver's
        step (the recovery then finds their state cannot be used in memory). ``infos``:
        the survivors' RankWorker.info, asked after they left the group."""
        run = self.record
        if self.cfg.step_protocol != "ranks" or not live:
            return
        steps = {i["committed_step"] for i in infos}
        if len(steps) != 1 or (step := steps.pop()) != run.step + 1:
            return
        try:
            agreed = self.group.wait([self.group.actors[live[0]].last_agreed.remote()],
                                     timeout_s=60)[0]
        except WorkerFailure:
            return
        if agreed is None or agreed[0] != run.step:
            return
        log.warning("the survivors committed step %d, whose answer was lost with rank 0: "
                    "recorded from a survivor's copy", step)
        run.step, run.lost_answer = step, (agreed[1], run.plan)  # (the layout it ran)

    def carry_on(self, survivors: "Survivors") -> bool:
        """Carry on with the survivors in memory (a smaller data-parallel group, or a
        re-planned layout read from their exported state: nothing redone), or from the
        newest whole snapshot in the keepers' memory. False: restart from a checkpoint."""
        plan, (live, exports, export, t0) = self.record.plan, survivors
        if self.shrink_in_memory(live, t0):
            return True
        if export and self.relayout_in_memory(live, exports, t0):
            return True
        if not export and not plan.full_replica_per_rank:
            log.warning("the %s layout%s keeps one copy of each rank's state: the lost "
                        "rank(s)' state has no live copy", plan.dims.describe(),
                        f" at ZeRO-{plan.zero_stage}" if plan.zero_stage else "")
        return self.snapshots is not None and self.from_snapshot(live, t0)

    def shrink_in_memory(self, live: list[int], t0: float) -> bool:
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
            return False  # (relayout_in_memory, or a restart)
        try:
            states = self.group.wait([self.group.actors[i].info.remote() for i in live])
        except WorkerFailure:
            return False
        if any(st["committed_step"] != run.step for st in states):
            log.warning("survivors disagree on the last committed step (%s, driver %d): "
                        "restarting from the latest checkpoint",
                        [st["committed_step"] for st in states], run.step)
            return False
        new_plan = plan.resized(n)
        chosen = live[:n]
        kill(self.group.select(chosen, states[:n]))  # (chosen: the first n of live)
        t_replan = time.time()
        try:
            self.group.regroup(lambda master, generation: [
                w.regroup.remote(master, new_plan, r, n, generation)
                for r, w in enumerate(self.group.actors)])
        except WorkerFailure as e:
            log.warning("regrouping the survivors failed (%s): restarting", e)
            return False
        self._adopt(new_plan)
        log.warning("shrank in memory to %d rank(s) (generation %d) in %.2f s "
                    "(detect and settle %.2f s, regroup %.2f s): 0 committed steps redone; "
                    "step %d runs again under the new layout", n, self.group.generation,
                    time.time() - t0, t_replan - t0, time.time() - t_replan, run.step + 1)
        return True

    def relayout_in_memory(self, live: list[int], exports: list, t0: float) -> bool:
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

    def from_snapshot(self, live: list[int], t0: float) -> bool:
        """Carry on with the survivors from the newest whole snapshot in the keepers'
        memory (--snapshot_steps) when it is newer than the latest checkpoint: the
        steps since it are redone. False when there is none."""
        run = self.record
        state = self.snapshots.latest(run.step)
        ckpt = self.outputs.ckpt.latest()
        ckpt_step = read_trainer_state(ckpt)["step"] if ckpt else 0
        if state is None or state.step <= ckpt_step:
            log.warning("no snapshot newer than the latest checkpoint (step %d)", ckpt_step)
            return False
        if not self._relayout(live, state, t0, f"the snapshot of step {state.step}"):
            return False
        redo = run.step - state.step
        run.step = state.step
        run.history = [h for h in run.history if h["step"] <= state.step]
        self.outputs.truncate_after(state.step)
        self.report.truncate_after(state.step)
        log.warning("restored the snapshot of step %d from memory: %d step(s) will be "
                    "redone", state.step, redo)
        return True

    def _relayout(self, live: list[int], state, t0: float, source: str) -> bool:
        """Re-plan for the survivors and rebuild them under the new layout, each
        reading its shards of ``state`` (raylm.checkpoint.memory.MemoryState) from the
        object store, a holder on its own node first. False when no layout fits."""
        run = self.record
        new_plan = self.replan(len(live))
        order = place(new_plan, [self.group.infos[i]["node_id"] for i in live]) \
            if new_plan is not None else None
        if order is None:
            log.warning("no layout for %d survivor(s) on their nodes: restarting",
                        len(live))
            return False
        chosen = [live[k] for k in order]
        t_replan = time.time()
        log.info("re-planned: %s", new_plan.describe())
        old_workers = self.group.actors
        left = self.group.select(chosen)
        run.plan, n = new_plan, new_plan.world_size
        try:
            results = self.group.regroup(lambda master, generation: [
                w.rebuild.remote(master, new_plan, r, n, generation, state)
                for r, w in enumerate(self.group.actors)])
        except WorkerFailure as e:
            # A rank of the new group failed while rebuilding: the survivors' states
            # are no longer whole (they have no committed step until they load).
            kept = set(chosen)
            kill([old_workers[i] for i in live if i not in kept])
            raise WorkerFailure(f"during the recovery: {e}") from e
        # The exported state is read: its holders drop it; ranks beyond the layout go.
        self.group.call("drop_export")
        kill(left)
        local = sum(r["local"] for r in results)
        remote = sum(r["remote"] for r in results)
        self.group.send_keepers(self.snapshots)
        log.warning("re-laid out in memory on %d rank(s) (generation %d) from %s in %.2f "
                    "s (detect and export %.2f s, rebuild and state transfer %.2f s; %s of "
                    "state, %d chunk(s) read on the same node, %d from another)", n,
                    self.group.generation, source, time.time() - t0, t_replan - t0,
                    time.time() - t_replan, human_bytes(state.nbytes()), local, remote)
        if state.step == run.step:
            log.warning("0 committed steps redone; step %d runs again under the new layout",
                        run.step + 1)
        return True


class Growth(Elastic):
    """Growing onto capacity that appears: newcomers start and warm up while training
    goes on, and join at a step boundary. ``setup()`` gives what a newcomer builds its
    engine from (spec, dataset, settings, total steps)."""

    def __init__(self, *args, setup: Callable[[], tuple]):
        super().__init__(*args)
        self.setup = setup
        # Newcomers warming up: (actors, their placement group, their warm-up calls,
        # their slots).
        self.newcomers = None
        self.check_s = 1.0  # how often the step loop looks for new capacity
        self.last_check = time.time()

    def ready(self) -> bool:
        """Between steps: look for capacity beyond the group (every ``check_s``) and
        start newcomers that warm up while training goes on. True once they are warm:
        the group can grow (``join``)."""
        plan = self.record.plan
        if self.newcomers is None:
            if time.time() - self.last_check < self.check_s:
                return False
            self.last_check = time.time()
            cluster.refresh_request()  # (an autoscaler request lapses unless renewed)
            group = plan.dims.node_group_size
            room = plan.world_size + len(self._free_slots(group)) + \
                cluster.free_ranks(plan.cpus_per_worker, plan.use_gpu, group,
                                   self.group.unreachable_nodes())
            n = self.scaling.grow_to(plan, room)
            if n is not None:
                self._start_newcomers(plan, n - plan.world_size)
            return False
        warm = self.newcomers[2]
        return len(ray.wait(warm, num_returns=len(warm), timeout=0)[0]) == len(warm)

    def join(self) -> bool:
        """Grow the group with the warm newcomers: the live ranks regroup with them in a
        new generation and send them a live replica's state (or, where ranks are not
        full replicas, all rebuild under a new layout). False when they cannot join."""
        run, plan = self.record, self.record.plan
        actors, pg, warm, slots = self.newcomers
        t0 = time.time()
        try:
            ray.get(warm)
        except Exception as e:  # a newcomer that failed to start is not used
            log.warning("a rank that was to join failed to start (%s): not growing", e)
            self.drop()
            return False
        self.newcomers = None
        n = plan.world_size + len(actors)
        if not plan.full_replica_per_rank:
            return self._grow_relayout(actors, pg, slots, t0)
        new_plan = plan.resized(n)
        infos = ray.get([a.info.remote() for a in actors])
        old = self.group.actors
        self.group.add(actors, slots, infos, pg)

        def calls(master, generation):
            return ([w.regroup.remote(master, new_plan, r, n, generation)
                     for r, w in enumerate(old)]
                    + [a.join_running.remote(master, new_plan, len(old) + i, n, generation,
                                             *self.setup(), 0, run.step)
                       for i, a in enumerate(actors)]
                    + [w.send_state.remote(0) for w in old])

        # (A failure here is a rank failure like any other.)
        joined = self.group.regroup(calls)[len(old):len(old) + len(actors)]
        self._adopt(new_plan)
        log.warning("grew in memory to %d rank(s) (generation %d): the live ranks paused "
                    "%.2f s for the regroup and the state transfer (newcomers, slowest: "
                    "group %.2f s, engine %.2f s, state %.2f s)", n, self.group.generation,
                    time.time() - t0, *(max(j[k] for j in joined)
                                        for k in ("join_s", "build_s", "state_s")))
        return True

    def _grow_relayout(self, actors: list, pg, slots: list, t0: float) -> bool:
        """Grow a layout whose ranks are not full replicas (pipeline stages, tensor-
        parallel shards, ZeRO partitions): re-plan for the larger group, then the live
        ranks export their state to the object store and leave their group, and all of
        them, newcomers too, rebuild under the new layout reading their shards from it
        (as a recovery does: ``Recovery``). Nothing is redone."""
        from raylm.checkpoint.memory import merge

        run = self.record
        n = run.plan.world_size + len(actors)
        new_plan = self.replan(n, grow=True)
        infos = ray.get([a.info.remote() for a in actors])
        nodes = [i["node_id"] for i in self.group.infos + infos]
        order = place(new_plan, nodes) \
            if new_plan is not None and new_plan.world_size == n else None
        if order is None:
            log.warning("no layout of %d rank(s) on these nodes: not growing", n)
            self.newcomers = (actors, pg, [], slots)
            self.drop()
            return False
        if pg is not None:
            self.group.growth_pgs.append(pg)
        old_workers = self.group.actors
        state = merge(self.group.call("leave_group", True))
        self.group.add(actors, slots, infos)
        self.group.select(order)
        run.plan = new_plan
        setup = dict(zip(("spec", "dataset", "train_cfg", "total_steps"), self.setup()))
        self.group.regroup(lambda master, generation: [
            w.rebuild.remote(master, new_plan, r, n, generation, state,
                             None if order[r] < len(old_workers) else setup)
            for r, w in enumerate(self.group.actors)])
        ray.get([w.drop_export.remote() for w in old_workers])
        self._adopt(new_plan)
        log.warning("grew in memory to %d rank(s) (generation %d), re-laid out from the "
                    "live ranks' state: they paused %.2f s for the export, the rebuild "
                    "and the state transfer (%s)", n, self.group.generation, time.time() - t0,
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
            remove(pg)
            return
        grown = plan.resized(plan.world_size + len(slots))
        actors = start_actors(grown, slots, range(plan.world_size, grown.world_size),
                              grown.world_size, self.cfg.huge_pages)
        from raylm.runtime.engine import builds_on_meta

        on_meta, master = builds_on_meta(grown, self.spec), self.group.rendezvous()
        warm = [a.warm_up.remote(self.spec, self.cfg.seed, on_meta, master,
                                 self.cfg.collective_timeout_s) for a in actors]
        self.newcomers = (actors, pg, warm, slots)
        log.info("capacity for %d more rank(s): starting them (they join at a step "
                 "boundary once warm)", len(slots))

    def _free_slots(self, group: int = 1) -> list:
        """The places in the run's bundles that no rank holds (lost ranks'), one
        (placement group, bundle) per rank, in whole groups of ``group`` per bundle (a
        tensor-parallel group shares one)."""
        return self.group.free_slots(self.record.plan,
                                     self.newcomers[3] if self.newcomers else (), group)

    def drop(self) -> None:
        """Stop the newcomers still warming up."""
        if self.newcomers is None:
            return
        actors, pg, _, _ = self.newcomers
        kill(actors)
        remove(pg)
        self.newcomers = None


class Survivors(NamedTuple):
    live: list  # indices of the ranks that answered
    exports: list  # their leave_group refs (their exported state, when export)
    export: bool  # the layout's ranks exported their state
    t0: float  # when the recovery began
