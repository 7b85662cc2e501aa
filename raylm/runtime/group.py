"""The worker group: a run's rank actors in rank order, each with its place and identity.

One ``Rank`` per rank (its actor, the (placement group, bundle) slot it sits in, what it
said of itself), so that re-slicing the group after a failure or a growth keeps the three
together. The group starts, calls, waits on and stops its actors and moves them into a
new generation of the process group; every call reaches the ranks after the pending
commit (raylm.runtime.protocol). What to do with them (which step, which layout) is the
driver's.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raylm.plan.layout import Plan
from raylm.runtime import cluster, kept
from raylm.runtime.health import Heartbeats, behind, describe_doing, end
from raylm.runtime.protocol import PendingCommit, StepRequest, WindowRequest
from raylm.runtime.worker import RankWorker

log = logging.getLogger("raylm")

# How long the survivors of a failure get to return from the failed step (WorkerGroup.live),
# and after how long one still blocked is released from all its peers.
SURVIVOR_GRACE_S = 10.0
RELEASE_AFTER_S = 1.0


class WorkerFailure(Exception):
    """A rank failed, died or did not answer in time; ``lost``: the indices of ranks
    found frozen or stuck (raylm.runtime.health), to be ended before anything else;
    ``replacing``: not a failure but stragglers to replace (not counted)."""

    def __init__(self, message: str, lost: Optional[list] = None, replacing: bool = False):
        super().__init__(message)
        self.lost, self.replacing = list(lost or []), replacing


@dataclass
class Rank:
    actor: Any  # a RankWorker actor handle
    slot: tuple  # (placement group, bundle index): a lost rank's stays reserved
    info: dict  # RankWorker.info(): rank, pid, node_id, ip, device, committed_step


class WorkerGroup:
    """The run's rank actors, in rank order, and the placement groups that hold them."""

    def __init__(self, collective_timeout_s: float, huge_pages: bool,
                 heartbeats: Optional[Heartbeats] = None):
        self.collective_timeout_s = collective_timeout_s
        self.timeout_s = collective_timeout_s + 60  # a wait's default bound
        self.huge_pages = huge_pages
        self.heartbeats = heartbeats  # the waits watch them while ``watching``
        self.watching = False
        self.ranks: list[Rank] = []
        self.pg = None  # the group's placement group
        self.growth_pgs: list = []  # those of ranks that joined a running group
        self.generation = 0  # of the process group: how many times the ranks (re)joined
        self.pending = PendingCommit()  # the prepared step to commit before anything else
        self.inflight: list = []  # the last calls sent to every rank (a failure's settle)
        # Nodes that lost ranks and have not answered since: {node id: a task pinned
        # there (health.end's)}. No newcomer goes there until that task returns.
        self.unreachable: dict = {}
        # Kept ranks this run of fewer ranks left idle, kept again with the group's own
        # at its end (take_kept)
        self.spares: list[Rank] = []
        self.store = None  # the rendezvous store the driver hosts (rendezvous)

    # -- what the driver reads --------------------------------------------------------------
    @property
    def actors(self) -> list:
        return [r.actor for r in self.ranks]

    @property
    def infos(self) -> list[dict]:
        return [r.info for r in self.ranks]

    @property
    def slots(self) -> list:
        return [r.slot for r in self.ranks]

    def __len__(self) -> int:
        return len(self.ranks)

    def placement(self) -> str:
        """Where the ranks run, in one line: each node's id, address and ranks."""
        nodes: dict = {}
        for i in self.infos:
            nodes.setdefault((i["node_id"][:8], i["ip"]), []).append(i["rank"])
        where = "; ".join(f"node {node} ({ip}) ranks {spans(ranks)}"
                          for (node, ip), ranks in nodes.items())
        return f"{len(self.infos)} rank(s) on {len(nodes)} node(s): {where}"

    def describe(self, i: int) -> str:
        info = self.ranks[i].info if i < len(self.ranks) else {}
        return f"rank {i} (pid {info.get('pid')}, node {str(info.get('node_id'))[:8]})"

    # -- starting ---------------------------------------------------------------------------
    def start(self, plan: Plan, n: int) -> None:
        """One actor per rank of ``plan`` (``n`` of them) in the group's placement group,
        a tensor-parallel group's ranks in one bundle (one node)."""
        slots = [(self.pg, plan.dims.node_group(r)) for r in range(n)]
        actors = start_actors(plan, slots, range(n), n, self.huge_pages)
        infos = self.wait([a.info.remote() for a in actors])
        self.ranks = [Rank(a, s, i) for a, s, i in zip(actors, slots, infos)]

    def take_kept(self, plan: Plan) -> bool:
        """Start with the rank processes a last run kept (raylm.keep_ranks), and as many
        new ones as ``plan`` has more ranks (in the places of ranks that run lost, then
        in a placement group of their own), each as the rank ``plan`` puts on its node;
        kept ones beyond ``plan``'s ranks wait idle beside it (``spares``). False, with
        them stopped, when there are none of this shape, there is no room for the new
        ones now, they cannot be placed so, or one does not answer."""
        ranks = kept.take(plan.cpus_per_worker, plan.use_gpu, self.huge_pages)
        if ranks is None:
            return False
        more = max(0, plan.world_size - len(ranks.actors))
        n_kept = plan.world_size - more
        actors, slots = list(ranks.actors), list(ranks.slots)
        nodes, pgs = list(ranks.node_ids), list(ranks.pgs)
        try:
            if more:
                new_slots = ranks.free[:more]
                if len(new_slots) < more:
                    pg = self._reserve_more(plan, more - len(new_slots))
                    pgs.append(pg)
                    new_slots += [(pg, b) for b in range(more - len(new_slots))]
                new = start_actors(plan, new_slots, range(n_kept, plan.world_size),
                                   plan.world_size, self.huge_pages)
                actors, slots = actors + new, slots + new_slots
                nodes += [i["node_id"] for i in self.wait([a.info.remote() for a in new])]
            order = place(plan, nodes)
            if order is None:
                raise WorkerFailure("the kept ranks' nodes do not hold the layout")
            if len(order) < len(actors) and not kept.room_for_tasks():
                raise WorkerFailure("idle kept ranks would leave no CPU for Ray Data")
            infos = self.wait([actors[i].reset.remote(r, plan.world_size,
                                                      plan.torch_threads)
                               for r, i in enumerate(order)], timeout_s=60)
        except WorkerFailure as e:
            log.info("not using the kept rank processes: %s", e)
            kill(actors)
            for pg in pgs:
                remove(pg)
            return False
        self.ranks = [Rank(actors[i], slots[i], info) for i, info in zip(order, infos)]
        idle = sorted(set(range(len(actors))) - set(order))
        self.spares = [Rank(actors[i], slots[i], {"node_id": nodes[i]}) for i in idle]
        self.pg, self.growth_pgs = pgs[0], pgs[1:]
        log.info("%d rank process(es) kept from the last run%s%s", n_kept,
                 f", {more} started" if more else "",
                 f", {len(self.spares)} idle beside it" if self.spares else "")
        return True

    @staticmethod
    def _reserve_more(plan: Plan, more: int):
        """A placement group for ``more`` ranks beside kept ones, if the cluster has room
        for them now (else WorkerFailure: the run then starts all its ranks afresh)."""
        if cluster.ranks_fitting(ray.available_resources(), plan.cpus_per_worker,
                                 plan.use_gpu, more) < more:
            raise WorkerFailure(f"no room now for the {more} rank(s) more than kept")
        pg = cluster.reserve(more, plan.cpus_per_worker, plan.use_gpu, timeout_s=10)
        if pg is None:
            raise WorkerFailure(f"no room now for the {more} rank(s) more than kept")
        return pg

    def offer_for_next_run(self, plan: Plan) -> bool:
        """Leave the ranks up for the next run (raylm.keep_ranks) once each has dropped
        its engine, with the places of ranks the run lost; the group is then empty.
        False (nothing offered) when one does not reset, or a node of the run is
        unreachable or gone."""
        pgs = [pg for pg in [self.pg] + self.growth_pgs if pg is not None]
        if self.unreachable_nodes() or not all(
                placement_group_table(pg).get("state") == "CREATED" for pg in pgs):
            return False
        free = self.free_slots(plan)
        n = len(self.ranks)
        try:
            self.wait([r.actor.reset.remote(i, n, plan.torch_threads)
                       for i, r in enumerate(self.ranks)], timeout_s=60)
        except WorkerFailure:
            return False
        every = self.ranks + self.spares
        kept.offer(kept.KeptRanks(
            actors=[r.actor for r in every], slots=[r.slot for r in every],
            node_ids=[r.info["node_id"] for r in every], pgs=pgs, free=free, cpus_per_worker=plan.cpus_per_worker, use_gpu=plan.use_gpu,
            cluster=cluster.cluster_id(), huge_pages=self.huge_pages))
        self.ranks, self.pg, self.growth_pgs, self.spares = [], None, [], []
        return True

    # -- calling ----------------------------------------------------------------------------
    def wait(self, refs: list, timeout_s: Optional[float] = None,
             deadline_s: Optional[float] = None) -> list:
        """Results of ``refs`` in order; the first failure of any rank raises at once, as
        does a rank that stops answering its heartbeat. ``deadline_s``: a step's
        deadline (refs in rank order), past which its ranks furthest behind are lost."""
        timeout_s = timeout_s or self.timeout_s
        pending = list(refs)
        t0 = time.time()
        deadline = t0 + timeout_s
        beats = self.heartbeats if self.watching else None
        got = {}
        try:
            while pending:
                wait_s = max(0.0, deadline - time.time())
                if beats is not None:
                    wait_s = min(wait_s, beats.interval_s)
                if deadline_s is not None:
                    wait_s = min(wait_s, max(0.0, t0 + deadline_s - time.time()))
                ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
                if ready:
                    got[ready[0]] = ray.get(ready[0])  # raises if that rank failed
                if beats is not None and beats.due():
                    self._check_heartbeats()
                if not pending:
                    break
                if deadline_s is not None and time.time() - t0 > deadline_s:
                    self._stuck([i for i, ref in enumerate(refs) if ref not in got],
                                deadline_s)
                if not ready and time.time() >= deadline:
                    raise WorkerFailure(f"no answer from the ranks in {timeout_s:.0f} s")
            return [got[ref] for ref in refs]
        except (RayActorError, RayTaskError, GetTimeoutError) as e:
            raise WorkerFailure(first_line(e)) from e

    def watch(self, on: bool) -> None:
        """Watch the ranks' heartbeats in every wait from now on (while the run trains:
        setting up, regrouping and rebuilding run long calls of their own, bounded by
        their own timeouts), or stop. Each watch starts afresh."""
        if on and not self.watching and self.heartbeats is not None:
            self.heartbeats.pings.clear()
        self.watching = on

    def _check_heartbeats(self) -> None:
        """Raise for the ranks silent past the heartbeat timeout (frozen, or their node
        cut off), naming each and what it was last doing."""
        beats = self.heartbeats
        lost = beats.check(self.actors)
        if lost:
            names = "; ".join(
                f"{self.describe(i)}, last seen in "
                f"{describe_doing(beats.doing(self.ranks[i].actor))}" for i in lost)
            raise WorkerFailure(f"no heartbeat for {beats.timeout_s:g} s (frozen, or its "
                                f"node cut off): {names}", lost=lost)

    def _stuck(self, waiting: list[int], deadline_s: float) -> None:
        """A step past its deadline: its ranks furthest behind (health.behind) are lost."""
        beats = self.heartbeats
        doings = [beats.doing(self.ranks[i].actor) if beats else (0, -1, "unknown")
                  for i in waiting]
        lost = [waiting[k] for k in behind(doings)]
        names = "; ".join(f"{self.describe(waiting[k])} in {describe_doing(d)}"
                          for k, d in enumerate(doings))
        raise WorkerFailure(f"the step is past its deadline of {deadline_s:.1f} s "
                            f"(--step_deadline_factor x the recent median, at least "
                            f"--step_deadline_floor_s); not done: {names}", lost=lost)

    def flush(self) -> None:
        """Send the pending commit on its own (a commit that fails fails the rank's next
        call)."""
        step = self.pending.take()
        if step is not None:
            self.inflight = [a.commit.remote(step, self.generation) for a in self.actors]

    def send(self, make: Callable[[int, Any], Any]) -> list:
        """``make(rank, actor)`` for every rank, after the pending commit: the refs, not
        waited for."""
        self.flush()
        self.inflight = [make(r, a) for r, a in enumerate(self.actors)]
        return self.inflight

    def call(self, method: str, *args) -> list:
        """Every rank's ``method(*args)``, waited for."""
        return self.wait(self.send(lambda r, a: getattr(a, method).remote(*args)))

    def call_each(self, make: Callable[[int, Any], Any]) -> list:
        """Every rank's ``make(rank, actor)``, waited for."""
        return self.wait(self.send(make))

    def send_step(self, requests: list[StepRequest]) -> list:
        """Each rank its part of a step (in rank order), the pending commit riding on
        it: one Ray call per rank and step."""
        commit = self.pending.take()
        for req in requests:
            req.generation, req.commit = self.generation, commit
        self.inflight = [a.train_step.remote(req) for a, req in zip(self.actors, requests)]
        return self.inflight

    def send_window(self, req: WindowRequest) -> tuple:
        """Steps for the ranks to run on their own (--step_protocol ranks), after the
        pending commit: (rank 0's answers, streamed one per step; the others' refs, one
        answer each at the window's end). The ranks are pinged once as it starts (their
        sockets' endpoints, should one freeze in it)."""
        req.generation, req.commit = self.generation, self.pending.take()
        stream = self.actors[0].stream_steps.options(num_returns="streaming").remote(req)
        self.inflight = [a.run_steps.remote(req) for a in self.actors[1:]]
        if self.watching and self.heartbeats is not None:
            self._check_heartbeats()
        return stream, self.inflight

    def next_agreed(self, stream, others: list, quiet_s: float,
                    deadline_s: Optional[float] = None):
        """Rank 0's next answer in a window of steps (a StepTable, then its final dict;
        None past the end). Each answer says every rank lived through the step, so
        while they come within ``quiet_s`` nothing else is looked at, and a step costs
        the driver the same whatever the ranks. Past it, the others' calls (one that
        failed stalls rank 0) and the heartbeats are, every heartbeat interval.
        ``deadline_s``: the step's, past which its ranks furthest behind are lost."""
        beats = self.heartbeats if self.watching else None
        interval = beats.interval_s if beats is not None else 1.0
        if deadline_s is not None:
            quiet_s = min(quiet_s, deadline_s)
        t0 = time.time()
        try:
            while True:
                waited = time.time() - t0
                wait_s = quiet_s - waited if waited < quiet_s else interval
                if deadline_s is not None:
                    wait_s = min(wait_s, max(0.0, deadline_s - waited))
                if ray.wait([stream], timeout=wait_s)[0]:
                    try:
                        ref = next(stream)
                    except StopIteration:
                        return None
                    return ray.get(ref)  # raises if rank 0 failed
                waited = time.time() - t0
                if waited < quiet_s:
                    continue
                done = ray.wait(others, num_returns=len(others), timeout=0)[0]
                for ref in done:
                    ray.get(ref)  # raises for a rank that failed
                if beats is not None and beats.due():
                    self._check_heartbeats()
                if deadline_s is not None and waited > deadline_s:
                    done = set(done)
                    self._stuck([0] + [i + 1 for i, ref in enumerate(others)
                                       if ref not in done], deadline_s)
                if waited > self.timeout_s:
                    raise WorkerFailure(f"no answer from rank 0 in {self.timeout_s:.0f} s")
        except RayError as e:  # (a failed rank, or a table lost with rank 0's node)
            raise WorkerFailure(first_line(e)) from e

    def ask_stop(self, first: int) -> None:
        """End the running window of steps early: rank 0 says so in its next row, and
        every rank stops after that step (not waited for)."""
        self.ranks[0].actor.ask_stop.remote(first)

    def live(self, lost: tuple = ()) -> tuple[list[int], list[str], list[dict]]:
        """(indices of the ranks that answer, descriptions of those that do not, the
        answering ranks' RankWorker.info). An
        actor answers after the calls queued before it: a survivor once its failed step
        has returned (at once, or once a peer it waits on has left the group or been
        released from). One still blocked after RELEASE_AFTER_S waits in a collective on
        peers that died or left without their connections closing (a group other objects
        still hold): it is released from all of them (``release``). One that does not
        answer within SURVIVOR_GRACE_S counts as lost (a rank hung in its own code);
        ``lost``: ranks already ended, not asked."""
        asked = [i for i in range(len(self.ranks)) if i not in set(lost)]
        refs = [self.ranks[i].actor.info.remote() for i in asked]
        answered = set(ray.wait(refs, num_returns=len(refs), timeout=RELEASE_AFTER_S)[0])
        blocked = [i for i, ref in zip(asked, refs) if ref not in answered]
        if blocked:
            self.release(blocked, from_all=True)
        live, dead, infos = [], [self.describe(i) for i in lost], []
        deadline = time.time() + SURVIVOR_GRACE_S
        for i, ref in zip(asked, refs):
            try:
                infos.append(ray.get(ref, timeout=max(0.1, deadline - time.time())))
                live.append(i)
            except Exception:
                dead.append(self.describe(i))
        return live, dead, infos

    # -- changing ---------------------------------------------------------------------------
    def select(self, indices: list[int], infos: Optional[list] = None) -> list:
        """Keep the ranks at ``indices``, in that order, as ranks 0, 1, ... (``infos``:
        their fresh RankWorker.info); returns the actors left out (not stopped)."""
        self.flush()  # (applied by the ranks that prepared it, before any leaves)
        chosen = set(indices)
        left = [r.actor for i, r in enumerate(self.ranks) if i not in chosen]
        self.ranks = [Rank(self.ranks[i].actor, self.ranks[i].slot,
                           dict(infos[k] if infos else self.ranks[i].info, rank=k))
                      for k, i in enumerate(indices)]
        return left

    def add(self, actors: list, slots: list, infos: list, pg=None) -> None:
        """Newcomers, as the next ranks (``pg``: their own placement group)."""
        self.flush()  # (applied by the ranks that prepared it, not the newcomers)
        base = len(self.ranks)
        self.ranks += [Rank(a, s, dict(i, rank=base + k))
                       for k, (a, s, i) in enumerate(zip(actors, slots, infos))]
        if pg is not None:
            self.growth_pgs.append(pg)

    def regroup(self, calls: Callable) -> list:
        """Move the ranks into a new generation of the process group: the generation
        goes up and ``calls(master, generation)`` gives the refs (each rank's join,
        regroup or rebuild) that are waited for; ``master``: ``rendezvous``."""
        self.flush()
        self.generation += 1
        return self.wait(calls(self.rendezvous(), self.generation))

    def rendezvous(self) -> str:
        """The address of the group's rendezvous: a TCPStore in the driver for the
        group's life, where each generation meets under its own keys. A rank keeps its
        connection across generations (RankWorker._store), so a regroup opens none;
        torch looks up the peer's name of every new store connection, which costs the
        resolver's timeout (5 s) whenever that lookup is lost, more often the more ranks
        connect at once. And no rank, which may itself be the one lost, hosts it."""
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        if self.store is None:
            self.store = dist.TCPStore(ip, 0, None, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.collective_timeout_s))
        return f"{ip}:{self.store.port}"

    def send_keepers(self, snapshots) -> None:
        """Tell each rank which snapshot keepers to send to (after every change)."""
        if snapshots is not None:
            self.call_each(lambda r, a: a.set_keepers.remote(
                snapshots.keepers_for(self.ranks[r].info["node_id"])))

    def free_slots(self, plan: Plan, taken_too: tuple = (), group: int = 1) -> list:
        """The places in the run's bundles no rank holds (lost ranks'), one (placement
        group, bundle) per rank, in whole groups of ``group`` per bundle (a tensor-
        parallel group shares one), none on an unreachable node; ``taken_too``: slots
        newcomers hold."""
        taken = collections.Counter(self.slots + [r.slot for r in self.spares]
                                    + list(taken_too))
        avoid, free = self.unreachable_nodes(), []
        for pg in [self.pg] + self.growth_pgs:
            nodes = placement_group_table(pg).get("bundles_to_node_id", {}) \
                if avoid and pg is not None else {}
            for b, bundle in enumerate(pg.bundle_specs if pg is not None else ()):
                if nodes.get(b) in avoid:
                    continue
                places = cluster.ranks_fitting(bundle, plan.cpus_per_worker, plan.use_gpu,
                                               0) - taken[(pg, b)]
                free += [(pg, b)] * (places - places % group)
        return free

    def end(self, indices: list[int]) -> None:
        """End ranks that cannot end themselves (frozen, stuck): their actors killed and
        their processes too, and every other rank released from its connections to them
        (``release``). Their nodes take no newcomer until a task there has answered
        (``unreachable_nodes``). They stay in the group (lost) until the recovery leaves
        them out."""
        for i in indices:
            log.warning("ending %s", self.describe(i))
        kill([self.ranks[i].actor for i in indices])
        self.unreachable.update(end([self.ranks[i].info for i in indices]))
        self.release(indices)

    def release(self, indices: list[int], from_all: bool = False) -> None:
        """Every other rank shuts down its sockets to the ranks at ``indices`` (their
        endpoints from their last heartbeat; raylm.runtime.health.release_sockets): a
        collective blocked on them raises even when their processes live on, frozen or
        on a node cut off. ``from_all``: the ranks at ``indices`` shut down theirs to
        every other rank instead. Not waited for."""
        beats = self.heartbeats
        if beats is None:
            return
        beats.read()  # (the answers not read yet: a failure early in the run)
        chosen = set(indices)
        ends = [beats.endpoints(r.actor) for r in self.ranks]
        for i, r in enumerate(self.ranks):
            if (i in chosen) != from_all:
                continue
            peers = [k for k in range(len(self.ranks)) if k != i and (from_all or k in chosen)]
            gone = set().union(*(ends[k] for k in peers))
            if gone:
                r.actor.release.remote(list(gone))

    def abort(self) -> None:
        """Every rank aborts its NCCL communicators (a survivor blocked on a peer that
        died or froze raises nothing on NCCL; raylm.runtime.health.abort_groups), so
        that every rank can leave the broken group. Not waited for."""
        for r in self.ranks:
            r.actor.release.remote([], True)

    def unreachable_nodes(self) -> set:
        """The nodes still unreachable (see ``unreachable``), after dropping those whose
        task has returned (usable again) or failed (Ray took the node out)."""
        if self.unreachable:
            refs = list(self.unreachable.values())
            back = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            for node, ref in list(self.unreachable.items()):
                if ref not in back:
                    continue
                del self.unreachable[node]
                try:
                    ray.get(ref)
                    log.info("node %s answers again: it may take new ranks", node[:8])
                except Exception:  # (the task cannot run: the node is gone)
                    log.info("node %s has left the cluster", node[:8])
        return set(self.unreachable)

    def stop(self) -> None:
        """Stop every rank (and spare) and free the placement groups."""
        kill([r.actor for r in self.ranks + self.spares])
        self.ranks, self.inflight, self.pending = [], [], PendingCommit()
        self.spares = []
        for pg in [self.pg] + self.growth_pgs:
            remove(pg)
        self.pg, self.growth_pgs = None, []
        self.store = None  # (its server closes with it)


def start_actors(plan: Plan, slots: list, ranks, world_size: int, huge_pages: bool) -> list:
    """Start the rank actors of ``ranks``, each in its slot of ``slots`` (placement
    group, bundle); ``huge_pages``: --huge_pages."""
    # (RankWorker.ping answers on a concurrency group's thread, beside the training one)
    actor = ray.remote(concurrency_groups={"health": 1})(RankWorker)
    env = cluster.rank_runtime_env(huge_pages)
    return [actor.options(
        num_cpus=plan.cpus_per_worker, num_gpus=1 if plan.use_gpu else 0, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle),
        **({"runtime_env": env} if env else {}),
    ).remote(rank, world_size, plan.torch_threads) for rank, (pg, bundle) in zip(ranks, slots)]


def place(plan: Plan, nodes: list) -> Optional[list]:
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


def kill(actors: list) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already dead
            pass


def remove(pg) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed
            pass


def spans(numbers: list) -> str:
    """Sorted numbers as runs: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
