"""deploy/k8s and the Dockerfile stay consistent with the code: every YAML
parses and validates against the Kubernetes schemas (kubernetes-validate, offline;
KEDA's ScaledObject against tests/schemas), both kustomizations (HPA fallback and
KEDA) hold every worker Deployment with exactly one autoscaler, commands name
real modules, CLI commands and queues, the ConfigMap's gateway.toml loads with
load_settings in a worker's environment, every reference (ConfigMap/Secret
keys, Services, HPA, ScaledObjects, PDBs) resolves, and the KEDA queries name
metrics the exporter really serves.  And what a security review asks: every pod
runs with the RuntimeDefault seccomp profile, no service account token and
locked-down containers; the upstream key's Secret reaches the workers only;
Redis's maxmemory leaves head-room under its container limit; NetworkPolicies
deny ingress and egress by default and admit only what each component needs;
every image is pinned by digest or through the kustomize images list.
tests/test_k8s_pods.py runs a worker and the API with the environments the
manifests give their pods.  The Redis Cluster variant (deploy/k8s/redis-cluster, an overlay
of base/ with patches) is checked on its rendering by tests/test_k8s_cluster_manifests.py;
the helpers here take the documents to look at (``docs``: by default those of base/ and its
two variants)."""

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
CLUSTER = K8S / "redis-cluster"   # an overlay of base/: its files are patches and additions
NAMESPACE = "gateway"
WORKLOADS = ("Deployment", "StatefulSet", "Job")

Docs = list[dict[str, Any]]


def all_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every document of base/ and the two variants, with the file it is in."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if CLUSTER in path.parents:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((str(path.relative_to(K8S)), doc))
    return out


DOCS = all_docs()


def of_kind(kind: str, docs: Docs | None = None) -> list[dict[str, Any]]:
    return [d for d in ([d for _, d in DOCS] if docs is None else docs) if d.get("kind") == kind]


def one(kind: str, name: str, docs: Docs | None = None) -> dict[str, Any]:
    found = [d for d in of_kind(kind, docs) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def containers(docs: Docs | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for kind in WORKLOADS:
        for workload in of_kind(kind, docs):
            for c in workload["spec"]["template"]["spec"]["containers"]:
                yield workload, c


def gateway_containers(docs: Docs | None = None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload, c in containers(docs):
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


UPSTREAM_SECRET = "gateway-upstream"


def secret_data(name: str, docs: Docs | None = None) -> dict[str, str]:
    """A Secret's keys and (placeholder) values, from stringData or base64 data."""
    import base64

    doc = one("Secret", name, docs)
    data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
    return {**data, **(doc.get("stringData") or {})}


def is_worker(workload: dict[str, Any]) -> bool:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "gateway-worker"


def worker_key_env() -> dict[str, str]:
    """The upstream keys as a worker pod's environment has them (the Secret's placeholders)."""
    return secret_data(UPSTREAM_SECRET)


def pod_env(workload: dict[str, Any], container: dict[str, Any], root: Path,
            secrets: dict[str, dict[str, str]] | None = None,
            config: dict[str, str] | None = None, docs: Docs | None = None) -> dict[str, str]:
    """The environment Kubernetes gives ``container`` (env and envFrom, ConfigMap and Secret
    references resolved), its ConfigMap volumes written under ``root`` as they would be
    mounted, and every value naming a path in such a mount moved under ``root``.  Secret
    values come from ``secrets`` (name -> key -> value) or else the manifests' placeholders;
    ConfigMap values from ``config`` (key -> value) or else the manifest."""
    cm = {**one("ConfigMap", "gateway-config", docs)["data"], **(config or {})}

    def configmap(name: str) -> dict[str, str]:
        return cm if name == "gateway-config" else one("ConfigMap", name, docs)["data"]

    def secret(name: str) -> dict[str, str]:
        return (secrets or {}).get(name) or secret_data(name, docs)

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(configmap(source["configMapRef"]["name"]))
        if "secretRef" in source:
            env.update(secret(source["secretRef"]["name"]))
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            env[e["name"]] = configmap(ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            env[e["name"]] = secret(ref["secretKeyRef"]["name"])[ref["secretKeyRef"]["key"]]
        else:
            raise AssertionError(f"unsupported env entry {e}")
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        vol = volumes.get(mount["name"], {})
        if "configMap" not in vol:
            continue
        folder = root / mount["mountPath"].lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        data = configmap(vol["configMap"]["name"])
        for item in vol["configMap"].get("items") or [{"key": k, "path": k} for k in data]:
            (folder / item["path"]).write_text(data[item["key"]])
        for name, value in env.items():
            if value.startswith(mount["mountPath"].rstrip("/") + "/"):
                env[name] = str(root / value.lstrip("/"))
    return env


@pytest.fixture(scope="module")
def toml_path(configmap, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("k8s") / "gateway.toml"
    path.write_text(configmap["data"]["gateway.toml"])
    return str(path)


@pytest.fixture(scope="module")
def cm_settings(toml_path) -> Settings:
    """The ConfigMap's settings as a worker loads them (with its upstream key)."""
    return load_settings(env={"GATEWAY_CONFIG": toml_path, **worker_key_env()})


# -- shape ---------------------------------------------------------------------------
def test_every_yaml_parses_into_named_objects():
    assert DOCS, "no manifests found"
    kinds = {d["kind"] for _, d in DOCS}
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Secret", "StatefulSet", "Deployment", "Service",
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
    """What `kubectl kustomize DIR` renders, for these plain kustomizations: resources,
    strategic-merge patches (``patches``: a file of them, or one inline for a ``target`` of
    a kind and a name pattern) and images (a new name, tag or digest for an image name)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kust) <= {"apiVersion", "kind", "resources", "patches", "images"}, \
        f"{directory}: only resources, patches and images are used"
    out: list[dict[str, Any]] = []
    for res in kust["resources"]:
        target = (directory / res).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml names {res}, which does not exist"
        if target.is_dir():
            out += _kustomize(target)
        else:
            out += [d for d in yaml.safe_load_all(target.read_text()) if d is not None]
    out = json.loads(json.dumps(out))          # the patches and images below change copies
    for rule in kust.get("patches", []):
        patches = [yaml.safe_load(rule["patch"])] if "patch" in rule else \
            [d for d in yaml.safe_load_all((directory / rule["path"]).read_text()) if d is not None]
        for patch in patches:
            out = _patched(out, patch, rule.get("target"))
    for image in kust.get("images", []):
        for doc in out:
            if doc["kind"] not in WORKLOADS:
                continue
            spec = doc["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                if _image_name(c["image"]) == image["name"]:
                    c["image"] = _new_image(c["image"], image)
    return out


def _patched(docs: list[dict[str, Any]], patch: dict[str, Any],
             target: dict[str, str] | None) -> list[dict[str, Any]]:
    """``docs`` with a strategic-merge patch applied to the documents it names (its own kind
    and name, or ``target``'s kind and name pattern): ``$patch: delete`` removes them, else
    it is merged in (``_merged``).  A patch that names nothing fails, as in kustomize."""
    kind = (target or patch)["kind"]
    name = (target or {}).get("name") or patch["metadata"]["name"]
    hits = [i for i, d in enumerate(docs) if d["kind"] == kind and re.fullmatch(name, d["metadata"]["name"])]
    assert hits, f"a patch names no document: {kind} {name}"
    if patch.get("$patch") == "delete":
        return [d for i, d in enumerate(docs) if i not in hits]
    body = {k: v for k, v in patch.items() if k != "$patch"}
    return [_merged(d, body) if i in hits else d for i, d in enumerate(docs)]


def _named(items: Any) -> bool:
    return isinstance(items, list) and bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def _merged(base: Any, patch: Any) -> Any:
    """A strategic merge, as far as these manifests use it: maps merge key by key, lists of
    named maps (containers, env, volumes, ports) merge item by name, anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merged(base[k], v) if k in base else v for k, v in patch.items()}}
    if _named(base) and _named(patch):
        mine = {i["name"]: i for i in patch}
        kept = [_merged(i, mine.pop(i["name"])) if i["name"] in mine else i for i in base]
        return [*mine.values(), *kept]           # new items first, as kustomize puts them
    return patch


def _image_name(ref: str) -> str:
    """The name of an image reference, without its tag and digest."""
    name = ref.split("@")[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def _new_image(ref: str, rule: dict[str, str]) -> str:
    name = rule.get("newName", _image_name(ref))
    tag = rule.get("newTag") or (ref.split("@")[0][len(_image_name(ref)) + 1:] or None)
    out = f"{name}:{tag}" if tag else name
    return f"{out}@{rule['digest']}" if rule.get("digest") else out


def _listed_files(directory: Path) -> set[Path]:
    """The files a kustomization names: its resources (not folders) and its patch files."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return {(directory / r).resolve() for r in kust["resources"] if not (directory / r).is_dir()} | \
        {(directory / p["path"]).resolve() for p in kust.get("patches", []) if "path" in p}


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
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    rendered = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert rendered == sorted((d["kind"], d["metadata"]["name"]) for d in _kustomize(VARIANTS[variant]))
    assert sorted(_images(docs)) == sorted(_images(_kustomize(VARIANTS[variant])))


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
        assert {"backlog-tokens", "backlog-requests", "cron-forecast", "demand-forecast", "utilisation"} <= names
        for trig in spec["triggers"]:
            assert trig["type"] == "prometheus"
            query = trig["metadata"]["query"]
            metrics = set(re.findall(r"(gateway_[a-z_]+)\{", query))
            assert metrics and metrics <= served, (query, served)
            assert f'tier="{tier}"' in query
            assert float(trig["metadata"]["threshold"]) > 0


def _threads(tier: str) -> int:
    worker = one("Deployment", f"gateway-worker-{tier}")
    return int(arg_after(worker["spec"]["template"]["spec"]["containers"][0]["command"], "-c"))


def _assert_the_designs_behavior(behavior: dict[str, Any]) -> None:
    """Up at most x1.5 per 15 s at once; down after 10 minutes stable, at most x0.8 (or
    one pod) a minute."""
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    assert up["policies"] == [{"type": "Percent", "value": 50, "periodSeconds": 15}]
    assert down["stabilizationWindowSeconds"] == 600
    assert down["policies"] == [{"type": "Percent", "value": 20, "periodSeconds": 60},
                                {"type": "Pods", "value": 1, "periodSeconds": 60}]
    assert down["selectPolicy"] == "Max"


def test_scaled_objects_carry_the_designs_scaling_numbers():
    """The design: utilisation > 0.8 or queue > 1000 -> x1.5; down x0.8 after 10 minutes
    stable; a warm pool of 2-3; predictive scaling on the demand forecast."""
    for obj in of_kind("ScaledObject"):
        spec = obj["spec"]
        tier = obj["metadata"]["labels"]["gateway-tasks/tier"]
        assert 2 <= spec["minReplicaCount"] <= 3                           # the warm pool
        assert spec["fallback"]["replicas"] >= spec["minReplicaCount"]
        assert one("Deployment", f"gateway-worker-{tier}")["spec"]["replicas"] == spec["minReplicaCount"]
        _assert_the_designs_behavior(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"])
        trig = {t["name"]: t for t in spec["triggers"]}
        util = trig["utilisation"]
        assert util["metricType"] == "AverageValue" and "gateway_inflight_tasks" in util["metadata"]["query"]
        assert float(util["metadata"]["threshold"]) == pytest.approx(0.8 * _threads(tier))
        queue = trig["backlog-requests"]
        assert queue["metricType"] == "Value" and float(queue["metadata"]["threshold"]) == 1000
        demand = trig["demand-forecast"]["metadata"]["query"]
        assert "gateway_demand_forecast_tokens_per_minute" in demand and 'source="combined"' in demand
    text = (K8S / "keda" / "scaledobjects.yaml").read_text()
    assert "tolerance 0.625" in text and "0.3" in text     # why the 0.3 scale-down band is not set


def test_hpa_fallback_carries_the_designs_scaling_numbers():
    for tier in Settings().tiers:
        hpa = one("HorizontalPodAutoscaler", f"gateway-worker-{tier.name}")
        assert 2 <= hpa["spec"]["minReplicas"] <= 3
        assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 80
        _assert_the_designs_behavior(hpa["spec"]["behavior"])


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


def test_configmap_pools_hold_no_key_and_name_the_upstream_secret_s_variables(configmap, cm_settings):
    raw = tomllib.loads(configmap["data"]["gateway.toml"])
    upstream = secret_data(UPSTREAM_SECRET)
    assert raw["pools"]
    for pool in raw["pools"]:
        assert "api_key" not in pool, pool["name"]              # the file is mounted into every pod
        assert pool["api_key_env"] in upstream, pool
    # a worker gets each key from the Secret, under the name its pool reads
    assert [p.api_key for p in cm_settings.pools] == [upstream[p["api_key_env"]] for p in raw["pools"]]
    for workload, c in gateway_containers():
        if not is_worker(workload):
            continue
        env = env_of(c)
        for pool in raw["pools"]:
            ref = env[pool["api_key_env"]]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (UPSTREAM_SECRET, pool["api_key_env"])
    assert "GATEWAY_POOLS_JSON" not in {e for _, c in gateway_containers() for e in env_of(c)}


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


def test_every_gateway_container_gets_config_redis_and_keys(configmap):
    secrets = {d["metadata"]["name"]: set(secret_data(d["metadata"]["name"])) for d in of_kind("Secret")}
    for workload, c in gateway_containers():
        env = env_of(c)
        name = workload["metadata"]["name"]
        assert {"REDIS_URL", "GATEWAY_CONFIG", "REDIS_USERNAME", "REDIS_PASSWORD"} <= set(env), name
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
    # the base image pinned by digest (the tag says what it is)
    assert re.fullmatch(r"FROM python:3\.11-slim@sha256:[0-9a-f]{64}", lines[0]), lines[0]
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
    # the runtime only: neither the dev tools nor their distribution
    assert not [ln for ln in lines if "devtools" in ln]
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


@pytest.mark.parametrize("deployment", ["gateway-worker-vip", "gateway-api", "gateway-beat", "flower"])
def test_each_pod_s_environment_loads_its_settings(deployment, tmp_path):
    """The settings each pod loads from the environment the manifests give it: the
    ConfigMap's file, the ACL login, and only its own secrets -- the API, beat and Flower
    load the pools without the upstream key, which only the workers have."""
    workload = one("Deployment", deployment)
    [c] = workload["spec"]["template"]["spec"]["containers"]
    env = pod_env(workload, c, tmp_path)
    s = load_settings(env=env)
    redis_password = secret_data("gateway-redis")["REDIS_PASSWORD"]
    url = urlparse(s.redis_url)
    assert (url.username, url.password) == ("gateway", redis_password)
    assert redis_password not in s.public().redis_url
    assert [p.name for p in s.pools] == ["default"] and s.queue_names() == Settings().queue_names()
    upstream_keys = set(worker_key_env().values())
    if is_worker(workload):
        assert {p.api_key for p in s.pools} <= upstream_keys
    else:
        assert not upstream_keys & set(env.values())
        assert not any(p.api_key in upstream_keys for p in s.pools)
    assert bool(s.admin_key and s.api_key_secret) == (deployment == "gateway-api")


def test_flower_never_runs_without_basic_auth():
    [c] = one("Deployment", "flower")["spec"]["template"]["spec"]["containers"]
    ref = env_of(c)["FLOWER_BASIC_AUTH"]["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional")
    assert ":" in secret_data(ref["name"])[ref["key"]]
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


def _workloads(docs: Docs | None = None) -> dict[str, dict[str, str]]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for k in WORKLOADS for w in of_kind(k, docs)}


def admitted(target: str, port: int, docs: Docs | None = None) -> set[str]:
    """Who the NetworkPolicies let reach ``target`` (a workload) on ``port``: workload
    names, or "anyone" (a rule without sources, an ipBlock or another namespace)."""
    workloads = _workloads(docs)
    labels = workloads[target]
    policies = [p for p in of_kind("NetworkPolicy", docs)
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
                    sources |= {n for n, lb in workloads.items() if _matches(peer["podSelector"], lb)}
    return sources


def test_network_policies_deny_by_default():
    deny = one("NetworkPolicy", "default-deny")["spec"]
    assert deny["podSelector"] == {} and sorted(deny["policyTypes"]) == ["Egress", "Ingress"]
    assert "ingress" not in deny and "egress" not in deny
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


def egress(source: str, docs: Docs | None = None) -> set[tuple[str, str, int]]:
    """Where the NetworkPolicies let ``source`` (a workload) connect: (destination, protocol,
    port), the destination a workload name, "dns" (kube-dns in kube-system), an ipBlock
    ("cidr except a,b"), or "anywhere" (a rule without destinations or ports)."""
    workloads = _workloads(docs)
    labels = workloads[source]
    policies = [p for p in of_kind("NetworkPolicy", docs)
                if "Egress" in p["spec"].get("policyTypes", [])
                and _matches(p["spec"]["podSelector"], labels)]
    assert policies, f"no egress NetworkPolicy selects {source}: it may connect anywhere"
    out: set[tuple[str, str, int]] = set()
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            ports = [(p.get("protocol", "TCP"), p["port"]) for p in rule.get("ports", [])]
            assert ports, f"{policy['metadata']['name']}: an egress rule without ports allows every port"
            peers = rule.get("to")
            assert peers, f"{policy['metadata']['name']}: an egress rule without `to` allows anywhere"
            for peer in peers:
                if "ipBlock" in peer:
                    block = peer["ipBlock"]
                    dests = {f"{block['cidr']} except {','.join(sorted(block.get('except', [])))}"}
                elif "namespaceSelector" in peer:
                    ns = peer["namespaceSelector"].get("matchLabels", {})
                    pods = peer.get("podSelector", {}).get("matchLabels", {})
                    assert ns == {"kubernetes.io/metadata.name": "kube-system"} and \
                        pods == {"k8s-app": "kube-dns"}, peer
                    dests = {"dns"}
                else:
                    dests = {n for n, lb in workloads.items() if _matches(peer["podSelector"], lb)}
                    assert dests, f"{policy['metadata']['name']}: {peer} selects no pod"
                out |= {(d, proto, port) for d in dests for proto, port in ports}
    return out


DNS = {("dns", "UDP", 53), ("dns", "TCP", 53)}
PRIVATE_V4 = {"10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
              "192.168.0.0/16"}


def test_egress_workers_reach_redis_dns_and_the_upstream_the_rest_redis_and_dns_only():
    redis_port = one("Service", "redis")["spec"]["ports"][0]["port"]
    to_redis = {("redis", "TCP", redis_port)}
    upstream = {(f"0.0.0.0/0 except {','.join(sorted(PRIVATE_V4))}", "TCP", 443)}
    for tier in Settings().tiers:
        assert egress(f"gateway-worker-{tier.name}") == to_redis | DNS | upstream
    for name in ("gateway-api", "gateway-beat", "flower"):
        assert egress(name) == to_redis | DNS, name
    assert egress("redis") == set()                  # selected by the default deny, allowed nothing
    # the upstream rule's placeholder keeps the cluster, the nodes and the metadata endpoint out
    [block] = [p for p in of_kind("NetworkPolicy") if p["metadata"]["name"] == "workers-to-upstream"]
    assert "169.254.0.0/16" in block["spec"]["egress"][0]["to"][0]["ipBlock"]["except"]


def test_only_gateway_pods_reach_redis_and_flower_only_from_its_namespace():
    # Flower: only pods of this namespace (a podSelector alone) labelled as its clients
    flower = [p for p in of_kind("NetworkPolicy")
              if _matches(p["spec"]["podSelector"], _workloads()["flower"]) and p["spec"].get("ingress")]
    assert flower
    for policy in flower:
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), "a rule without sources admits everyone"
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer
    for target, port in (("redis", 6379), ("flower", 5555)):
        assert "anyone" not in admitted(target, port)


# -- security: pods and containers --------------------------------------------------------
def _pods(docs: Docs | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in WORKLOADS:
        for w in of_kind(kind, docs):
            yield w["metadata"]["name"], w["spec"]["template"]["spec"]


def test_every_pod_has_runtime_default_seccomp_and_no_service_account_token():
    accounts = {a["metadata"]["name"]: a for a in of_kind("ServiceAccount")}
    names = []
    for name, pod in _pods():
        names.append(name)
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        account = accounts[pod["serviceAccountName"]]             # a dedicated one, not `default`
        assert account["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert "redis" in names and len(names) == 7
    assert not of_kind("RoleBinding") and not of_kind("ClusterRoleBinding")


def test_every_container_is_locked_down_and_writes_only_to_volumes():
    checked = 0
    for name, pod in _pods():
        volumes = {v["name"] for v in pod.get("volumes", [])}
        workload = next(w for k in WORKLOADS for w in of_kind(k) if w["metadata"]["name"] == name)
        volumes |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert ctx["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert ctx["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert not ctx.get("privileged"), (name, c["name"])
            assert ctx.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
            checked += 1
    assert checked == 7
    # Redis writes its AOF and RDB files to its persistent volume
    [redis_c] = one("StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    data = {m["mountPath"]: m for m in redis_c["volumeMounts"]}["/data"]
    assert not data.get("readOnly")


# -- security: secrets ----------------------------------------------------------------------
def secret_refs(workload: dict[str, Any]) -> set[tuple[str, str | None]]:
    """Every (Secret, key) a workload's pods can read (key None: all of it): env, envFrom,
    secret and projected volumes, of every container."""
    pod = workload["spec"]["template"]["spec"]
    refs: set[tuple[str, str | None]] = set()
    for c in pod.get("initContainers", []) + pod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((ref["name"], ref["key"]))
        for source in c.get("envFrom", []):
            if "secretRef" in source:
                refs.add((source["secretRef"]["name"], None))
    for v in pod.get("volumes", []):
        if "secret" in v:
            refs.add((v["secret"]["secretName"], None))
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                refs.add((source["secret"]["name"], None))
    return refs


def test_every_referenced_secret_exists_with_its_keys():
    seen = set()
    for kind in WORKLOADS:
        for w in of_kind(kind):
            for name, key in secret_refs(w):
                data = secret_data(name)              # one("Secret", name) exists
                assert key is None or key in data, (w["metadata"]["name"], name, key)
                seen.add(name)
    assert seen == {s["metadata"]["name"] for s in of_kind("Secret")}     # and none is unused


def test_the_upstream_key_reaches_the_workers_only():
    readers: dict[str, set[str]] = {}
    for kind in WORKLOADS:
        for w in of_kind(kind):
            for name, _ in secret_refs(w):
                readers.setdefault(name, set()).add(w["metadata"]["name"])
    workers = {f"gateway-worker-{t.name}" for t in Settings().tiers}
    assert readers[UPSTREAM_SECRET] == workers
    assert readers["gateway-api"] == {"gateway-api"}
    assert readers["gateway-flower"] == {"flower"}
    assert readers["gateway-redis"] == workers | {"gateway-api", "gateway-beat", "flower", "redis"}
    # the key's value is in no other Secret and no ConfigMap
    upstream = set(secret_data(UPSTREAM_SECRET).values())
    for s in of_kind("Secret"):
        if s["metadata"]["name"] != UPSTREAM_SECRET:
            assert not upstream & set(secret_data(s["metadata"]["name"]).values())
    for cm in of_kind("ConfigMap"):
        assert not any(u in v for u in upstream for v in cm["data"].values())


# -- security: Redis memory -----------------------------------------------------------------
def redis_bytes(value: str) -> int:
    """A redis.conf memory amount: 1k = 1000, 1kb = 1024, ... (case-insensitive)."""
    units = {"": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}
    m = re.fullmatch(r"(\d+)([a-z]*)", value.lower())
    assert m and m.group(2) in units, value
    return int(m.group(1)) * units[m.group(2)]


def quantity_bytes(value: str) -> int:
    """A Kubernetes memory quantity (Mi, Gi, M, G, ...) in bytes."""
    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value))
    assert m and m.group(2) in units, value
    return int(m.group(1)) * units[m.group(2)]


MAXMEMORY_SHARE = 0.75   # of the container limit: the rest for fork copy-on-write, buffers, fragmentation


def test_redis_maxmemory_sits_under_its_container_limit_with_head_room(cm_settings):
    from gateway_tasks.producer.memory_guard import MIB, refuse_at_bytes

    c = _redis_container()
    args = c["args"]
    maxmemory = redis_bytes(arg_after(args, "--maxmemory"))
    limit = quantity_bytes(c["resources"]["limits"]["memory"])
    assert 0 < maxmemory <= MAXMEMORY_SHARE * limit, (maxmemory, limit)
    assert quantity_bytes(c["resources"]["requests"]["memory"]) <= limit
    assert arg_after(args, "--maxmemory-policy") == "noeviction"
    assert arg_after(args, "--appendonly") == "yes"
    # the gateway's guard refuses submits below maxmemory (it is on: a maxmemory is set)
    refuse_at = refuse_at_bytes(maxmemory, cm_settings.redis_memory_refuse_ratio,
                                int(cm_settings.redis_memory_reserve_mib * MIB))
    assert refuse_at is not None and refuse_at < maxmemory
    assert (maxmemory, limit, int(refuse_at) // MIB) == (1536 * MIB, 2048 * MIB, 1382)  # as redis.yaml says


# -- security: images -----------------------------------------------------------------------
def _images(docs: list[dict[str, Any]]) -> list[str]:
    return [c["image"] for d in docs if d["kind"] in WORKLOADS
            for c in d["spec"]["template"]["spec"].get("initContainers", [])
            + d["spec"]["template"]["spec"]["containers"]]


DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def test_every_image_is_pinned_by_digest_or_through_the_kustomize_images_list():
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    listed = {i["name"] for i in base.get("images", [])}
    images = _images([d for _, d in DOCS])
    assert images
    for image in images:
        assert DIGEST.search(image) or _image_name(image) in listed, image
    assert any(DIGEST.search(i) and _image_name(i) == "redis" for i in images)
    # the list applies in both variants (they include base/), and renders what kubectl would
    for variant, directory in VARIANTS.items():
        rendered = _images(_kustomize(directory))
        assert len(rendered) == len(images), variant
        for image in rendered:
            assert DIGEST.search(image) or _image_name(image) in listed
    rule = {"name": "gateway-tasks", "newName": "registry.example.com/gateway-tasks",
            "digest": "sha256:" + "0" * 64}
    assert _new_image("gateway-tasks:0.1.0", rule) == f"registry.example.com/gateway-tasks:0.1.0@{rule['digest']}"
