"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

A node cut off: a CPU-less head, a 2-CPU node and a 1-CPU node, three data-parallel ranks
of a tiny GPT-2 with dropout on (two on the first node, one on the second). After step 4
every process of the second node (its raylet, its rank and every other child) is frozen
with SIGSTOP: alive, sockets open, nothing answering, as a node whose network is cut.
Ray reaches nothing there, so the rank cannot be ended; the survivors must be released
from their own side. While the node is frozen the run goes on with two ranks and must not
put a newcomer there; once it is thawed (SIGCONT) the node is usable again and the run
grows back to three ranks. A one-rank run of the same global batch is the reference.
Prints one JSON line with what the test checks.
"""

import os
import signal
import sys

import ray

from multinode_common import descendants, start_cluster
from multinode_cut import CutOff, run_and_report

corpus, cache_root = sys.argv[1], sys.argv[2]
frozen = []  # the node's processes


cluster = start_cluster(workers=1, cpus=2, health_check_failure_threshold=60)
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()


def freeze(driver, rank):
    [node] = [n for n in cluster.worker_nodes
              if n.node_id == driver.worker_info[rank]["node_id"]]
    frozen[:] = descendants(node.all_processes["raylet"][0].process.pid)
    assert driver.worker_pids[rank] in frozen
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)


def thaw():
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


try:
    run_and_report(corpus, cache_root, CutOff(freeze, thaw))
finally:
    thaw()  # (nothing of the node stays stopped, whatever happened)
    ray.shutdown()
    cluster.shutdown()
