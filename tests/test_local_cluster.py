"""The Ray cluster raylm starts for itself (no --address): raylm's settings, and Ray
Data's idle actors stopped once the data are ready, Ray Data still working after it."""

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
    try:
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
    assert out["env_left"] == []  # the agent's variable was set for ray.init only
    assert out["first"] == [0, 2, 4, 6, 8, 10, 12, 14]
    # Ray Data started both actors; raylm stopped both, and they are gone
    assert out["stopped"] == len(out["gone"]) == 2
    # a later execution gets them again (Ray Data creates them at each use)
    assert out["again"] == [1, 2, 3, 4]
    assert out["stopped_again"] == 2 and out["stopped_none"] == 0
