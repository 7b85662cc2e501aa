"""The Ray cluster raylm starts for itself (no --address): raylm's settings (huge pages
for its workers' allocations, --huge_pages), Ray Data's idle actors stopped once the
data are ready, Ray Data still working after it, and its start on a thread of its own
while the driver checks its inputs (EarlyStart)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, SHAKESPEARE, TINY_GPT2

pytestmark = pytest.mark.slow  # (the tiers: docs/development.md)

# Its own process: the test session's Ray cluster is already up in this one.
SCRIPT = textwrap.dedent("""
    import json, os
    import raylm
    import ray
    from raylm.runtime import cluster

    assert cluster.connect(None)  # starts a cluster (True: the caller owns it)
    out = {"env_left": [k for k in cluster.LOCAL_ENV if k in os.environ]}

    @ray.remote(num_cpus=0)
    class Probe:
        def pages(self):
            import ctypes
            n = 64 * 2**20  # 64 MiB from malloc, written (numpy would advise on its own)
            buf = (ctypes.c_char * n).from_buffer(bytearray(n))
            ctypes.memset(ctypes.addressof(buf), 1, n)
            with open("/proc/self/smaps_rollup") as f:
                huge = [int(x.split()[1]) for x in f if x.startswith("AnonHugePages")][0]
            return os.environ.get("GLIBC_TUNABLES"), huge, buf[n - 1][0]

    try:
        out["rank_env"] = [cluster.rank_runtime_env(True), cluster.rank_runtime_env(False)]
        out["pages"] = [ray.get(Probe.options(**({"runtime_env": env} if env else {}))
                                .remote().pages.remote()) for env in out["rank_env"]]
        out["first"] = sorted(ray.data.range(8).map(lambda r: {"x": r["id"] * 2})
                              .to_pandas()["x"].tolist())
        out["stopped"] = cluster.stop_ray_data_actors()
        gone = []
        for name, namespace in cluster.RAY_DATA_ACTORS:
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                gone.append(name)
        out["gone"] = gone
        out["again"] = sorted(ray.data.range(4).map(lambda r: {"x": r["id"] + 1})
                              .to_pandas()["x"].tolist())
        out["stopped_again"] = cluster.stop_ray_data_actors()
        out["stopped_none"] = cluster.stop_ray_data_actors()
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(out))
""")


def test_own_cluster_stops_ray_datas_idle_actors_and_ray_data_still_runs():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(line[-1][len("RESULT "):])
    assert "Token authentication is enabled" not in proc.stderr  # (Ray's default, untold)
    assert out["env_left"] == []  # the variables were set for ray.init only
    # --huge_pages: the cluster's workers start with glibc's tunable; a rank without it
    # gets a runtime_env that clears it
    assert out["rank_env"] == [None, {"env_vars": {"GLIBC_TUNABLES": ""}}]
    (tun_on, huge_on, _), (tun_off, huge_off, _) = out["pages"]
    assert tun_on == "glibc.malloc.hugetlb=1" and tun_off == ""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[madvise]" in mode:  # (the kernel's THP mode decides what the advice does)
        assert huge_on >= 2048 and huge_off == 0, (huge_on, huge_off)
    assert out["first"] == [0, 2, 4, 6, 8, 10, 12, 14]
    # Ray Data started both actors; raylm stopped both, and they are gone
    assert out["stopped"] == len(out["gone"]) == 2
    # a later execution gets them again (Ray Data creates them at each use)
    assert out["again"] == [1, 2, 3, 4]
    assert out["stopped_again"] == 2 and out["stopped_none"] == 0


# Its own process too, with no Ray running: train() starts the run's cluster itself.
EARLY = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import psutil
    import raylm
    import ray
    from raylm import ConfigError, TrainConfig, train
    from raylm.runtime import cluster

    def children():
        return sorted(p.name() for p in psutil.Process().children(recursive=True)
                      if p.status() != psutil.STATUS_ZOMBIE)

    out = {}
    # The schedule's check is the last of the inputs' checks: Ray's start has begun.
    cfg = TrainConfig(model_type="gpt2", config_overrides=sys.argv[2],
                      train_file=[sys.argv[1]], block_size=32, max_steps=2,
                      output_dir=tempfile.mkdtemp(), overwrite_output_dir=True,
                      lr_scheduler_type="cosine_with_restarts",
                      lr_scheduler_kwargs='{"bogus": 2}')
    try:
        train(cfg)
    except ConfigError as e:
        out["error"] = str(e)
    out["after_error"] = [ray.is_initialized(), children()]
    sys.stderr.write("PART 2\\n")
    start = cluster.EarlyStart(num_cpus=1)
    start.join()
    time.sleep(1.5)  # (its thread looks every 0.5 s whether the cluster is still up)
    out["task_pid"] = ray.get(ray.remote(num_cpus=0)(lambda: os.getpid()).remote(),
                              timeout=60)
    out["own_pid"] = os.getpid()
    cluster_pids = [p.pid for p in psutil.Process().children(recursive=True)]
    start.shutdown()
    time.sleep(1)
    out["at_end"] = [start.thread.is_alive(), children()]
    # (reparented ones too: a raylet killed before it stops its agents leaves them)
    out["left"] = [p for p in cluster_pids
                   if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    print("RESULT " + json.dumps(out))
""")


def test_a_cluster_started_while_the_inputs_are_checked():
    """An input error found once the run's own cluster is starting (the schedule's
    check, the last) is the only thing said: the cluster is stopped and its processes
    gone, its start's log lines dropped. A cluster started so outlives its starter's
    return: Ray fate-shares its processes with the thread that started them, which
    must live while the cluster does (a task still runs on it seconds later)."""
    play = str(SHAKESPEARE / "alls_well_that_ends_well.txt")
    proc = subprocess.run([sys.executable, "-c", EARLY, play, TINY_GPT2], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(line[-1][len("RESULT "):])
    assert out["error"].startswith("--lr_scheduler_kwargs {\"bogus\": 2} does not suit "
                                   "--lr_scheduler_type cosine_with_restarts")
    assert out["after_error"] == [False, []]  # Ray down, none of its processes left
    first = proc.stderr.split("PART 2")[0]
    assert "WARNING" not in first and "Token authentication" not in first, first
    assert out["task_pid"] != out["own_pid"]
    assert out["at_end"] == [False, []] and out["left"] == []
