"""The Ray cluster as the driver sees it: connect, measure capacity, reserve bundles."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

import ray
# Per node: Ray's public API (ray.available_resources) sums the free resources over the
# cluster, and a tensor-parallel group must fit one node.
from ray._private.state import available_resources_per_node
from ray.util.placement_group import placement_group, remove_placement_group

log = logging.getLogger("raylm")


def connect(address: str | None, early: Optional["EarlyStart"] = None) -> bool:
    """Join the cluster at ``address`` / $RAY_ADDRESS, or start a local one (or take the
    one ``early`` started).

    Returns True when this call started Ray (and the caller should shut it down).
    """
    if early is not None:
        early.join()
        return True
    if ray.is_initialized():
        return False
    if starts_local(address):
        log.info("starting a local Ray cluster")
        start_local()
    else:
        address = address or os.environ["RAY_ADDRESS"]
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address, logging_level=logging.WARNING)
    return True


def starts_local(address: str | None) -> bool:
    """Whether connect(address) would start a local cluster."""
    return not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))


class EarlyStart:
    """start_local on a thread of its own, so that the driver runs its last input check
    (the schedule's: about 1.2 s of transformers' imports) while Ray's processes come up:
    Ray's start takes 2.5-3.6 s here, most of it waiting on Ray's processes (its
    dashboard head's address, its raylet's registration). connect(address, early) takes
    the cluster once it is up; shutdown() stops it, for an input error too (raised after
    Ray is down; Ray's own start-up lines, held meanwhile, are dropped, so that the error
    stays the one line printed).

    The thread lives on until shutdown() has stopped the cluster: Ray fate-shares the
    processes ray.init starts with their starter through PR_SET_PDEATHSIG, which Linux
    fires when the starting thread ends, not its process (a thread that ended with Ray's
    shutdown would kill its raylet before the raylet stops its agents, and they would be
    left running). A process that exits without shutdown() takes its cluster with it so.
    ray.init sets its driver's SIGTERM handler (exit, so that atexit shuts Ray down) only
    from the main thread: set here instead."""

    def __init__(self, **init_kwargs):
        log.info("starting a local Ray cluster")
        self.error: Optional[BaseException] = None
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.held: list = []  # Ray's log records from the start, until join or shutdown
        self.sigterm = threading.current_thread() is threading.main_thread()
        if self.sigterm:
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        self.thread = threading.Thread(target=self._run, args=(init_kwargs,),
                                       name="raylm-ray-start", daemon=True)
        self._filtered = list(logging.getLogger("ray").handlers)
        for h in self._filtered:
            h.addFilter(self._hold)
        self.thread.start()

    def _hold(self, record) -> bool:
        if record.thread == self.thread.ident and not self.ready.is_set():
            if not (self.sigterm and record.getMessage().startswith("SIGTERM handler")):
                self.held.append(record)
            return False
        return True

    def _run(self, init_kwargs: dict) -> None:
        try:
            start_local(**init_kwargs)
        except BaseException as e:  # (raised in the caller's thread by join)
            self.error = e
        finally:
            self.ready.set()
        self.stop.wait()

    def _release(self, emit: bool) -> None:
        self.ready.wait()
        for h in self._filtered:
            h.removeFilter(self._hold)
        self._filtered = []
        held, self.held = self.held, []
        if emit:
            for record in held:
                logging.getLogger(record.name).handle(record)

    def join(self) -> None:
        """Wait for the cluster; raises what its start raised (the thread ended first:
        whatever process the start had begun ends with it)."""
        self._release(emit=True)
        if self.error is not None:
            self.stop.set()
            raise self.error

    def shutdown(self) -> None:
        """Stop the cluster (or wait for its start to fail), then end the thread."""
        self._release(emit=False)
        if self.error is None:
            stop_local()
        self.stop.set()
        self.thread.join(timeout=5)


# What a Ray cluster that raylm starts for itself (no --address) leaves out: what only a
# dashboard reads, and it has none. Ray's own processes poll while the ranks train, and on
# a machine whose cores the ranks fill that CPU comes out of the step
# (benchmarks/bench_ray_idle.py: README, Benchmarks, "What Ray's own processes take"):
# - enable_metrics_collection: the metrics every process exports for the dashboard's
#   Prometheus (raylm writes its own, metrics.jsonl);
# - task_events_report_interval_ms: task events for the State API and the timeline;
# - REPORTER_UPDATE_INTERVAL_MS (read by the dashboard agent): its node and process stats,
#   every 5 s by default (the agent 0.65-0.8% of one core -> 0.15-0.2%).
# Kept: the workers Ray prestarts for a driver's first tasks, which idle on when no task
# comes (about 1% of one core), because the first rank actor starts in one of them: 0.3 s
# sooner (prestart_worker_first_driver off: 0.63 against 0.32-0.38 s).
# A cluster raylm joins (--address, $RAY_ADDRESS) keeps its own settings.
LOCAL_SYSTEM_CONFIG = {
    "enable_metrics_collection": False,
    "task_events_report_interval_ms": 0,
}
# Transparent huge pages for a rank's allocations (--huge_pages): glibc's malloc advises
# the kernel to back its heap and its large mappings with 2 MiB pages where the kernel's
# THP mode is madvise (the usual one). A step frees and allocates again tensors of MiBs
# (activations, logits, their gradients); in 4 KiB pages each allocation faults in every
# page: the benchmark's GPT-2 loop took 1.1M minor faults in 23 steps, 0.09M with it, and
# its steps 1-9% less time (README, Benchmarks, "Huge pages"). glibc reads the variable
# when a process starts, so it reaches a rank through its process's environment: the
# processes of a cluster raylm starts inherit it from the raylet, and a rank on another
# cluster gets it through its actor's runtime_env (rank_runtime_env). torch's own
# THP_MEM_ALLOC_ENABLE (2 MiB-aligned tensors) measured slower than the default here.
HUGE_PAGES = "glibc.malloc.hugetlb=1"
LOCAL_ENV = {"REPORTER_UPDATE_INTERVAL_MS": "60000", "GLIBC_TUNABLES": HUGE_PAGES}
_LOCAL: dict = {}  # the cluster start_local started and the variables it gave it


def _not_auth_on(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this")


def start_local(**init_kwargs) -> None:
    """Start a Ray cluster of this driver's own, with LOCAL_SYSTEM_CONFIG and LOCAL_ENV
    (a variable already set is kept); ``init_kwargs`` go to ``ray.init``."""
    # address="local": a bare ray.init() would join any cluster that `ray start` (or
    # another program) left running on this machine, silently.
    kwargs = dict(address="local", logging_level=logging.WARNING, include_dashboard=False,
                  _system_config=LOCAL_SYSTEM_CONFIG)
    kwargs.update(init_kwargs)
    # Ray's processes take the variables from the environment ray.init starts them in
    # (and the raylet hands them to every worker it starts): set only for that call, the
    # driver's own environment stays as it was.
    added = {k: v for k, v in LOCAL_ENV.items() if k not in os.environ}
    os.environ.update(added)
    # Ray's notice that it turned token authentication on (its default): not raylm's to
    # tell on every run. Its warning when authentication is off is kept.
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    auth.addFilter(_not_auth_on)
    try:
        ray.init(**kwargs)
    finally:
        auth.removeFilter(_not_auth_on)
        for k in added:
            os.environ.pop(k, None)
    _LOCAL.clear()
    _LOCAL.update(cluster=cluster_id(), env=added)


def stop_local() -> None:
    """ray.shutdown(), first killing the autoscaler monitor of a cluster start_local
    started (it has nothing to scale: the cluster is this machine).

    Ray stops its processes one after the other, each given a second to exit on SIGTERM,
    and its GCS before its monitor; the monitor's SIGTERM handler reports its own end to
    the GCS, which is gone by then, so it outlasts its second and is killed: a second of
    every shutdown (1.0 of 1.3 s here), waited out after the run has ended. Killed first,
    without a signal handler to run, it is gone at once. Another cluster (joined, or not
    started here) is shut down as ray.shutdown() does."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and _own_local():
        try:
            node.kill_monitor(check_alive=False)
        except Exception as e:  # (the shutdown below still stops it, a second later)
            log.debug("could not stop Ray's monitor first: %s", e)
    ray.shutdown()


def _own_local() -> bool:
    """Whether this driver's connection is to the cluster start_local started."""
    return bool(_LOCAL) and _LOCAL["cluster"] == cluster_id()


def cluster_id() -> Optional[tuple]:
    """This driver's connection: its cluster and job. Actors die with the job that
    started them (ray.shutdown, a new ray.init), so kept ranks (raylm.runtime.kept) are
    of this one or gone; a cluster start_local started is this one or another."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.gcs_address, context.get_job_id()


def rank_runtime_env(huge_pages: bool) -> Optional[dict]:
    """The runtime_env a rank actor needs for --huge_pages, or None when its process
    starts as wanted anyway: on the cluster start_local started (its workers inherit the
    tunable), or where the driver's environment sets GLIBC_TUNABLES (the user's own, kept
    as it is). A runtime_env costs a rank's start about 0.5 s here: Ray starts a process
    of its own for it instead of one it prestarted."""
    if "GLIBC_TUNABLES" in os.environ:
        return None
    has = _own_local() and _LOCAL["env"].get("GLIBC_TUNABLES") == HUGE_PAGES
    if huge_pages == has:
        return None
    return {"env_vars": {"GLIBC_TUNABLES": HUGE_PAGES if huge_pages else ""}}


# Ray Data's detached actors (name, namespace): its stats actor and its autoscaling
# coordinator. Ray Data starts them at a dataset's first execution and leaves them for the
# cluster's life, and each idle Ray process polls: 0.8% of one core each on the 2-core
# development machine while the ranks train (benchmarks/bench_ray_idle.py). Ray Data gets
# or creates them at each use, so stopping them once the data is ready costs a later
# execution only their start.
RAY_DATA_ACTORS = (("datasets_stats_actor", "_dataset_stats_actor"),
                   ("AutoscalingCoordinator", "AutoscalingCoordinator"))


def stop_ray_data_actors() -> int:
    """Stop Ray Data's idle actors (RAY_DATA_ACTORS); returns how many were running. For
    a cluster this driver started, once nothing reads through Ray Data any more (on a
    cluster others share, their datasets may be using them)."""
    stopped = 0
    for name, namespace in RAY_DATA_ACTORS:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            stopped += 1
        except ValueError:  # not started: no dataset ran on this cluster
            pass
    return stopped


def capacity(cpus_per_worker: float, use_gpu: bool, group: int = 1) -> int:
    """How many rank actors the live nodes can hold, each with its CPUs (and one GPU).

    Counted per node from total resources, in whole groups of ``group`` ranks (a
    tensor-parallel group never spans nodes; nor does a rank).
    """
    return sum(fit - fit % group for fit in _ranks_per_node(cpus_per_worker, use_gpu))


def largest_node(cpus_per_worker: float, use_gpu: bool) -> int:
    """The most rank actors one live node can hold."""
    return max(_ranks_per_node(cpus_per_worker, use_gpu), default=0)


def ranks_fitting(resources: dict, cpus_per_worker: float, use_gpu: bool,
                  unbounded: int) -> int:
    """How many rank actors ``resources`` (a node's, or a placement-group bundle's) hold:
    by CPUs, and by GPUs with ``use_gpu``; ``unbounded`` stands for the CPU bound when a
    rank takes no CPU."""
    fit = math.floor(resources.get("CPU", 0) / cpus_per_worker + 1e-9) \
        if cpus_per_worker > 0 else unbounded
    if use_gpu:
        fit = min(fit, int(resources.get("GPU", 0)))
    return max(fit, 0)


def _ranks_per_node(cpus_per_worker: float, use_gpu: bool) -> list[int]:
    return [ranks_fitting(node.get("Resources", {}), cpus_per_worker, use_gpu, 10**6)
            for node in ray.nodes() if node.get("Alive")]


def reserve(num: int, cpus_per_worker: float, use_gpu: bool, timeout_s: float, group: int = 1):
    """A placement group for ``num`` ranks, or None if it cannot be placed in time.

    One bundle per group of ``group`` consecutive ranks (a tensor-parallel group): a
    bundle always lies on one node, so a tp group does too, and its collectives stay on
    the node's fast links. Rank r runs in bundle ``dims.node_group(r)``
    (raylm.plan.dims). PACK keeps the bundles together (fewer nodes) but spreads them
    when it must.
    """
    bundle = {"CPU": cpus_per_worker * group}
    if use_gpu:
        bundle["GPU"] = group
    pg = placement_group([dict(bundle) for _ in range(num // group)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    remove_placement_group(pg)
    return None


def _poll_capacity(least: int, cpus_per_worker: float, use_gpu: bool, group: int,
                   timeout_s: float, every_s: float) -> int:
    """The cluster's capacity in ranks once it holds ``least``, or after ``timeout_s``."""
    deadline = time.time() + timeout_s
    n = capacity(cpus_per_worker, use_gpu, group)
    while n < least and time.time() < deadline:
        time.sleep(every_s)
        n = capacity(cpus_per_worker, use_gpu, group)
    return n


def wait_for_capacity(target: int, cpus_per_worker: float, use_gpu: bool,
                      settle_s: float = 20.0, group: int = 1) -> int:
    """After a failure: wait until the cluster's view settles, return the usable ranks."""
    return min(target, _poll_capacity(1, cpus_per_worker, use_gpu, group, settle_s, 0.5))


def request_workers(num: int, cpus_per_worker: float, use_gpu: bool, group: int = 1) -> bool:
    """Ask the autoscaler for ``num`` rank actors' bundles (one per group of ``group``
    ranks, as ``reserve`` places them); 0 withdraws the request. A cluster without an
    autoscaler records the request and does nothing. Returns True when a request is
    standing. The request lapses ``REQUEST_TTL_S`` after it was last made
    (``refresh_request``): a driver that dies leaves no standing request behind."""
    bundle = {"CPU": cpus_per_worker * group}
    if use_gpu:
        bundle["GPU"] = group
    bundles = [dict(bundle) for _ in range(num // group)]
    _REQUEST["bundles"] = bundles
    _send_request(bundles)
    if bundles:
        log.info("asked the autoscaler for %d bundle(s) of %s (--max_workers %d)",
                 len(bundles), bundle, num)
    return bool(bundles)


def refresh_request() -> None:
    """Make the standing request again (the driver calls this between steps, at most
    every REQUEST_REFRESH_S): it lapses REQUEST_TTL_S after the last time."""
    if _REQUEST.get("bundles") and time.time() - _REQUEST.get("sent", 0) > REQUEST_REFRESH_S:
        _send_request(_REQUEST["bundles"])


# Ray's autoscaler keeps one request_resources() per cluster: the last one written. Ray
# Data sends its own through a coordinator actor (one per cluster, detached) that writes
# the merged requests of its users every 20 s, so a request written directly with
# ray.autoscaler.sdk.request_resources is wiped within 20 s once any Ray Data pipeline has
# run on the cluster (raylm's own tokenization is one): the nodes were never launched, or
# removed as idle while raylm still wanted them. raylm's request therefore goes through
# that coordinator, as one more of its users, and is merged with Ray Data's. (Ray has no
# public API for it; without the module, the plain request is written.)
REQUEST_TTL_S = 120.0
REQUEST_REFRESH_S = 30.0
_REQUEST: dict = {}


def _send_request(bundles: list) -> None:
    _REQUEST["sent"] = time.time()
    try:
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
            ResourceRequestPriority)
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            DefaultAutoscalingCoordinator)
    except ImportError:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        return
    requester = f"raylm-{ray.get_runtime_context().get_job_id()}"
    coordinator = DefaultAutoscalingCoordinator(requester)
    if bundles:
        # Low priority: the coordinator also hands its users' Ray Data pipelines a share
        # of the cluster by priority; raylm's ranks take theirs through placement groups.
        coordinator.request_resources(bundles, expire_after_s=REQUEST_TTL_S,
                                      priority=ResourceRequestPriority.LOW)
    else:
        coordinator.cancel_request()


def wait_for_workers(least: int, cpus_per_worker: float, use_gpu: bool, group: int,
                     timeout_s: float) -> int:
    """Wait until the cluster holds ``least`` ranks (an autoscaler launching nodes);
    the capacity then, or an error naming --min_workers after ``timeout_s``."""
    from raylm.errors import ConfigError

    n = capacity(cpus_per_worker, use_gpu, group)
    if n < least:
        log.info("waiting for the cluster to hold --min_workers %d rank(s) (now %d)", least, n)
        n = _poll_capacity(least, cpus_per_worker, use_gpu, group, timeout_s, 1.0)
    if n < least:
        raise ConfigError(f"--min_workers {least}: the cluster holds only {n} rank "
                          f"actor(s) of {cpus_per_worker} CPU(s) after {timeout_s:.0f} s")
    return n


def free_ranks(cpus_per_worker: float, use_gpu: bool, group: int = 1,
               avoid: set = frozenset()) -> int:
    """How many more rank actors the cluster could place now (its unreserved CPUs and
    GPUs; a node that joined, or one the autoscaler launched, shows up here), in whole
    groups of ``group`` per node (a tensor-parallel group never spans nodes), on nodes
    not in ``avoid``."""
    fits = [ranks_fitting(free, cpus_per_worker, use_gpu, 0)
            for node, free in available_resources_per_node().items() if node not in avoid]
    return sum(n - n % group for n in fits)
