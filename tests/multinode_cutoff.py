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

import json
import os
import signal
import sys
import tempfile
import time

import ray

from raylm import TrainConfig, train
from multinode_common import descendants, pid_alive, samples, start_cluster, wait_gone

corpus, cache_root = sys.argv[1], sys.argv[2]
STEPS, CUT_AFTER, THAW_AFTER = 16, 4, 9
WATCH = dict(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)


def config(out, **kw):
    base = dict(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                "n_positions=64", train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                output_dir=out, max_steps=STEPS, save_steps=1000, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True, max_failures=5, **WATCH)
    base.update(kw)
    return TrainConfig(**base)


class CutOff:
    def __init__(self, cluster):
        self.cluster = cluster
        self.frozen, self.frozen_rank_pid, self.cut_at, self.thawed_at = [], None, None, None
        self.newcomers_while_cut, self.unreachable_seen = [], []
        self.pids, self.digests, self.sizes = set(), None, {}
        self.past_cut_s = None  # from the freeze to the end of the step after it

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)
        self.sizes[step] = driver.record.plan.world_size
        driver.grow_check_s = 0.0  # look for room at every step boundary
        if step == CUT_AFTER:
            [rank] = [r for r, i in enumerate(driver.worker_info)
                      if sum(j["node_id"] == i["node_id"] for j in driver.worker_info) == 1]
            node_id = driver.worker_info[rank]["node_id"]
            [node] = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
            raylet = node.all_processes["raylet"][0].process.pid
            self.frozen = descendants(raylet)
            self.frozen_rank_pid, self.cut_rank = driver.worker_pids[rank], rank
            assert self.frozen_rank_pid in self.frozen
            for pid in self.frozen:
                os.kill(pid, signal.SIGSTOP)
            self.cut_at, self.cut_node = time.time(), node_id
        elif self.cut_at is not None and self.thawed_at is None:
            if self.past_cut_s is None:
                self.past_cut_s = time.time() - self.cut_at
            # Cut off: training goes on, growth looks for room at every boundary and
            # must not place anything on the frozen node.
            self.newcomers_while_cut.append(driver.newcomers is not None)
            self.unreachable_seen.append(self.cut_node in driver.group.unreachable)
            time.sleep(0.3)
            if step == THAW_AFTER:
                for pid in self.frozen:
                    os.kill(pid, signal.SIGCONT)
                self.thawed_at = time.time()
        elif self.thawed_at is not None and driver.record.plan.world_size < 3:
            if driver.newcomers is not None:  # warming up: join at the next boundary
                warm = driver.newcomers[2]
                ray.wait(warm, num_returns=len(warm), timeout=60)
            else:  # until the node answers again (growth starts newcomers next)
                deadline = time.time() + 60
                while driver.group.unreachable_nodes() and time.time() < deadline:
                    time.sleep(0.2)
        if step == STEPS:
            self.digests = driver.state_digests()


cluster = start_cluster(workers=1, cpus=2, health_check_failure_threshold=60)
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
try:
    ref_out, out = tempfile.mkdtemp() + "/ref", tempfile.mkdtemp() + "/out"
    reference = train(config(ref_out, num_workers=1, gradient_accumulation_steps=6))
    cut = CutOff(cluster)
    hit = train(config(out), callbacks=(cut,))
    wait_gone(cut.pids)
    print("RESULT " + json.dumps({
        "failures": hit.failures,
        "reference": [h["loss"] for h in reference.history],
        "hit": [h["loss"] for h in hit.history],
        "hit_steps": [h["step"] for h in hit.history],
        "sizes": cut.sizes,
        "past_cut_s": cut.past_cut_s, "cut_rank": cut.cut_rank,
        "newcomers_while_cut": cut.newcomers_while_cut,
        "unreachable_seen": cut.unreachable_seen,
        "samples_equal": samples(out) == samples(ref_out),
        "samples_once": all(len(ids) == len(set(ids)) for ids in samples(out).values()),
        "digests": cut.digests,
        "left_running": [p for p in cut.pids if pid_alive(p)],
        "placement_groups": sorted({t["state"] for t in
                                    ray.util.placement_group_table().values()})}))
finally:
    for pid in cut.frozen if "cut" in globals() else ():
        try:  # (nothing of the node stays stopped, whatever happened)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    ray.shutdown()
    cluster.shutdown()
