"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

A node whose network is cut: the Ray head (2 CPUs; the driver's node) at one end of a
veth pair, a 1-CPU Ray node started inside a network namespace of this script's own at
the other, on addresses of that link only (10.213.N.1 and .2). Three data-parallel ranks
of a tiny GPT-2 with dropout on: two on the head, one in the namespace. After step 4 the
link goes down: the namespace's rank and raylet run on, unreachable. The survivors must
release themselves and carry on with 2 ranks, and the node must get no newcomer while it
is cut off; after step 9 the link comes back, the node answers again and the run grows
back to 3. A one-rank run of the same global batch is the reference. Needs root (ip
netns); prints "SKIP <why>" without it. Prints one JSON line with what the test checks.
"""

import logging
import os
import signal
import subprocess
import sys
import time

corpus, cache_root = sys.argv[1], sys.argv[2]
TAG = os.getpid() % 200 + 20
NS, HOST_IF, NS_IF = f"raylm-cut-{os.getpid()}", f"rlh{os.getpid()}", f"rln{os.getpid()}"
HOST_IP, NS_IP = f"10.213.{TAG}.1", f"10.213.{TAG}.2"


def ip(*args, ns=None):
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True)


def make_link() -> None:
    ip("netns", "add", NS)
    ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    ip("link", "set", NS_IF, "netns", NS)
    ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
    ip("link", "set", HOST_IF, "up")
    ip("addr", "add", f"{NS_IP}/30", "dev", NS_IF, ns=NS)
    ip("link", "set", NS_IF, "up", ns=NS)
    ip("link", "set", "lo", "up", ns=NS)


def remove_link() -> None:
    for args in (("link", "del", HOST_IF), ("netns", "del", NS)):
        subprocess.run(["ip", *args], capture_output=True)


try:
    make_link()
except (OSError, subprocess.CalledProcessError) as e:
    remove_link()
    print(f"SKIP network namespaces need root and iproute2 here: {e}")
    sys.exit(0)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from multinode_common import descendants, quiet_ray  # noqa: E402
from multinode_cut import CutOff, run_and_report  # noqa: E402


node_proc, cluster = None, None
try:
    # Ray's own health checks tolerate the cut (a node is declared dead after 60 s).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": HOST_IP, "include_dashboard": False,
        "_system_config": quiet_ray({"health_check_period_ms": 1000,
                                     "health_check_failure_threshold": 60})})
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    node_proc = subprocess.Popen(
        ["ip", "netns", "exec", NS, ray_cli, "start", "--address", cluster.address,
         "--node-ip-address", NS_IP, "--num-cpus", "1", "--block",
         "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    deadline = time.time() + 60
    while time.time() < deadline and sum(n["Alive"] for n in ray.nodes()) < 2:
        time.sleep(0.5)
    assert any(n["Alive"] and n["NodeManagerAddress"] == NS_IP for n in ray.nodes())
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    # (the link cut from the namespace's side: the head's address stays usable there)
    run_and_report(corpus, cache_root, CutOff(
        lambda driver, rank: ip("link", "set", NS_IF, "down", ns=NS),
        lambda: ip("link", "set", NS_IF, "up", ns=NS)))
finally:
    ray.shutdown()
    if node_proc is not None:  # the namespace's Ray node: its processes, by pid
        for pid in descendants(node_proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node_proc.wait()
    if cluster is not None:
        cluster.shutdown()
    remove_link()
