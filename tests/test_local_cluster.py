"""The Ray cluster raylm starts for itself (no --address): raylm's settings (huge pages
for its workers' allocations, --huge_pages), and Ray Data's idle actors stopped once the
data are ready, Ray Data still working after it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO

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
