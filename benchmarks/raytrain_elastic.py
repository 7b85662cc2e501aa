"""Ray Train v2's fault tolerance and elasticity, measured: the baseline for bench_elastic.py.

    python benchmarks/raytrain_elastic.py            # ~1.5 min: join at step 10, kill 20 steps later
    python benchmarks/raytrain_elastic.py --quick    # ~1.2 min, fewer steps

Self-contained: imports nothing from raylm. Ray Train v2 (RAY_TRAIN_V2_ENABLED=1, the
default in Ray 2.60) runs a TorchTrainer on a small GPT-2 built from config (--n_layer 8
layers x 128 wide, 2 heads, vocabulary 8192, block 64, dropout 0; 8 layers rather than
bench_elastic.py's 2 so that a step takes ~0.2 s at 3 workers here, --n_layer 2 for that
model), 4 x 64 random tokens per worker seeded by (step, rank), AdamW, DDP over gloo
(ray.train.torch.prepare_model), one torch thread per worker, ray.train.report() after
every step and a checkpoint (Checkpoint.from_directory of a temporary directory holding
model + optimizer + step, written by rank 0) every --ckpt_every steps. A (re)started
worker group resumes from ray.train.get_checkpoint(), which is how Ray Train recovers:
every failure and every resize restarts the whole group (new worker processes).

One run, on a local two-node Ray cluster (ray.cluster_utils.Cluster, both nodes on this
machine), ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}):

1. join: the head node has 2 CPUs, so training starts with 2 workers. At step --join_at
   a second node with 2 CPUs is added (4 CPUs in all, as in bench_elastic.py). Reported:
   node up -> first step at world size 3 ("join -> carrying work"), split as: until the
   controller decides to resize (from its log), until the new group is started (old
   group torn down, placement group, new actor processes, torch.distributed set up),
   until every worker has imported transformers, built the model, loaded the checkpoint
   and wrapped DDP, and the first step; and the committed steps redone (a resize is a
   restart from the latest checkpoint too). Training goes on at 2 workers meanwhile.
2. kill: --kill_after steps later, at a step half-way between two checkpoints (the
   expected loss under a failure at a random time), rank 1 is SIGKILLed by pid. Ray Train
   restarts the whole group (the freed CPU lets it come back at 3 workers). Reported:
   kill -> next committed step, the same split, committed steps redone (last step
   committed before the kill - the checkpoint's step), and as a check of the restore,
   the largest difference of rank 0's loss on the redone steps (same data, same state:
   it should be 0 or nearly).
3. steady state: median time between rank 0's reported steps at world size 2 and 3
   (checkpoint steps included in the sample; the mean is printed too).

Why a second node rather than a CPU held by a dummy actor on one node: Ray Train v2's
elastic policy sizes the group from the AutoscalingCoordinator's reservation, which is
computed from the nodes' *total* resources (ray.nodes()["Resources"]), not from what is
free. A CPU held by another actor is invisible to it: with 2 of 4 CPUs held it asks for a
3-worker placement group and waits for it (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, then
again), never starting at 2. Elasticity in Ray Train v2 follows nodes joining/leaving.

Settings that matter (all Ray's own knobs, set here and printed):
* RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (--poll_s, default here 0.1 s; Ray's default 2 s):
  the controller polls workers at this interval and takes ONE reported result per worker
  per poll, and a worker's result queue holds one, so ray.train.report() every step is
  throttled to one step per poll interval. With Ray's 2 s default this benchmark runs at
  ~2 s/step. It is also the failure detection interval.
* ScalingConfig(elastic_resize_monitor_interval_s=--monitor_s, default here 1 s; Ray's
  default 60 s): how often a running group considers resizing.
* The AutoscalingCoordinator (a detached actor from ray.data) refreshes its view of the
  cluster's nodes every 20 s (TICK_INTERVAL_S, no setting), so a joined node is seen
  0-20 s after it is up; that wait is the "detected" part of "join -> carrying work".

``--fault freeze``: rank 1 is frozen (SIGSTOP: alive, its sockets open) instead of
killed. Ray Train catches a worker that stops answering its health check after
RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (``--health_timeout_s``; Ray's default is printed),
then restarts the group from the checkpoint as for a kill.

The SIGKILL makes Ray print "(raylet) A worker died or was killed ..." once: expected.
Prints a table and one line `RESULT {json}`. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

# Ray Train v2 must be chosen before ray.train is imported (ray/train/__init__.py reads it
# at import time; v2 is the default in 2.60, set it anyway).
os.environ["RAY_TRAIN_V2_ENABLED"] = "1"


# --------------------------------------------------------------------------------------
# The training function (runs in each Ray Train worker)
# --------------------------------------------------------------------------------------

def train_loop_per_worker(cfg: dict) -> None:
    t_fn_start = time.time()  # before the imports: a new worker process pays for them
    import torch

    from raylm.compat import watch_torchvision

    watch_torchvision()  # (transformers imports torchvision where installed: raylm.compat)
    from transformers import GPT2Config, GPT2LMHeadModel

    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = cfg["run_dir"]
    pid = os.getpid()

    config = GPT2Config(n_layer=cfg["n_layer"], n_embd=128, n_head=2, n_positions=64,
                        vocab_size=cfg["vocab"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, ckpt_step = 0, None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location="cpu",
                               weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        ckpt_step = state["step"]
        start = ckpt_step + 1
    model = ray.train.torch.prepare_model(model)  # DDP (gloo on CPU) when world > 1
    group = torch.tensor([pid], dtype=torch.int64)  # the group is named by rank 0's pid
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(group, 0)
    t_ready = time.time()
    with open(os.path.join(run_dir, "pids", f"{pid}.json"), "w") as f:
        json.dump({"pid": pid, "rank": rank, "world": world, "group": int(group.item()),
                   "t_fn_start": t_fn_start, "t_ready": t_ready, "resumed_from": ckpt_step}, f)

    stop_file = os.path.join(run_dir, "stop_at")
    log = open(os.path.join(run_dir, "steps.jsonl"), "a") if rank == 0 else None
    B, T, every = cfg["batch"], 64, cfg["ckpt_every"]
    step = start
    while step < cfg["max_steps"]:
        try:  # the driver writes a stop step well ahead of the current one
            with open(stop_file) as f:
                if step >= int(f.read()):
                    break
        except (OSError, ValueError):
            pass
        t0 = time.time()
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randint(0, cfg["vocab"], (B, T), generator=g)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t_done = time.time()
        metrics = {"step": step, "time": t_done, "world_size": world, "pid": pid,
                   "loss": float(loss.item())}
        is_ckpt = (step + 1) % every == 0
        if is_ckpt:
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    inner = model.module if hasattr(model, "module") else model
                    torch.save({"model": inner.state_dict(), "optim": opt.state_dict(),
                                "step": step}, os.path.join(d, "state.pt"))
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=checkpoint)
        else:
            ray.train.report(metrics)
        t_rep = time.time()
        if log is not None:
            log.write(json.dumps({"step": step, "t": t_rep, "t_compute": t_done - t0,
                                  "t_report": t_rep - t_done, "world": world, "pid": pid,
                                  "ckpt": is_ckpt, "loss": metrics["loss"]}) + "\n")
            log.flush()
        step += 1
    if log is not None:
        log.close()


# --------------------------------------------------------------------------------------
# The driver: runs fit() in a thread, watches rank 0's step log, adds a node, kills a rank
# --------------------------------------------------------------------------------------

class Watch:
    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "steps.jsonl")
        self.pos = 0
        self.steps: list[dict] = []
        self.buf = ""

    def poll(self) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
                self.pos = f.tell()
        except OSError:
            return self.steps
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if line.strip():
                self.steps.append(json.loads(line))
        return self.steps

    def pids(self) -> list[dict]:
        out = []
        d = os.path.join(self.run_dir, "pids")
        for name in os.listdir(d):
            try:
                with open(os.path.join(d, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass  # being written
        return out

    def wait(self, cond, deadline: float, what: str):
        while time.time() < deadline:
            r = cond(self.poll())
            if r:
                return r
            time.sleep(0.02)
        print(f"[raytrain_elastic] gave up waiting for {what}", flush=True)
        return None

    def stop_at(self, step: int) -> None:
        tmp = os.path.join(self.run_dir, "stop_at.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(self.run_dir, "stop_at"))


def median_step(steps: list[dict], world: int) -> tuple[float | None, float | None, int]:
    """Median and mean gap between consecutive reported steps of one group at `world`,
    dropping each group's first 2 steps (warm-up)."""
    gaps, by_pid = [], {}
    for s in steps:
        by_pid.setdefault(s["pid"], []).append(s)
    for run in by_pid.values():
        if run[0]["world"] != world:
            continue
        for a, b in zip(run[2:], run[3:]):
            if b["step"] == a["step"] + 1:
                gaps.append(b["t"] - a["t"])
    if not gaps:
        return None, None, 0
    return statistics.median(gaps), statistics.fmean(gaps), len(gaps)


def controller_events(session_dir: str | None) -> list[tuple[float, str]]:
    """(time, message) of the Ray Train controller's log lines (best effort)."""
    out: list[tuple[float, str]] = []
    d = os.path.join(session_dir or "", "logs", "train")
    if not session_dir or not os.path.isdir(d):
        return out
    for name in os.listdir(d):
        if not name.startswith("ray-train-sys-controller"):
            continue
        with open(os.path.join(d, name), errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    out.append((rec["timestamp_ns"] / 1e9, rec.get("message", "")))
                except (ValueError, KeyError, TypeError):
                    pass
    return sorted(out)


def first_after(events: list[tuple[float, str]], t: float, prefix: str) -> float | None:
    return next((te for te, m in events if te > t and m.startswith(prefix)), None)


def recovery(kind: str, t0: float, last: dict, first: dict, decided_by: str,
             events: list[tuple[float, str]], pids: list[dict], steps: list[dict]) -> dict:
    """The split of t0 (node up / kill) -> first step of the next group."""
    grp = [p for p in pids if p["group"] == first["pid"]]
    t_fn = min(p["t_fn_start"] for p in grp)
    t_ready = max(p["t_ready"] for p in grp)
    t_dec = first_after(events, t0, decided_by)
    t_started = first_after(events, t_dec, "Started training worker group") if t_dec else None
    r = {
        f"{kind}_to_step_s": first["t"] - t0,
        f"{kind}_detect_s": (t_dec - t0) if t_dec else None,
        f"{kind}_restart_group_s": (t_started - t_dec) if t_started else None,
        f"{kind}_imports_model_ckpt_ddp_s": t_ready - (t_started or t_fn),
        f"{kind}_first_step_s": first["t"] - t_ready,
        f"{kind}_last_step_before": last["step"],
        f"{kind}_resumed_at_step": first["step"],
        f"{kind}_steps_redone": last["step"] - (first["step"] - 1),
        f"{kind}_world_after": first["world"],
        f"{kind}_resumed_from_ckpt_step": grp[0]["resumed_from"],
    }
    out = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
    # rank 0's loss on the redone steps against the first time they ran (same state, same
    # rank-0 batch: equal if the restore is right; after a resize only the first redone
    # step is comparable, later ones average gradients over a different number of workers)
    before = {s["step"]: s["loss"] for s in steps if s["pid"] == last["pid"]}
    after = {s["step"]: s["loss"] for s in steps if s["pid"] == first["pid"]}
    redo = [k for k in range(first["step"], last["step"] + 1) if k in before and k in after]
    if first["world"] != last["world"]:
        redo = redo[:1]
    if redo:
        out[f"{kind}_redone_loss_max_abs_diff"] = max(abs(before[k] - after[k]) for k in redo)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 1.5 min)")
    ap.add_argument("--join_at", type=int, default=10, help="add the second node at this step")
    ap.add_argument("--kill_after", type=int, default=20,
                    help="steps at world size 3 before the kill")
    ap.add_argument("--steady", type=int, default=40,
                    help="steps to run after the recovery before stopping")
    ap.add_argument("--ckpt_every", type=int, default=10)
    ap.add_argument("--n_layer", type=int, default=8,
                    help="GPT-2 layers (2 is bench_elastic.py's depth; 8 gives ~0.2-0.3 s "
                         "steps at 3 workers on the 2-core machine)")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 64 tokens per worker")
    ap.add_argument("--poll_s", type=float, default=0.1,
                    help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default: 2)")
    ap.add_argument("--monitor_s", type=float, default=1.0,
                    help="ScalingConfig(elastic_resize_monitor_interval_s) (Ray's default: 60)")
    ap.add_argument("--fault", choices=("kill", "freeze"), default="kill",
                    help="kill rank 1 (SIGKILL) or freeze it (SIGSTOP: alive, sockets open)")
    ap.add_argument("--health_timeout_s", type=float, default=None,
                    help="RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, what catches a frozen "
                         "worker (Ray's default is printed)")
    ap.add_argument("--timeout", type=float, default=300.0, help="give up after this long")
    ap.add_argument("--verbose", action="store_true", help="show Ray's logs")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()
    if args.quick:
        args.join_at, args.kill_after, args.steady, args.ckpt_every = 5, 10, 15, 5

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.poll_s)
    if args.health_timeout_s is not None:
        os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(args.health_timeout_s)
    import ray
    import ray.train
    from ray.cluster_utils import Cluster
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled
    from ray.train.v2.api.config import ScalingConfig as ScalingConfigV2

    assert is_v2_enabled(), "Ray Train v2 is not enabled"
    assert ScalingConfig is ScalingConfigV2, "ray.train.ScalingConfig is not v2's"

    work = tempfile.mkdtemp(prefix="raytrain-elastic-")
    run_dir = os.path.join(work, "run")
    os.makedirs(os.path.join(run_dir, "pids"))
    watch = Watch(run_dir)
    t_begin = time.time()
    deadline = t_begin + args.timeout
    res: dict = {"ray": ray.__version__, "train_v2": True, "ckpt_every": args.ckpt_every,
                 "poll_s": args.poll_s, "monitor_s": args.monitor_s,
                 "n_layer": args.n_layer, "batch_per_worker": args.batch,
                 "num_workers": [2, 3], "fault": args.fault}
    from ray.train.v2._internal import constants as train_constants

    res["worker_health_check_timeout_s"] = float(os.environ.get(
        "RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S",
        train_constants.DEFAULT_WORKER_HEALTH_CHECK_TIMEOUT_S))
    res["worker_health_check_timeout_s_default"] = \
        train_constants.DEFAULT_WORKER_HEALTH_CHECK_TIMEOUT_S
    frozen: list = []
    ev: dict = {}

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    session_dir = None
    fit_out: dict = {}
    j = r = None
    events: list[tuple[float, str]] = []
    try:
        ray.init(address=cluster.address, log_to_driver=args.verbose)
        try:
            session_dir = cluster.head_node.get_session_dir_path()
        except Exception:  # noqa: BLE001 - only used for the controller's log
            pass
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"run_dir": run_dir, "n_layer": args.n_layer, "vocab": 8192,
                               "batch": args.batch, "ckpt_every": args.ckpt_every,
                               "max_steps": 100_000},
            scaling_config=ScalingConfig(num_workers=(2, 3),
                                         resources_per_worker={"CPU": 1},
                                         elastic_resize_monitor_interval_s=args.monitor_s),
            run_config=RunConfig(name="raytrain-elastic",
                                 storage_path=os.path.join(work, "storage"),
                                 failure_config=FailureConfig(max_failures=3),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )

        def fit():
            try:
                fit_out["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - reported below
                fit_out["error"] = repr(e)

        th = threading.Thread(target=fit, daemon=True)
        th.start()

        # ---- start: 2 CPUs, so 2 workers
        first = watch.wait(lambda s: s[0] if s else None, deadline, "the first step")
        if first:
            res["startup_s"] = round(first["t"] - t_begin, 2)
            res["start_world"] = first["world"]

        # ---- 1. a node with 2 more CPUs joins
        seen = first and watch.wait(
            lambda s: s[-1] if s[-1]["step"] >= args.join_at else None, deadline,
            f"step {args.join_at}")
        if seen:
            t_add = time.time()
            cluster.add_node(num_cpus=2, wait=True)
            ev["t_up"] = t_up = time.time()
            res["add_node_s"] = round(t_up - t_add, 2)
            ev["join_first"] = watch.wait(
                lambda s: next((x for x in s if x["world"] == 3 and x["t"] > t_up), None),
                deadline, "a step at world size 3")
        j = ev.get("join_first")
        if j:
            ev["join_last"] = [s for s in watch.poll() if s["t"] < j["t"]
                               and s["pid"] != j["pid"]][-1]
            # ---- 2. kill rank 1, half-way between two checkpoints
            k = j["step"] + args.kill_after
            while (k + 1) % args.ckpt_every != (args.ckpt_every // 2) % args.ckpt_every:
                k += 1
            seen_k = watch.wait(lambda s: s[-1] if s[-1]["step"] >= k else None, deadline,
                                f"step {k}")
            if seen_k:
                victim = next(p for p in watch.pids()
                              if p["group"] == seen_k["pid"] and p["rank"] == 1)
                ev["t_kill"] = t_kill = time.time()
                if args.fault == "freeze":
                    frozen.append(victim["pid"])
                os.kill(victim["pid"], signal.SIGSTOP if args.fault == "freeze"
                        else signal.SIGKILL)
                old = seen_k["pid"]
                ev["kill_first"] = watch.wait(
                    lambda s: next((x for x in s if x["t"] > t_kill and x["pid"] != old), None),
                    deadline, "a step after the kill")
                ev["kill_last"] = [s for s in watch.poll()
                                   if s["t"] <= t_kill and s["pid"] == old][-1]
        r = ev.get("kill_first")
        if r:
            # ---- 3. steady state after the recovery
            target = r["step"] + args.steady
            watch.wait(lambda s: s[-1]["step"] >= target, deadline, f"step {target}")
        # stop a few steps ahead, whatever state the run is in
        steps = watch.poll()
        watch.stop_at((steps[-1]["step"] + 5) if steps else 0)
        th.join(timeout=max(30.0, deadline - time.time()))
        res["fit"] = ("error: " + fit_out["error"]) if "error" in fit_out else (
            "finished" if "result" in fit_out else "did not finish")
        events = controller_events(session_dir)
    finally:
        for pid in frozen:  # (nothing left stopped, whatever happened)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.shutdown()
        cluster.shutdown()

    steps, pids = watch.poll(), watch.pids()
    if j:
        res.update(recovery("join", ev["t_up"], ev["join_last"], j,
                            "Detected changes in the cluster resources", events, pids, steps))
        res["join_steps_at_2_after_node_up"] = ev["join_last"]["step"] - next(
            s["step"] for s in reversed(steps) if s["t"] <= ev["t_up"])
    if r:
        res.update(recovery("kill", ev["t_kill"], ev["kill_last"], r,
                            "[FailurePolicy] RETRY", events, pids, steps))
    for w in (2, 3):
        med, mean, n = median_step(steps, w)
        res[f"step_s_world{w}_median"] = round(med, 3) if med else None
        res[f"step_s_world{w}_mean"] = round(mean, 3) if mean else None
        res[f"step_s_world{w}_n"] = n
    body = [s for s in steps if not s["ckpt"]]
    if body:
        res["compute_s_median"] = round(statistics.median(s["t_compute"] for s in body), 3)
        res["report_call_s_median"] = round(statistics.median(s["t_report"] for s in body), 3)
    ck = [s["t_report"] for s in steps if s["ckpt"]]
    if ck:
        res["ckpt_report_call_s_median"] = round(statistics.median(ck), 3)
    res["steps_logged"] = len(steps)
    res["controller_log"] = bool(events)
    res["wall_s"] = round(time.time() - t_begin, 1)
    if args.keep:
        res["work_dir"] = work
    else:
        shutil.rmtree(work, ignore_errors=True)

    def g(key, fmt="{:.2f}"):
        v = res.get(key)
        return "n/a" if v is None else fmt.format(v)

    def split(kind):
        return (f"{g(kind + '_to_step_s')} s (detected {g(kind + '_detect_s')} s, new group "
                f"up {g(kind + '_restart_group_s')} s, imports + model + checkpoint + DDP "
                f"{g(kind + '_imports_model_ckpt_ddp_s')} s, first step "
                f"{g(kind + '_first_step_s')} s)")

    print()
    print(f"Ray Train v2 (Ray {ray.__version__}), TorchTrainer, ScalingConfig(num_workers=(2, 3)),"
          f" GPT-2 {args.n_layer} x 128, {args.batch} x 64 tokens per worker, checkpoint every "
          f"{args.ckpt_every} steps, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={args.poll_s}, "
          f"elastic_resize_monitor_interval_s={args.monitor_s}")
    print()
    print("| what | Ray Train v2 |")
    print("| --- | --- |")
    print(f"| steady-state step, median (mean) at 3 workers | "
          f"{g('step_s_world3_median', '{:.3f}')} s ({g('step_s_world3_mean', '{:.3f}')} s) |")
    print(f"| steady-state step, median (mean) at 2 workers | "
          f"{g('step_s_world2_median', '{:.3f}')} s ({g('step_s_world2_mean', '{:.3f}')} s) |")
    print(f"| of which compute / the ray.train.report call (rank 0 medians) | "
          f"{g('compute_s_median', '{:.3f}')} s / {g('report_call_s_median', '{:.3f}')} s "
          f"(with a checkpoint: {g('ckpt_report_call_s_median', '{:.3f}')} s) |")
    fault = "freeze (SIGSTOP)" if args.fault == "freeze" else "kill"
    print(f"| {fault} -> next committed step (worker health check timeout "
          f"{g('worker_health_check_timeout_s', '{:g}')} s, Ray's default "
          f"{g('worker_health_check_timeout_s_default', '{:g}')} s) | {split('kill')} |")
    print(f"| committed steps redone after the {args.fault} | {g('kill_steps_redone', '{}')} "
          f"(last step before the kill {g('kill_last_step_before', '{}')}, resumed at "
          f"{g('kill_resumed_at_step', '{}')} with {g('kill_world_after', '{}')} workers; "
          f"rank 0 loss on them vs the first time: max diff "
          f"{g('kill_redone_loss_max_abs_diff', '{:.1e}')}) |")
    print(f"| join (node up) -> carrying work at 3 workers | {split('join')} |")
    print(f"| committed steps redone by the join (a resize restarts from the checkpoint) | "
          f"{g('join_steps_redone', '{}')} (last step at 2 workers "
          f"{g('join_last_step_before', '{}')}, resumed at {g('join_resumed_at_step', '{}')}; "
          f"rank 0 loss on the first of them vs the first time: diff "
          f"{g('join_redone_loss_max_abs_diff', '{:.1e}')}) |")
    print(f"| start-up (cluster + fit() -> first step) / adding the node | {g('startup_s')} s"
          f" / {g('add_node_s')} s |")
    print(f"| fit() | {res['fit']} |")
    print()
    print("RESULT " + json.dumps(res, sort_keys=True), flush=True)


if __name__ == "__main__":
    sys.exit(main())
