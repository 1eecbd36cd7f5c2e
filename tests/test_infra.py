"""The deployable unit in infra/: every Kubernetes manifest validates against its schema (the
built-in kinds with kubernetes-validate, strict; KubeRay's RayCluster and RayJob against their
CRDs' v1 schemas vendored from kuberay v1.7.0, made strict: an unknown field is an error, as a
typo would be), every image a manifest names is built by a Dockerfile here from scripts/setup.sh,
and no secret is written in a manifest."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[1] / "infra"
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(p for p in (INFRA / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strict(schema):
    """A CRD schema in which objects with declared properties admit no others."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    return [strict(v) for v in schema] if isinstance(schema, list) else schema


def crd_validator(kind: str):
    import jsonschema

    schema = json.loads(gzip.decompress((INFRA / "k8s" / "schemas" / f"{kind.lower()}-ray.io-v1.json.gz").read_bytes()))
    return jsonschema.Draft7Validator(strict(schema))


def validate(doc: dict) -> None:
    import kubernetes_validate

    if doc["apiVersion"] == "ray.io/v1":
        errors = sorted(crd_validator(doc["kind"]).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    else:  # a kind with no schema raises SchemaNotFoundError: a failure here, not a warning
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates(path):
    for doc in docs(path):
        validate(doc)


def test_the_validation_catches_what_it_must():
    import kubernetes_validate

    serve = next(d for d in docs(INFRA / "k8s" / "serving.yaml") if d["kind"] == "StatefulSet")
    serve["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(serve)
    job = docs(INFRA / "k8s" / "rayjob.yaml")[0]
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 2  # a typo
    with pytest.raises(AssertionError, match="replica"):
        validate(job)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "x"}},
                                     K8S_VERSION, strict=True)


def images(node) -> set[str]:
    if isinstance(node, dict):
        return {v for k, v in node.items() if k == "image" and isinstance(v, str)} | \
            set().union(*(images(v) for v in node.values()))
    return set().union(*(images(v) for v in node)) if isinstance(node, list) else set()


def test_every_image_is_built_here_by_the_install_recipe():
    named = set().union(*(images(d) for p in MANIFESTS for d in docs(p)))
    assert named, "no images found"
    built = {}
    for f in (INFRA / "images").glob("*.Dockerfile"):
        built[f"flywheel/{f.name.removesuffix('.Dockerfile')}"] = f.read_text()
    for image in named:
        name, _, tag = image.partition(":")
        assert tag, f"{image}: pin a tag"
        assert name in built, f"{image} is not built by infra/images/*.Dockerfile"
        if name != "flywheel/postgres":  # the project's images come from the one install recipe
            assert "scripts/setup.sh" in built[name], name
    assert "postgresql-15" in built["flywheel/postgres"]  # Debian's package, as infra/mlflow/server.sh runs


def test_kustomization_lists_manifests_that_exist():
    k = yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())
    assert k["resources"] and all((INFRA / "k8s" / r).is_file() for r in k["resources"])


def test_no_secret_is_written_in_a_manifest():
    secretish = re.compile(r"(TOKEN|KEY|PASSWORD|SECRET)", re.I)

    def envs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "env" and isinstance(v, list):
                    yield from v
                else:
                    yield from envs(v)
        elif isinstance(node, list):
            for v in node:
                yield from envs(v)

    for p in MANIFESTS:
        for d in docs(p):
            assert d["kind"] != "Secret", f"{p.name}: a Secret's values belong to the cluster, not the repository"
            for e in envs(d):
                if secretish.search(e["name"]):
                    assert "valueFrom" in e and "value" not in e, f"{p.name}: {e['name']} written in clear"


def loop_commands():
    """Each `loop ...` command line in the manifests (container commands, the RayJob's entrypoint)."""
    out = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "command" and isinstance(v, list) and v[:1] == ["loop"]:
                    out.append(v)
                elif k == "entrypoint" and isinstance(v, str) and v.startswith("loop "):
                    out.append(v.split())
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for p in MANIFESTS:
        for d in docs(p):
            walk(d)
    return out


def test_the_manifests_loop_commands_are_valid_configs(monkeypatch):
    from loop.config import load_config

    commands = loop_commands()
    assert {c[1] for c in commands} == {"run", "serve"}
    monkeypatch.chdir(INFRA.parent)
    for c in commands:  # $(VAR) is the pod's env var, expanded by the kubelet before the command runs
        cfg = load_config(c[2], [re.sub(r"\$\((\w+)\)", r"\1-value", a) for a in c[3:]])  # a ConfigError names the key
        assert str(cfg.run_dir).startswith("/shared/")


def test_the_front_door_lists_every_replica_and_the_loop_promotes_through_it():
    """serving.yaml's front door names exactly the StatefulSet's replicas (by their stable DNS
    names, held at start, reachable while not ready), and the RayJob's loop collects through it."""
    serving = docs(INFRA / "k8s" / "serving.yaml")
    sts = next(d for d in serving if d["kind"] == "StatefulSet")
    headless = next(d for d in serving if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    door = next(d for d in serving if d["kind"] == "Deployment" and d["metadata"]["name"] == "flywheel-fleet")
    replica_cmd = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    door_cmd = door["spec"]["template"]["spec"]["containers"][0]["command"]
    urls = next(a for a in door_cmd if a.startswith("serve.replica_urls=")).split("=", 1)[1].strip("[]").split(",")
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert urls == [f"http://{name}-{i}.{svc}:8000" for i in range(sts["spec"]["replicas"])]
    assert "serve.start_held=true" in replica_cmd and headless["spec"]["publishNotReadyAddresses"] is True
    assert door["spec"]["replicas"] == 1  # the episode pins live in one process
    fleet_svc = next(d for d in serving if d["kind"] == "Service" and d["metadata"]["name"] == "flywheel-fleet")
    port = fleet_svc["spec"]["ports"][0]["port"]
    job = next(d for p in MANIFESTS for d in docs(p) if d["kind"] == "RayJob")
    assert f"collect.endpoint=http://flywheel-fleet:{port}" in job["spec"]["entrypoint"].split()
