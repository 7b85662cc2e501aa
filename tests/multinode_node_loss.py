"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

A ray.cluster_utils.Cluster with a CPU-less head and two 1-CPU worker nodes. One
uninterrupted 2-rank run, then the same run during which the node holding rank 1 is
removed: the driver must re-plan onto the surviving node (1 rank, same global batch) and
finish with the same losses. Prints one JSON line with what the test checks.
"""

import json
import sys
import tempfile

import ray

from raylm import TrainConfig, train
from multinode_common import RemoveNodeOfRank, start_cluster

corpus, cache_root = sys.argv[1], sys.argv[2]


def config(out):
    return TrainConfig(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                       "n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
                       train_file=[corpus], block_size=32,
                       cache_dir=cache_root, output_dir=out, max_steps=12, save_steps=4,
                       logging_steps=1, disable_tqdm=True, learning_rate=1e-3,
                       num_workers=2, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, do_eval=False)


cluster = start_cluster()
try:
    base = train(config(tempfile.mkdtemp() + "/out"))
    remover = RemoveNodeOfRank(cluster, at_step=6, rank=1)
    hit = train(config(tempfile.mkdtemp() + "/out"), callbacks=(remover,))
    print("RESULT " + json.dumps({
        "base": [h["loss"] for h in base.history],
        "hit": [h["loss"] for h in hit.history],
        "hit_steps": [h["step"] for h in hit.history],
        "failures": hit.failures, "removed": remover.removed,
        "world_size_after": hit.metrics["world_size"],
        "rank_exit_s": remover.rank_exit_s}))
finally:
    ray.shutdown()
    cluster.shutdown()
