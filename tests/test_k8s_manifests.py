"""deploy/k8s and the Dockerfile stay consistent with the code: every YAML
parses and validates against the Kubernetes schemas (kubernetes-validate, offline;
KEDA's ScaledObject against tests/schemas), both kustomizations (HPA fallback and
KEDA) hold every worker Deployment with exactly one autoscaler, commands name
real modules, CLI commands and queues, the ConfigMap's gateway.toml and the
Secret's GATEWAY_POOLS_JSON load with load_settings, every reference
(ConfigMap/Secret keys, Services, HPA, ScaledObjects, PDBs) resolves, and the
KEDA queries name metrics the exporter really serves."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import pytest

yaml = pytest.importorskip("yaml")

from gateway_tasks.rest import cli as api_module  # noqa: E402
from beat.app import make_beat_app  # noqa: E402
from gateway_tasks.cli.main import build_parser  # noqa: E402
from gateway_tasks.core.settings import Settings, load_settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "gateway"
WORKLOADS = ("Deployment", "StatefulSet")


def all_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((str(path.relative_to(K8S)), doc))
    return out


DOCS = all_docs()


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d.get("kind") == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for kind in WORKLOADS:
        for workload in of_kind(kind):
            for c in workload["spec"]["template"]["spec"]["containers"]:
                yield workload, c


def gateway_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload, c in containers():
        if c.get("command", [""])[0] in ("celery", "gateway"):
            yield workload, c


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def arg_after(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def configmap() -> dict[str, Any]:
    return one("ConfigMap", "gateway-config")


@pytest.fixture(scope="module")
def secret() -> dict[str, Any]:
    return one("Secret", "gateway-upstream")


@pytest.fixture(scope="module")
def toml_path(configmap, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("k8s") / "gateway.toml"
    path.write_text(configmap["data"]["gateway.toml"])
    return str(path)


@pytest.fixture(scope="module")
def cm_settings(toml_path) -> Settings:
    return load_settings(env={"GATEWAY_CONFIG": toml_path})


# -- shape ---------------------------------------------------------------------------
def test_every_yaml_parses_into_named_objects():
    assert DOCS, "no manifests found"
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Namespace", "ConfigMap", "Secret", "StatefulSet", "Deployment", "Service",
            "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "ScaledObject"} <= kinds
    for filename, doc in DOCS:
        assert doc.get("apiVersion") and doc.get("kind"), filename
        if doc["kind"] == "Kustomization":
            continue
        assert doc["metadata"]["name"], filename
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, (filename, doc["metadata"])
    assert one("Namespace", NAMESPACE)


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIR` renders, for these plain kustomizations (resources only)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "resources"}, f"{directory}: only resources are used"
    out: list[dict[str, Any]] = []
    for res in kust["resources"]:
        target = (directory / res).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml names {res}, which does not exist"
        if target.is_dir():
            out += _kustomize(target)
        else:
            out += [d for d in yaml.safe_load_all(target.read_text()) if d is not None]
    return out


def _listed_files(directory: Path) -> set[Path]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return {(directory / r).resolve() for r in kust["resources"] if not (directory / r).is_dir()}


VARIANTS = {"hpa": K8S, "keda": K8S / "keda"}


def test_every_manifest_is_in_one_kustomization_and_both_variants_are_complete():
    dirs = [p.parent for p in K8S.rglob("kustomization.yaml")]
    listed = [f for d in dirs for f in _listed_files(d)]
    files = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert sorted(listed) == sorted(files), "every manifest listed exactly once"
    for variant, directory in VARIANTS.items():
        docs = _kustomize(directory)
        names = [(d["kind"], d["metadata"]["name"]) for d in docs]
        assert len(names) == len(set(names)), (variant, names)
        workers = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"].startswith("gateway-worker-")]
        assert sorted(workers) == sorted(f"gateway-worker-{t.name}" for t in Settings().tiers)
        scalers = [d["spec"]["scaleTargetRef"]["name"] for d in docs
                   if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
        assert sorted(scalers) == sorted(workers), f"{variant}: one autoscaler per worker Deployment"
        kinds = {d["kind"] for d in docs}
        assert ("ScaledObject" in kinds) == (variant == "keda")
        assert ("HorizontalPodAutoscaler" in kinds) == (variant == "hpa")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kubectl_kustomize_renders_what_the_tests_check(variant):
    out = subprocess.run(["kubectl", "kustomize", str(VARIANTS[variant])], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d)
    assert rendered == sorted((d["kind"], d["metadata"]["name"]) for d in _kustomize(VARIANTS[variant]))


# -- schemas -------------------------------------------------------------------------
K8S_VERSIONS = ("1.30.0", "1.33.0")          # the oldest and a recent supported minor
SCALEDOBJECT_SCHEMA = ROOT / "tests" / "schemas" / "keda-scaledobject-v1alpha1.json"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_builtin_manifest_validates_against_the_kubernetes_schema(version):
    kv = pytest.importorskip("kubernetes_validate")
    checked = 0
    for filename, doc in DOCS:
        if doc["kind"] in ("Kustomization", "ScaledObject"):
            continue
        try:
            kv.validate(doc, version, strict=True)       # strict: unknown fields fail too
        except kv.ValidationError as exc:
            pytest.fail(f"{filename} {doc['kind']} {doc['metadata']['name']}: {exc}")
        checked += 1
    assert checked >= 20


def test_the_schema_check_catches_a_wrong_field():
    kv = pytest.importorskip("kubernetes_validate")
    bad = json.loads(json.dumps(one("Deployment", "gateway-worker-vip")))
    bad["spec"]["replica"] = 3
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[0], strict=True)


def test_scaled_objects_validate_against_the_keda_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCALEDOBJECT_SCHEMA.read_text())
    objs = of_kind("ScaledObject")
    assert len(objs) == len(Settings().tiers)
    for obj in objs:
        jsonschema.validate(obj, schema)
    bad = json.loads(json.dumps(objs[0]))
    bad["spec"]["minReplicas"] = 1                  # the HPA's spelling, not KEDA's
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_scaled_objects_scale_each_tier_on_served_metrics(r, settings):
    from prometheus_client.parser import text_string_to_metric_families
    from gateway_tasks.metrics.exporter import render

    served = {f.name for f in text_string_to_metric_families(render(r, settings).decode())}
    for obj in of_kind("ScaledObject"):
        spec = obj["spec"]
        tier = obj["metadata"]["labels"]["gateway-tasks/tier"]
        assert spec["scaleTargetRef"]["name"] == f"gateway-worker-{tier}"
        target = one("Deployment", f"gateway-worker-{tier}")
        assert arg_after(target["spec"]["template"]["spec"]["containers"][0]["command"], "-Q") == \
            f"gt.{tier}.default"
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]     # a warm pool
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] < \
            behavior["scaleDown"]["stabilizationWindowSeconds"]             # up fast, down slow
        names = {t["name"] for t in spec["triggers"]}
        assert {"backlog-tokens", "backlog-requests", "cron-forecast"} <= names
        for trig in spec["triggers"]:
            assert trig["type"] == "prometheus"
            query = trig["metadata"]["query"]
            metrics = set(re.findall(r"(gateway_[a-z_]+)\{", query))
            assert metrics and metrics <= served, (query, served)
            assert f'tier="{tier}"' in query
            assert float(trig["metadata"]["threshold"]) > 0


def _cluster_reachable() -> bool:
    if shutil.which("kubectl") is None:
        return False
    probe = subprocess.run(["kubectl", "version", "--request-timeout=3s"], capture_output=True,
                           text=True, timeout=20)
    return probe.returncode == 0


@pytest.mark.skipif(not _cluster_reachable(), reason="no Kubernetes API server reachable for a dry run")
def test_server_dry_run_accepts_the_fallback_variant():
    out = subprocess.run(["kubectl", "apply", "--dry-run=server", "-k", str(K8S)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# -- settings ------------------------------------------------------------------------
def test_configmap_toml_loads_with_load_settings(cm_settings, configmap):
    default = Settings()
    assert [t.name for t in cm_settings.tiers] == [t.name for t in default.tiers]
    assert cm_settings.queue_names() == default.queue_names()
    # the file mirrors the documented defaults of every tier
    assert cm_settings.tiers == default.tiers
    raw = tomllib.loads(configmap["data"]["gateway.toml"])
    assert {"policy", "key_prefix", "tiers", "pools"} <= set(raw)


def test_secret_pools_json_replaces_the_configmap_pools_consistently(toml_path, cm_settings, secret):
    pools_json = secret["stringData"]["GATEWAY_POOLS_JSON"]
    json.loads(pools_json)
    s = load_settings(env={"GATEWAY_CONFIG": toml_path, "GATEWAY_POOLS_JSON": pools_json})
    assert [(p.name, p.models, p.tpm, p.rpm) for p in s.pools] == \
        [(p.name, p.models, p.tpm, p.rpm) for p in cm_settings.pools]
    assert s.queue_names() == cm_settings.queue_names()


def test_redis_url_points_at_the_redis_service(configmap):
    url = urlparse(configmap["data"]["REDIS_URL"])
    assert url.scheme == "redis" and url.port == 6379
    service, namespace = url.hostname.split(".")[:2]
    assert namespace == NAMESPACE
    svc = one("Service", service)
    redis_set = one("StatefulSet", "redis")
    assert redis_set["spec"]["replicas"] == 1 and redis_set["spec"]["serviceName"] == service
    assert svc["spec"]["clusterIP"] == "None"


# -- commands ------------------------------------------------------------------------
def test_celery_commands_name_real_modules_and_queues(cm_settings):
    default_queues = set(Settings().queue_names())
    seen = set()
    for workload, c in gateway_containers():
        argv = c["command"]
        if argv[0] != "celery":
            continue
        app_module = arg_after(argv, "-A")
        assert importlib.util.find_spec(app_module) is not None, app_module
        assert argv[3] in ("worker", "beat", "flower"), argv
        seen.add(argv[3])
        if argv[3] == "worker":
            queues = arg_after(argv, "-Q").split(",")
            assert queues and set(queues) <= default_queues, queues
            assert set(queues) <= set(cm_settings.queue_names())
            assert arg_after(argv, "-P") == "threads" and "-E" in argv
            # acks_late: the grace period must cover the longest upstream call
            grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace > max(p.timeout_s for p in cm_settings.pools)
            probe = " ".join(c["readinessProbe"]["exec"]["command"])
            assert "inspect ping" in probe and app_module in probe
        if argv[3] == "beat":
            # the beat app names the tenant cron scheduler itself
            assert app_module == "beat.app"
            scheduler = make_beat_app(cm_settings, "redis://x").conf.beat_scheduler
            module, _, cls = scheduler.partition(":")
            assert hasattr(importlib.import_module(module), cls)
            assert workload["spec"]["replicas"] == 2
    assert seen == {"worker", "beat", "flower"}


def test_gateway_commands_parse_with_the_cli():
    parser = build_parser()
    found = 0
    for _, c in gateway_containers():
        if c["command"][0] != "gateway":
            continue
        found += 1
        args = parser.parse_args(c["command"][1:])
        assert args.func is api_module._run and args.host == "0.0.0.0"
        ports = {p["containerPort"] for p in c["ports"]}
        assert args.port in ports
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert found == 1


def test_every_gateway_container_gets_config_redis_and_keys(configmap, secret):
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in of_kind("Secret")}
    for workload, c in gateway_containers():
        env = env_of(c)
        name = workload["metadata"]["name"]
        assert {"REDIS_URL", "GATEWAY_CONFIG", "GATEWAY_POOLS_JSON", "REDIS_USERNAME",
                "REDIS_PASSWORD"} <= set(env), name
        config_path = env["GATEWAY_CONFIG"]["value"]
        assert config_path == "/etc/gateway/gateway.toml"
        for e in env.values():
            ref = e.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                assert ref["configMapKeyRef"]["name"] == "gateway-config"
                assert ref["configMapKeyRef"]["key"] in configmap["data"]
            if "secretKeyRef" in ref:
                assert ref["secretKeyRef"]["name"] in secrets, (name, e)
                assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]], (name, e)
                assert not ref["secretKeyRef"].get("optional"), (name, e)   # never run without it
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        config_volumes = [n for n, v in volumes.items() if "configMap" in v]
        assert len(config_volumes) == 1
        vol = volumes[config_volumes[0]]["configMap"]
        assert mounts[config_volumes[0]] == os.path.dirname(config_path)
        assert vol["name"] == "gateway-config"
        assert [i["path"] for i in vol["items"]] == [os.path.basename(config_path)]
        assert vol["items"][0]["key"] in configmap["data"]


# -- references ----------------------------------------------------------------------
def _workload_labels() -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"]["labels"] for k in WORKLOADS for w in of_kind(k)]


def _selects(selector: dict[str, str]) -> bool:
    return any(selector.items() <= labels.items() for labels in _workload_labels())


def test_services_hpa_and_pdbs_point_at_workloads():
    for svc in of_kind("Service"):
        assert _selects(svc["spec"]["selector"]), svc["metadata"]["name"]
    for kind in WORKLOADS:
        for w in of_kind(kind):
            assert w["spec"]["selector"]["matchLabels"].items() <= \
                w["spec"]["template"]["metadata"]["labels"].items()
    for svc_name in ("gateway-api", "flower"):
        assert one("Service", svc_name)
    for tier in Settings().tiers:
        hpa = one("HorizontalPodAutoscaler", f"gateway-worker-{tier.name}")
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and one("Deployment", target["name"])
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    pdbs = of_kind("PodDisruptionBudget")
    assert pdbs
    for pdb in pdbs:
        assert _selects(pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]["name"]


# -- Dockerfile ----------------------------------------------------------------------
def test_dockerfile_installs_the_package_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert any("pip install ." in ln for ln in lines)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY ")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"].get("package-dir", {}).values())
    top_level = {p for p in pyproject["tool"]["setuptools"]["packages"] if "." not in p}
    assert {"pyproject.toml"} | top_level | package_dirs <= copied
    for path in copied:
        assert (ROOT / path).exists(), path
    # the worker/beat/flower pods run as the image's user
    for workload, _ in gateway_containers():
        ctx = workload["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True and str(ctx["runAsUser"]) == users[-1]


# -- security: Redis ACL, secrets, NetworkPolicies -----------------------------------------
def _redis_container() -> dict[str, Any]:
    [c] = one("StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    return c


def test_redis_requires_the_acl_users_password(configmap, cm_settings):
    c = _redis_container()
    args = c["args"]
    users = [i for i, a in enumerate(args) if a == "--user"]
    assert args[users[0]:users[0] + 3] == ["--user", "default", "off"]
    user = args[users[1] + 1]
    assert user == configmap["data"]["REDIS_USERNAME"]
    assert args[users[1] + 2:users[1] + 4] == ["on", ">$(REDIS_PASSWORD)"]
    rules = args[users[1] + 4:]
    assert [r for r in rules if r.startswith("~")] == [f"~{cm_settings.key_prefix}*"]
    assert "-@dangerous" in rules and "-@admin" in rules
    password_ref = env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (password_ref["name"], password_ref["key"]) == ("gateway-redis", "REDIS_PASSWORD")
    assert "REDISCLI_AUTH" in " ".join(c["readinessProbe"]["exec"]["command"])
    for workload, gc in gateway_containers():   # everyone logs in with the same secret
        ref = env_of(gc)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (password_ref["name"], password_ref["key"])


def test_container_env_gives_a_url_with_the_acl_login(configmap, toml_path):
    redis_secret = one("Secret", "gateway-redis")["stringData"]
    api_secret = one("Secret", "gateway-api")["stringData"]
    s = load_settings(env={"GATEWAY_CONFIG": toml_path, "REDIS_URL": configmap["data"]["REDIS_URL"],
                           "REDIS_USERNAME": configmap["data"]["REDIS_USERNAME"],
                           "REDIS_PASSWORD": redis_secret["REDIS_PASSWORD"],
                           "GATEWAY_ADMIN_KEY": api_secret["GATEWAY_ADMIN_KEY"],
                           "GATEWAY_API_KEY_SECRET": api_secret["GATEWAY_API_KEY_SECRET"]})
    url = urlparse(s.redis_url)
    assert (url.username, url.password) == ("gateway", redis_secret["REDIS_PASSWORD"])
    assert redis_secret["REDIS_PASSWORD"] not in s.public().redis_url
    assert s.admin_key and s.api_key_secret
    api = env_of(one("Deployment", "gateway-api")["spec"]["template"]["spec"]["containers"][0])
    assert {"GATEWAY_ADMIN_KEY", "GATEWAY_API_KEY_SECRET"} <= set(api)


def test_flower_never_runs_without_basic_auth():
    [c] = one("Deployment", "flower")["spec"]["template"]["spec"]["containers"]
    ref = env_of(c)["FLOWER_BASIC_AUTH"]["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional")
    assert ":" in one("Secret", ref["name"])["stringData"][ref["key"]]
    assert one("Service", "flower")["spec"].get("type", "ClusterIP") == "ClusterIP"


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        value = labels.get(expr["key"])
        op = expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def _workloads() -> dict[str, dict[str, str]]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for k in WORKLOADS for w in of_kind(k)}


def admitted(target: str, port: int) -> set[str]:
    """Who the NetworkPolicies let reach ``target`` (a workload) on ``port``: workload
    names, or "anyone" (a rule without sources, an ipBlock or another namespace)."""
    labels = _workloads()[target]
    policies = [p for p in of_kind("NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and _matches(p["spec"]["podSelector"], labels)]
    assert policies, f"no NetworkPolicy selects {target}: everything may reach it"
    sources: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = [p.get("port") for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule:
                sources.add("anyone")
            for peer in rule.get("from", []):
                if "ipBlock" in peer or "namespaceSelector" in peer:
                    sources.add("anyone")
                elif "podSelector" in peer:
                    sources |= {n for n, lb in _workloads().items() if _matches(peer["podSelector"], lb)}
    return sources


def test_network_policies_deny_by_default():
    deny = one("NetworkPolicy", "default-deny-ingress")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    for name in _workloads():                      # every pod is selected by some policy
        assert any(_matches(p["spec"]["podSelector"], _workloads()[name]) for p in of_kind("NetworkPolicy"))


def test_only_the_gateway_components_reach_redis():
    workers = {f"gateway-worker-{t.name}" for t in Settings().tiers}   # one Deployment per tier
    assert admitted("redis", 6379) == workers | {"gateway-beat", "gateway-api", "flower"}
    assert admitted("redis", 6380) == set()


def test_nothing_public_reaches_flower_and_the_api_is_open():
    assert admitted("flower", 5555) == set()       # only pods labelled flower-client (none here)
    for workload in (*(f"gateway-worker-{t.name}" for t in Settings().tiers), "gateway-beat"):
        assert admitted(workload, 8000) == set()
    api_port = one("Deployment", "gateway-api")["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert admitted("gateway-api", api_port["containerPort"]) == {"anyone"}
