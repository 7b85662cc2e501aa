"""Run by tests/test_autoscaler.py against the fake autoscaling cluster it started.

The head has room for one rank. First a reference run on one rank (no request, so no
node is launched); then the run with --num_workers 1 --max_workers 3: it starts on one rank and asks the
autoscaler for three ranks' bundles; the autoscaler launches two 1-CPU nodes; raylm sees
the room, starts two newcomers that warm up while it trains, and grows to three ranks at
a step boundary. Steps are paced (0.5 s, and from step 5 on until the nodes are up) until
then, as steps of a real model would be.
After the run (the request withdrawn, the actors gone) the nodes go idle and the
autoscaler removes them. Prints one JSON line.
"""

import json
import logging
import sys
import time

import ray

from raylm import TrainConfig, train

address, corpus, cache_root, out = sys.argv[1:5]


def alive_nodes() -> list:
    return [n for n in ray.nodes() if n["Alive"]]


class Pace:
    def __init__(self):
        self.t0 = time.time()
        self.first_nodes_s = None

    def on_step_end(self, driver, step, record):
        driver.grow_check_s = 0.5
        if self.first_nodes_s is None and len(alive_nodes()) > 1:
            self.first_nodes_s = time.time() - self.t0
        if driver.record.plan.world_size < 3:
            # Steps of a real size: the autoscaler launches nodes meanwhile, and the
            # newcomers warm up, joining at the next boundary once they have. Launches
            # take ~10-13 s here but a minute or more on a loaded machine: from step 5 on
            # the run waits for the nodes (up to 4 minutes) rather than ending first.
            if driver.newcomers is not None:
                warm = driver.newcomers[2]
                ray.wait(warm, num_returns=len(warm), timeout=60)
            else:
                time.sleep(0.5)
                while step >= 5 and len(alive_nodes()) < 3 and time.time() - self.t0 < 240:
                    time.sleep(1.0)


logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
ray.init(address=address, logging_level="WARNING", log_to_driver=False)


def config(out, **kw):
    return TrainConfig(
        model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,n_positions=64,"
        "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0", train_file=[corpus],
        block_size=32, data_cache_dir=cache_root, output_dir=out, max_steps=50, save_steps=1000,
        logging_steps=10, disable_tqdm=True, learning_rate=1e-3, cpus_per_worker=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=6, do_eval=False, **kw)


# Single-process training on the head, for reference (no request: no node launched).
reference = train(config(out + "-reference", num_workers=1))
pace = Pace()
# It starts on one rank (--num_workers 1) whatever is up: a node the autoscaler launched
# for Ray Data's tokenizing may still be up when the run plans, and a start on 2 ranks
# would set a global batch of 24 against the reference's 12.
result = train(config(out, num_workers=1, max_workers=3), callbacks=(pace,))
t_end = time.time()
nodes_after = None
while time.time() - t_end < 150:
    alive = len([n for n in ray.nodes() if n["Alive"]])
    if alive == 1:
        nodes_after = time.time() - t_end
        break
    time.sleep(1)
print("RESULT " + json.dumps({
    "world_sizes": [h["world_size"] for h in result.history],
    "losses": [h["loss"] for h in result.history],
    "reference": [h["loss"] for h in reference.history],
    "first_nodes_s": pace.first_nodes_s, "nodes_removed_after_s": nodes_after,
    "alive_at_end": len([n for n in ray.nodes() if n["Alive"]])}))
ray.shutdown()
