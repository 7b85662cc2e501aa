"""Run by tests/test_multinode.py in its own process (one Ray connection per process).

ZeRO-1 over dp=2 keeps each rank's half of the optimizer state nowhere else, ZeRO-3 its
half of the parameters too, so losing a rank loses state that has no live copy. With
--snapshot_steps 2 every rank's state is copied to memory on its own node and on the
next one: when the node holding rank 1 is removed after step 5, the survivor is rebuilt
(re-planned to one rank) from the snapshot of step 4 in the keepers' memory; one step is
redone and nothing is read from disk (no checkpoint is written before the end). A
CPU-less head and two 1-CPU worker nodes; at ZeRO-1 and at ZeRO-3 the run that loses a
node (the node comes back between them), each held to the plain single-process loop on
the same batches. Prints one JSON line.
"""

import json
import sys
import tempfile
import time

import ray

from raylm import TrainConfig, train
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.prepare import prepare_data
from multinode_common import RemoveNodeOfRank, start_cluster
from reference import reference_run

corpus, cache_root = sys.argv[1], sys.argv[2]


def config(out, **kw):
    return TrainConfig(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                       "n_positions=64,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0",
                       train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                       output_dir=out, max_steps=8, save_steps=100, logging_steps=1,
                       disable_tqdm=True, learning_rate=1e-3, num_workers=2,
                       per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       do_eval=False, log_sample_ids=True, **{"zero_stage": 1, **kw})


cluster = start_cluster()
try:
    # The ground truth: the plain single-process loop (tests/reference.py) on the same
    # global batches.
    cfg = config(tempfile.mkdtemp() + "/out")
    inputs = check_inputs(cfg)
    data = prepare_data(cfg, inputs)
    batch = (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
             * cfg.num_workers)
    base_loss, base_grad_norm, _, _ = reference_run(cfg, inputs.spec, data.train,
                                                    data.train_ids, batch, cfg.max_steps)
    class RemoveOnceSnapshotHeld(RemoveNodeOfRank):
        """Steps of a real size: the snapshot of step 4 is in the keepers' hands (they
        take it while training goes on) by the time the node goes."""

        def on_step_end(self, driver, step, record):
            if step == self.at_step:
                time.sleep(3)
            super().on_step_end(driver, step, record)

    runs = {}
    for stage in (1, 3):
        if len(cluster.worker_nodes) < 2:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
        remover = RemoveOnceSnapshotHeld(cluster, at_step=5, rank=1)
        out = tempfile.mkdtemp() + "/out"
        hit = train(config(out, snapshot_steps=2, zero_stage=stage), callbacks=(remover,))
        with open(out + "/samples.jsonl") as f:
            samples = {}
            for r in map(json.loads, f):  # a redone step's line replaces the first
                samples[r["step"]] = sorted(i for ids in r["ranks"] for i in ids)
        runs[stage] = {
            "hit": [h["loss"] for h in hit.history],
            "hit_grad_norm": [h["grad_norm"] for h in hit.history],
            "hit_steps": [h["step"] for h in hit.history],
            "world_sizes": [h["world_size"] for h in hit.history],
            "samples": {str(k): v for k, v in samples.items()},
            "failures": hit.failures, "removed": remover.removed}
    print("RESULT " + json.dumps({"base": base_loss, "base_grad_norm": base_grad_norm,
                                  "runs": runs}))
finally:
    ray.shutdown()
    cluster.shutdown()
