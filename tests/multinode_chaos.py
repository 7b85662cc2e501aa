"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

Chaos on a ray.cluster_utils.Cluster: a CPU-less head and three 1-CPU worker nodes, three
data-parallel ranks of a tiny GPT-2 with dropout on (one per node). A few steps after
each time the group is whole again, a seeded random choice: SIGKILL a random rank (its
node stays), or remove the node of a random rank and add a fresh node in its place. The
survivors carry on in memory; the freed CPU or the new node lets a newcomer warm up and
join at a step boundary. A one-rank run of the same global batch on the same cluster is
the reference. The chaos run writes to a bucket (moto's S3 server), its nodes each in a
directory of their own: no path shared for outputs. Prints one JSON line with what the
test checks.
"""

import json
import os
import signal
import sys
import tempfile
import time

import numpy as np
import ray

from raylm import TrainConfig, storage, train
from multinode_common import (add_node_in_a_directory_of_its_own, files_under, pid_alive,
                              samples, start_cluster, wait_gone)
from object_store import s3_endpoint

corpus, cache_root = sys.argv[1], sys.argv[2]
# The suite runs 32 steps (three events, at steps 4, 12 and 17 with seed 0, a rank
# killed twice and then a node replaced: events stop 10 steps before the end, and the
# fourth would come at step 26 or later); a longer
# soak: give the steps after the cache root (python tests/multinode_chaos.py CORPUS
# CACHE 1000).
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 32


def config(out, **kw):
    base = dict(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                "n_positions=64", train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                output_dir=out, max_steps=STEPS, save_steps=1000, logging_steps=10,
                disable_tqdm=True, learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True, max_failures=50)
    base.update(kw)
    return TrainConfig(**base)


class Chaos:
    def __init__(self, cluster, seed: int, node_dirs: list):
        self.cluster, self.rng = cluster, np.random.default_rng(seed)
        self.node_dirs = node_dirs
        self.next_event, self.events, self.pids, self.digests = 4, [], set(), None

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)
        driver.grow_check_s = 0.0  # look for room at every step boundary
        size = driver.record.plan.world_size
        if size < 3:
            # Steps of a real size: the newcomers warm up meanwhile, and join at the next
            # boundary once they have (so the group is whole again well before the end).
            if driver.newcomers is not None:
                warm = driver.newcomers[2]
                ray.wait(warm, num_returns=len(warm), timeout=60)
            else:
                time.sleep(0.3)
        elif step >= self.next_event and step < STEPS - 10:
            rank = int(self.rng.integers(size))
            pid = driver.worker_pids[rank]
            if self.rng.random() < 0.5:
                os.kill(pid, signal.SIGKILL)
                self.events.append(("rank", step, rank))
            else:
                node_id = driver.worker_info[rank]["node_id"]
                [node] = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
                self.cluster.remove_node(node, allow_graceful=False)
                # The node's processes exit once their raylet is gone: wait, so the next
                # step meets a dead rank rather than racing it.
                deadline = time.time() + 30
                while pid_alive(pid) and time.time() < deadline:
                    time.sleep(0.1)
                self.node_dirs.append(add_node_in_a_directory_of_its_own(
                    self.cluster, num_cpus=1)[1])
                self.events.append(("node", step, rank))
            self.next_event = step + int(self.rng.integers(5, 11))
        if step == STEPS:
            self.digests = driver.state_digests()


def model_difference(saved: str, reference: str) -> float:
    """The largest difference between two saved models' weights (``saved`` a bucket's)."""
    from safetensors.torch import load, load_file

    a = load(storage.read_bytes(storage.join(saved, "model.safetensors")))
    b = load_file(os.path.join(reference, "model.safetensors"))
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


node_dirs = []
cluster = start_cluster(workers=3, node_dirs=node_dirs)
try:
    with s3_endpoint() as s3:
        ref_out, out = tempfile.mkdtemp() + "/ref", s3.uri("chaos")
        reference = train(config(ref_out, num_workers=1, gradient_accumulation_steps=6))
        chaos = Chaos(cluster, seed=0, node_dirs=node_dirs)
        hit = train(config(out), callbacks=(chaos,))
        wait_gone(chaos.pids)
        print(f"events: {chaos.events}", file=sys.stderr)
        print("RESULT " + json.dumps({
            "events": chaos.events, "failures": hit.failures,
            "reference": [h["loss"] for h in reference.history],
            "hit": [h["loss"] for h in hit.history],
            "hit_steps": [h["step"] for h in hit.history],
            "samples_equal": samples(out) == samples(ref_out),
            "samples_once": all(len(ids) == len(set(ids)) for ids in samples(out).values()),
            "digests": chaos.digests,
            "model_difference": model_difference(out, ref_out),
            "bucket": s3.keys("chaos"),
            "node_dirs": len(node_dirs), "files_in_node_dirs": files_under(node_dirs),
            "left_running": [p for p in chaos.pids if pid_alive(p)],
            "placement_groups": sorted({t["state"] for t in
                                        ray.util.placement_group_table().values()}),
            "alive_nodes": len([n for n in ray.nodes() if n["Alive"]])}))
finally:
    ray.shutdown()
    cluster.shutdown()
