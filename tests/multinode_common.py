"""What the multi-node scenario scripts share (they run as scripts: tests/ is their
import path)."""

import json
import logging
import os
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

from raylm.runtime.cluster import LOCAL_ENV, LOCAL_SYSTEM_CONFIG

FAST_FAILURE_DETECTION = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                          "health_check_timeout_ms": 500}


def quiet_ray(system_config: dict) -> dict:
    """``system_config`` with the settings raylm gives a cluster it starts itself
    (raylm.runtime.cluster.LOCAL_SYSTEM_CONFIG, LOCAL_ENV's stats interval, set in this
    process's environment for the nodes it starts): without them each node's dashboard
    agent scans every process of this one machine, and took up to 60% of a core, which
    the ranks' steps and recoveries lost."""
    interval = "REPORTER_UPDATE_INTERVAL_MS"
    os.environ.setdefault(interval, LOCAL_ENV[interval])
    return {**LOCAL_SYSTEM_CONFIG, **system_config}


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids, timeout_s: float = 30.0) -> None:
    """Until none of ``pids`` runs (a lost node's processes exit once their raylet is
    gone), or ``timeout_s``."""
    deadline = time.time() + timeout_s
    while any(pid_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)


def samples(out):
    """{step: its sample ids, sorted} from a run's samples.jsonl (a bucket's too)."""
    from raylm import storage

    lines = storage.read_bytes(storage.join(out, "samples.jsonl")).decode().splitlines()
    return {r["step"]: sorted(i for ids in r["ranks"] for i in ids)
            for r in map(json.loads, lines)}


def descendants(pid):
    """``pid`` and every process under it."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class RemoveNodeOfRank:
    def __init__(self, cluster, at_step, rank):
        self.cluster, self.at_step, self.rank, self.removed = cluster, at_step, rank, None

    def on_step_end(self, driver, step, record):
        if step == self.at_step and self.removed is None:
            node_id = driver.worker_info[self.rank]["node_id"]
            other = driver.worker_info[1 - self.rank]["node_id"]
            assert node_id != other, "both ranks landed on one node"
            [node] = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
            pid = driver.worker_info[self.rank]["pid"]
            self.cluster.remove_node(node, allow_graceful=False)
            self.removed = node_id
            # A lost machine takes its processes with it. Here the node's processes
            # notice their raylet is gone and exit; wait for that so the next step
            # meets a dead rank rather than racing it.
            deadline = time.time() + 30
            while pid_alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            self.rank_exit_s = 30 - (deadline - time.time())


def add_node_in_a_directory_of_its_own(cluster, **node_args):
    """A node whose processes (its raylet and the workers it starts, ranks included) run
    in a fresh directory of their own, as on a machine of its own; returns the node and
    its directory."""
    directory, here = tempfile.mkdtemp(prefix="raylm-node-"), os.getcwd()
    os.chdir(directory)  # (a node's processes start where its raylet starts)
    try:
        return cluster.add_node(**node_args), directory
    finally:
        os.chdir(here)


def files_under(directories) -> list:
    """Every file under ``directories``."""
    return [os.path.join(root, name) for d in directories
            for root, _, names in os.walk(d) for name in names]


def start_cluster(workers: int = 2, cpus: int = 1, node_dirs: list = None,
                  **system_config):
    """A CPU-less head and ``workers`` worker nodes of ``cpus`` CPUs that notice a lost
    node fast (and any other Ray system settings given); the driver's log at INFO on
    stderr. ``node_dirs``: each worker node runs in a directory of its own, appended
    there (add_node_in_a_directory_of_its_own)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,  # (nothing here reads it)
        "_system_config": quiet_ray({**FAST_FAILURE_DETECTION, **system_config})})
    for _ in range(workers):
        if node_dirs is None:
            cluster.add_node(num_cpus=cpus)
        else:
            node_dirs.append(add_node_in_a_directory_of_its_own(cluster, num_cpus=cpus)[1])
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return cluster
