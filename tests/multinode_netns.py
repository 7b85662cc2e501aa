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

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

corpus, cache_root = sys.argv[1], sys.argv[2]
STEPS, CUT_AFTER, BACK_AFTER = 16, 4, 9
WATCH = dict(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)
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

from raylm import TrainConfig, train  # noqa: E402
from multinode_common import descendants, pid_alive, samples, wait_gone  # noqa: E402


def config(out, **kw):
    base = dict(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                "n_positions=64", train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                output_dir=out, max_steps=STEPS, save_steps=1000, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True, max_failures=5, **WATCH)
    base.update(kw)
    return TrainConfig(**base)


class Cut:
    def __init__(self, ns_node):
        self.ns_node, self.cut_at, self.back_at, self.past_cut_s = ns_node, None, None, None
        self.newcomers_while_cut, self.unreachable_seen = [], []
        self.pids, self.digests, self.sizes, self.cut_rank = set(), None, {}, None

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)
        self.sizes[step] = driver.record.plan.world_size
        driver.grow_check_s = 0.0
        if step == CUT_AFTER:
            [self.cut_rank] = [r for r, i in enumerate(driver.worker_info)
                               if i["node_id"] == self.ns_node]
            self.cut_at = time.time()
            # (from the namespace's side: the head's address stays usable on the head)
            ip("link", "set", NS_IF, "down", ns=NS)
        elif self.cut_at is not None and self.back_at is None:
            if self.past_cut_s is None:
                self.past_cut_s = time.time() - self.cut_at
            self.newcomers_while_cut.append(driver.newcomers is not None)
            self.unreachable_seen.append(self.ns_node in driver.group.unreachable)
            time.sleep(0.3)
            if step == BACK_AFTER:
                ip("link", "set", NS_IF, "up", ns=NS)
                self.back_at = time.time()
        elif self.back_at is not None and driver.record.plan.world_size < 3:
            if driver.newcomers is not None:  # warming up: join at the next boundary
                warm = driver.newcomers[2]
                ray.wait(warm, num_returns=len(warm), timeout=60)
            else:  # until the node answers again (growth starts newcomers next)
                deadline = time.time() + 60
                while driver.group.unreachable_nodes() and time.time() < deadline:
                    time.sleep(0.2)
        if step == STEPS:
            self.digests = driver.state_digests()


node_proc, cluster, cut = None, None, None
try:
    # Ray's own health checks tolerate the cut (a node is declared dead after 60 s).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "node_ip_address": HOST_IP, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000,
                           "health_check_failure_threshold": 60}})
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    node_proc = subprocess.Popen(
        ["ip", "netns", "exec", NS, ray_cli, "start", "--address", cluster.address,
         "--node-ip-address", NS_IP, "--num-cpus", "1", "--block",
         "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    deadline = time.time() + 60
    while time.time() < deadline and sum(n["Alive"] for n in ray.nodes()) < 2:
        time.sleep(0.5)
    [ns_node] = [n["NodeID"] for n in ray.nodes()
                 if n["Alive"] and n["NodeManagerAddress"] == NS_IP]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    ref_out, out = tempfile.mkdtemp() + "/ref", tempfile.mkdtemp() + "/out"
    reference = train(config(ref_out, num_workers=1, gradient_accumulation_steps=6))
    cut = Cut(ns_node)
    hit = train(config(out), callbacks=(cut,))
    wait_gone(cut.pids)
    print("RESULT " + json.dumps({
        "failures": hit.failures, "cut_rank": cut.cut_rank, "past_cut_s": cut.past_cut_s,
        "reference": [h["loss"] for h in reference.history],
        "hit": [h["loss"] for h in hit.history],
        "hit_steps": [h["step"] for h in hit.history], "sizes": cut.sizes,
        "newcomers_while_cut": cut.newcomers_while_cut,
        "unreachable_seen": cut.unreachable_seen,
        "samples_equal": samples(out) == samples(ref_out),
        "samples_once": all(len(ids) == len(set(ids)) for ids in samples(out).values()),
        "digests": cut.digests,
        "left_running": [p for p in cut.pids if pid_alive(p)],
        "placement_groups": sorted({t["state"] for t in
                                    ray.util.placement_group_table().values()})}))
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
