"""The deploy/ files: Kubernetes manifests validated offline against their schemas, light checks of
the Dockerfiles, and the facts the README promises (only the API port is exposed, tokens are on).

Core kinds are validated with `kubernetes-validate` (the Kubernetes OpenAPI schemas as JSON
schemas, strict: unknown fields fail). RayCluster and RayJob are validated against KubeRay's CRD
schemas vendored in tests/schemas/kuberay (see the README there), made strict the same way: the API
server rejects unknown fields of a custom resource under `kubectl apply`'s default strict field
validation, so a misspelt field must fail here too.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from controller.run_spec import load_spec
from schema.job import JobSpec

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas" / "kuberay"
KUBERNETES_VERSION = "1.33"
RAY_PORTS = {6379, 8265, 10001}
CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): "raycluster-v1.json", ("ray.io/v1", "RayJob"): "rayjob-v1.json"}
KUSTOMIZE_KINDS = {("kustomize.config.k8s.io/v1beta1", "Kustomization")}


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file#index, document) for every YAML document under deploy/k8s."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                docs.append((f"{path.relative_to(K8S)}#{i}", doc))
    return docs


DOCS = documents()
CRD_DOCS = [(n, d) for n, d in DOCS if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
CORE_DOCS = [
    (n, d) for n, d in DOCS if (d["apiVersion"], d["kind"]) not in CRD_SCHEMAS.keys() | KUSTOMIZE_KINDS
]


def of_kind(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name, doc in DOCS if doc["kind"] == kind]


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields forbidden wherever it lists the fields of an object."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            if not out.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@cache
def crd_validator(filename: str) -> jsonschema.protocols.Validator:
    schema = strict(json.loads((SCHEMAS / filename).read_text()))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    validator = crd_validator(CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])])
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_every_manifest_parses_and_has_a_known_kind():
    assert {name.split("#")[0] for name, _ in DOCS} >= {
        "kustomization.yaml",
        "raycluster.yaml",
        "service.yaml",
        "pvc.yaml",
        "secrets.example.yaml",
        "rayjob/rayjob.yaml",
        "rayjob/job-spec.yaml",
    }
    for name, doc in DOCS:
        assert {"apiVersion", "kind"} <= doc.keys(), name
        if (doc["apiVersion"], doc["kind"]) not in KUSTOMIZE_KINDS:
            assert doc["metadata"]["name"], name


@pytest.mark.parametrize("name,doc", CORE_DOCS, ids=[n for n, _ in CORE_DOCS])
def test_core_kinds_match_the_kubernetes_schemas(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", CRD_DOCS, ids=[n for n, _ in CRD_DOCS])
def test_kuberay_resources_match_the_crd_schemas(name, doc):
    assert crd_errors(doc) == [], name


def test_crd_validation_catches_a_misspelt_field():
    _, cluster = of_kind("RayCluster")[0]
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    bad["spec"]["authOptions"]["mode"] = "tokens"
    errors = crd_errors(bad)
    assert any("maxReplica" in e for e in errors), errors
    assert any(e.startswith("spec.authOptions.mode") for e in errors), errors


def test_core_validation_catches_a_misspelt_field():
    _, service = of_kind("Service")[0]
    bad = copy.deepcopy(service)
    bad["spec"]["ports"][0]["targetport"] = "api"
    with pytest.raises(kubernetes_validate.ValidationError, match="targetport"):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_kustomizations_list_existing_files():
    for name, doc in DOCS:
        if doc["kind"] != "Kustomization":
            continue
        folder = (K8S / name.split("#")[0]).parent
        for resource in doc["resources"]:
            assert (folder / resource).is_file(), f"{name} lists a missing file {resource}"


# ---- what the deployment promises ---------------------------------------------------------------


def head_pod(cluster_spec: dict[str, Any]) -> dict[str, Any]:
    return cluster_spec["headGroupSpec"]["template"]["spec"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def test_services_expose_only_the_api_port():
    services = of_kind("Service")
    assert [doc["metadata"]["name"] for _, doc in services] == ["tandem-api"]
    for _, svc in services:
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
        ports = [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]]
        assert ports == [("api", 8000, "api")]
        assert svc["spec"]["selector"] == {"ray.io/cluster": "tandem", "ray.io/node-type": "head"}
    for _, ingress in of_kind("Ingress"):
        backends = [p["backend"]["service"] for r in ingress["spec"]["rules"] for p in r["http"]["paths"]]
        assert backends == [{"name": "tandem-api", "port": {"name": "api"}}]
        assert ingress["spec"]["tls"], "the ingress terminates TLS"


def test_ray_ports_stay_inside_the_cluster():
    for _, doc in of_kind("RayCluster") + of_kind("RayJob"):
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
        assert not spec["headGroupSpec"].get("enableIngress", False)
    for _, policy in of_kind("NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule.get("ports", [])}
            if "from" not in rule:  # open to anyone: only the API
                assert ports == {8000}
            assert not (ports & RAY_PORTS) or rule["from"], rule


def test_head_pod_runs_the_api_with_probes_tokens_and_a_persistent_home():
    _, cluster = of_kind("RayCluster")[0]
    pod = head_pod(cluster["spec"])
    assert pod["containers"][0]["name"] == "ray-head"  # KubeRay starts Ray in the first container
    api = container(pod, "tandem-api")
    script = "\n".join(api["command"] + api["args"])
    assert re.search(r"tandem serve .*--ray-address auto", script)
    assert "--host 0.0.0.0" in script
    assert api["ports"] == [{"name": "api", "containerPort": 8000, "protocol": "TCP"}]
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "api"}
    assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "api"}
    env = {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"] for e in api["env"]}
    assert env["TANDEM_ADMIN_TOKEN"] == {"name": "tandem-api-token", "key": "admin-token"}
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN"] == {"name": "tandem-ray-token", "key": "auth_token"}
    home = env["TANDEM_HOME"]
    mounts = {m["mountPath"]: m for m in api["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[home]["name"]]["persistentVolumeClaim"]["claimName"] == "tandem-home"
    assert volumes[mounts[f"{home}/jobs"]["name"]]["persistentVolumeClaim"]["claimName"] == "tandem-shared"
    # The API joins the head as a driver: both see the same /tmp/ray (sockets, session, address).
    assert mounts["/tmp/ray"]["name"] == next(
        m["name"] for m in container(pod, "ray-head")["volumeMounts"] if m["mountPath"] == "/tmp/ray"
    )
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_ray_token_auth_uses_the_secret_everywhere():
    secrets = {doc["metadata"]["name"]: doc for _, doc in of_kind("Secret")}
    assert "auth_token" in secrets["tandem-ray-token"]["stringData"]
    assert "admin-token" in secrets["tandem-api-token"]["stringData"]
    for _, doc in of_kind("RayCluster") + of_kind("RayJob"):
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert spec["authOptions"] == {"mode": "token", "secretName": "tandem-ray-token"}


def test_gpu_workers_autoscale_within_bounds_and_share_the_job_folders():
    _, cluster = of_kind("RayCluster")[0]
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    shared = {m["mountPath"] for m in worker["volumeMounts"]}
    assert {"/var/lib/tandem/jobs", "/var/lib/tandem/models"} <= shared
    claims = {
        pvc["metadata"]["name"]: pvc["spec"]["accessModes"] for _, pvc in of_kind("PersistentVolumeClaim")
    }
    assert claims == {"tandem-home": ["ReadWriteOnce"], "tandem-shared": ["ReadWriteMany"]}


def test_rayjob_runs_the_spec_from_its_configmap(tmp_path):
    _, job = of_kind("RayJob")[0]
    configmaps = {doc["metadata"]["name"]: doc for _, doc in of_kind("ConfigMap")}
    pod = head_pod(job["spec"]["rayClusterSpec"])
    mounts = {m["name"]: m["mountPath"] for m in container(pod, "ray-head")["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    configmap = configmaps[volume["configMap"]["name"]]
    (key,) = configmap["data"]
    assert job["spec"]["entrypoint"].split()[:4] == [
        "python",
        "-m",
        "controller.run_spec",
        f"{mounts[volume['name']]}/{key}",
    ]
    spec_file = tmp_path / key
    spec_file.write_text(configmap["data"][key])
    spec = load_spec(spec_file)
    assert isinstance(spec, JobSpec) and spec.resources.workers == 2


# ---- Dockerfiles --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_serve_the_api_as_a_non_root_user(name):
    text = (DEPLOY / name).read_text()
    assert 'CMD ["tandem", "serve", "--host", "0.0.0.0"]' in text
    assert re.search(r"^HEALTHCHECK .*\n?.*http://127\.0\.0\.1:8000/healthz", text, re.MULTILINE)
    assert re.search(r"^USER tandem$", text, re.MULTILINE)
    assert re.search(r"^VOLUME \[\"/var/lib/tandem\"\]$", text, re.MULTILINE)
    assert "TANDEM_HOME=/var/lib/tandem" in text
    assert "torch==2.13.0" in text
    # BuildKit reads <Dockerfile>.dockerignore: everything out of the context but the package.
    lines = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    ignore = [line for line in lines if line and not line.startswith("#")]
    assert ignore[0] == "**"
    assert {"!pyproject.toml", "!api", "!controller", "!workers", "!engines"} <= set(ignore)


def test_gpu_image_is_cuda_with_the_gpu_extras_and_cpu_image_uses_the_cpu_index():
    gpu, cpu = (DEPLOY / "Dockerfile").read_text(), (DEPLOY / "Dockerfile.cpu").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+-runtime-", gpu, re.MULTILINE)
    assert '".[gpu,sglang]"' in gpu
    assert re.search(r"^FROM python:3\.\d+-slim", cpu, re.MULTILINE)
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"^RUN pip install \.", cpu, re.MULTILINE)
