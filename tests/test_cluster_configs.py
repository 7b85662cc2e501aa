"""The cluster configs in cluster/ are checked as their tools would check them: the
launcher config by Ray's own preparation and validation (what `ray up` runs before it
calls the cloud), the RayJob against KubeRay's schema, with unknown fields refused as
`kubectl apply`'s strict validation refuses them; and both run raylm with its outputs in a
bucket, no shared disk, with flags their resources can hold."""

from __future__ import annotations

import copy
import gzip
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from raylm.cli.main import _config, build_parser
from raylm.storage import is_remote

REPO = Path(__file__).resolve().parents[1]
# KubeRay's RayJob CRD, version v1's openAPIV3Schema (ray-project/kuberay,
# ray-operator/config/crd/bases/ray.io_rayjobs.yaml at feeaf72, 2026-08-19), as JSON.
RAYJOB_SCHEMA = Path(__file__).parent / "data" / "kuberay-rayjob-v1.schema.json.gz"


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused wherever the CRD lists the fields."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def _rayjob_errors(doc: dict) -> list:
    with gzip.open(RAYJOB_SCHEMA) as f:
        schema = _strict(json.load(f))
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_the_launcher_config_passes_ray_s_own_checks():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    broken = copy.deepcopy(config)
    broken["available_node_types"]["cpu_worker"]["max_worker"] = 8  # (a typo)
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))
    text = (REPO / "cluster" / "ray-cluster.yaml").read_text()
    assert "--output_dir s3://" in text and "NFS" not in text


def test_the_rayjob_passes_kuberay_s_schema_and_its_flags_fit_its_pods():
    doc = yaml.safe_load((REPO / "cluster" / "kuberay-rayjob.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    assert _rayjob_errors(doc) == []
    typo = copy.deepcopy(doc)
    typo["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 8
    assert any("maxReplica" in e for e in _rayjob_errors(typo))

    import ray

    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/train.py"] and (REPO / argv[1]).is_file()
    cfg = _config(build_parser().parse_args(["train", *argv[2:]]))
    assert all(is_remote(p) for p in (cfg.output_dir, cfg.data_cache_dir, *cfg.train_file))
    assert "volumes" not in json.dumps(doc)  # (no shared disk)

    workers = cluster["workerGroupSpecs"][0]
    pod_cpus = _cpus(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    per_pod = int(pod_cpus // cfg.cpus_per_worker)
    assert (cfg.tp or 1) <= per_pod  # a tensor-parallel group stays on one node
    assert cfg.num_workers <= per_pod * workers["replicas"]
    assert cfg.min_workers <= per_pod * workers["minReplicas"]
    assert cfg.max_workers == per_pod * workers["maxReplicas"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # (no rank there)
