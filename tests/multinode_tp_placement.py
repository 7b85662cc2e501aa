"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

A ray.cluster_utils.Cluster with a CPU-less head and two worker nodes of 3 CPUs. A
dp=2 x tp=2 run of 4 one-CPU ranks: each tensor-parallel group (ranks 0-1, ranks 2-3)
must sit on one node. Per-rank bundles packed onto the nodes would put ranks 0-2 on the
first node and split the second tp group; one bundle per tp group cannot. Prints one
JSON line with the node of every rank.
"""

import json
import logging
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster

from raylm import TrainConfig, train

corpus, cache_root = sys.argv[1], sys.argv[2]


class Nodes:
    def __init__(self):
        self.nodes = None

    def on_step_end(self, driver, step, record):
        self.nodes = [i["node_id"] for i in driver.worker_info]


logging.basicConfig(level=logging.INFO, format="raylm %(message)s")
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0,
                                                        "include_dashboard": False})
for _ in range(2):
    cluster.add_node(num_cpus=3)
ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
try:
    seen = Nodes()
    with tempfile.TemporaryDirectory() as out:
        result = train(TrainConfig(
            model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
            "n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
            train_file=[corpus], block_size=32, data_cache_dir=cache_root, output_dir=out,
            max_steps=2, logging_steps=1, disable_tqdm=True, do_eval=False, dp=2, tp=2,
            num_workers=4, per_device_train_batch_size=2), callbacks=(seen,))
    print("RESULT " + json.dumps({"nodes": seen.nodes, "steps": len(result.history)}),
          flush=True)
finally:
    ray.shutdown()
    cluster.shutdown()
