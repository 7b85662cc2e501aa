"""What the two cut-off scenarios share (tests/multinode_cutoff.py: a node's processes
frozen; tests/multinode_netns.py: a node's network link down): the run, the callback
that cuts the node of the rank alone on its node after step CUT_AFTER and brings it back
after BACK_AFTER, and the result line tests/test_multinode.py checks."""

import json
import tempfile
import time

import ray

from raylm import TrainConfig, train
from multinode_common import pid_alive, samples, wait_gone

STEPS, CUT_AFTER, BACK_AFTER = 16, 4, 9
WATCH = dict(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)


def config(corpus, cache_root, out, **kw):
    base = dict(model_type="gpt2", config_overrides="n_layer=2,n_embd=32,n_head=2,"
                "n_positions=64", train_file=[corpus], block_size=32, data_cache_dir=cache_root,
                output_dir=out, max_steps=STEPS, save_steps=1000, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, num_workers=3, cpus_per_worker=1,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                do_eval=False, log_sample_ids=True, max_failures=5, **WATCH)
    base.update(kw)
    return TrainConfig(**base)


class CutOff:
    """After step CUT_AFTER, ``cut(driver, rank)`` cuts off the node of the rank alone on
    its node; training goes on and growth, looking for room at every boundary, must not
    place anything there. After BACK_AFTER, ``back()`` brings it back; then the steps
    wait for it to answer and for the newcomers to warm up."""

    def __init__(self, cut, back):
        self.cut, self.back = cut, back
        self.cut_at, self.back_at, self.past_cut_s = None, None, None
        self.cut_rank, self.cut_node = None, None
        self.newcomers_while_cut, self.unreachable_seen = [], []
        self.pids, self.digests, self.sizes = set(), None, {}

    def on_step_end(self, driver, step, record):
        self.pids.update(driver.worker_pids)
        self.sizes[step] = driver.record.plan.world_size
        driver.grow_check_s = 0.0  # look for room at every step boundary
        info = driver.worker_info
        if step == CUT_AFTER:
            [self.cut_rank] = [r for r, i in enumerate(info)
                               if sum(j["node_id"] == i["node_id"] for j in info) == 1]
            self.cut_node = info[self.cut_rank]["node_id"]
            self.cut(driver, self.cut_rank)
            self.cut_at = time.time()
        elif self.cut_at is not None and self.back_at is None:
            if self.past_cut_s is None:  # (from the cut to the end of the next step)
                self.past_cut_s = time.time() - self.cut_at
            self.newcomers_while_cut.append(driver.newcomers is not None)
            self.unreachable_seen.append(self.cut_node in driver.group.unreachable)
            time.sleep(0.3)
            if step == BACK_AFTER:
                self.back()
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


def run_and_report(corpus, cache_root, cut: CutOff) -> None:
    """A one-rank reference, then the run ``cut`` cuts; prints the RESULT line."""
    ref_out, out = tempfile.mkdtemp() + "/ref", tempfile.mkdtemp() + "/out"
    reference = train(config(corpus, cache_root, ref_out, num_workers=1,
                             gradient_accumulation_steps=6))
    hit = train(config(corpus, cache_root, out), callbacks=(cut,))
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
