"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

--streaming on a ray.cluster_utils.Cluster: a CPU-less head (the driver's node) and two
2-CPU worker nodes, one rank (1.5 CPUs) on each, Ray Data's tokenizing tasks in the
remaining half CPUs. After step 4 the node of rank 1 is removed and a fresh node added:
the survivor carries on alone in memory, the newcomer warms up and the group grows back
to two ranks. A one-rank run of the same global batch is the reference. At every step
end the blocks the driver holds are looked up: none may be in the head node's object
store (their ids are read on the node that holds them). Prints one JSON line with what
the test checks.
"""

import json
import os
import sys
import tempfile

import ray

from raylm import TrainConfig, train
from multinode_common import RemoveNodeOfRank, pid_alive, start_cluster, wait_gone

corpus, cache_root = sys.argv[1], sys.argv[2]
STEPS = 12
NODE_CPUS = 2


def config(out, **kw):
    base = dict(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                "n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
                train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                output_dir=out, max_steps=STEPS, save_steps=1000, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, num_workers=2, cpus_per_worker=1.5,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True, max_failures=5, streaming=True,
                shuffle_buffer_size=24, piece_size_mb=0.004)
    base.update(kw)
    return TrainConfig(**base)


def step_ids(out):
    with open(os.path.join(out, "samples.jsonl")) as f:
        ids = {}
        for r in map(json.loads, f):  # (a redone step's line replaces the first)
            ids[r["step"]] = [i for rank in r["ranks"] for i in rank]
    return ids


class Watch(RemoveNodeOfRank):
    """Removes rank 1's node after step 4 and adds a fresh one; lets the newcomer warm
    up before the next steps (steps of a real size); checks where held blocks are."""

    def __init__(self, cluster):
        super().__init__(cluster, at_step=4, rank=1)
        self.here = ray.get_runtime_context().get_node_id()
        self.blocks_checked, self.blocks_here, self.pids = 0, 0, set()

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)
        refs = [r for w in driver.stream.windows for r in w.refs]
        where = ray.experimental.get_object_locations(refs)
        self.blocks_checked += len(refs)
        self.blocks_here += sum(self.here in where.get(r, {}).get("node_ids", [])
                                for r in refs)
        removing = step == self.at_step and self.removed is None
        super().on_step_end(driver, step, record)
        if removing:
            self.cluster.add_node(num_cpus=NODE_CPUS)
        driver.grow_check_s = 0.0
        if driver.record.plan.world_size < 2 and driver.newcomers is not None:
            ray.wait(driver.newcomers[2], num_returns=len(driver.newcomers[2]), timeout=60)


# Blocks of a real corpus are large (up to 1 MiB) and live in the object store of the
# node whose task made them; the test's are small, and Ray would return objects under
# 100 KiB inline to the driver's process: the threshold goes down so that they too are
# stored where they are made.
cluster = start_cluster(workers=2, cpus=NODE_CPUS, max_direct_call_object_size=256)
try:
    ref_out, out = tempfile.mkdtemp() + "/ref", tempfile.mkdtemp() + "/out"
    reference = train(config(ref_out, num_workers=1, gradient_accumulation_steps=4))
    watch = Watch(cluster)
    hit = train(config(out), callbacks=(watch,))
    wait_gone(watch.pids)
    print("RESULT " + json.dumps({
        "removed": watch.removed is not None, "failures": hit.failures,
        "reference": [h["loss"] for h in reference.history],
        "reference_grad_norm": [h["grad_norm"] for h in reference.history],
        "hit": [h["loss"] for h in hit.history],
        "hit_grad_norm": [h["grad_norm"] for h in hit.history],
        "hit_steps": [h["step"] for h in hit.history],
        "world_sizes": [h["world_size"] for h in hit.history],
        "reference_ids": step_ids(ref_out), "hit_ids": step_ids(out),
        "blocks_checked": watch.blocks_checked, "blocks_here": watch.blocks_here,
        "read_here": hit.metrics.get("stream_blocks_read_here"),
        "read_there": hit.metrics.get("stream_blocks_read_there"),
        "left_running": [p for p in watch.pids if pid_alive(p)]}))
finally:
    ray.shutdown()
    cluster.shutdown()
