"""deploy/k8s/redis-cluster, the deployment on a Redis Cluster, checked on what it renders
(``_kustomize``: base/ with the overlay's patches and additions; `kubectl kustomize` renders
the same when kubectl is installed): the base's single Redis and per-tier workers are gone,
a 6-node cluster, its Job, the control Redis and one worker per pool are there; every
document validates against the Kubernetes schemas; every ConfigMap, Secret and Service a
pod names exists; every environment variable a gateway pod gets is a setting's (or a pool's
key) and the settings load from them; the URLs name the cluster's nodes and the control
Redis's Service; the pools sit on three different masters; the security rules of base/ hold
(pods, containers, secrets per audience, memory head-room, network policies, pinned
images).  The last test runs the nodes as the StatefulSet runs them and the Job's script on
loopback: they form a cluster of 3 masters with a replica each, the gateway's ACL user
works on it and cannot administer it, and the Job run again changes nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

yaml = pytest.importorskip("yaml")

from devtools.redis_cluster import slot_of, slot_ranges  # noqa: E402
from gateway_tasks.core.keys import Keys  # noqa: E402
from gateway_tasks.local.children import stop_process  # noqa: E402
from gateway_tasks.core.settings import ENV_SETTINGS, Settings, load_settings  # noqa: E402
from tests.test_k8s_manifests import (CLUSTER, K8S, K8S_VERSIONS, MAXMEMORY_SHARE, UPSTREAM_SECRET,  # noqa: E402
                                      WORKLOADS, _image_name, _images, _kustomize, _matches, _pods,
                                      _workloads, admitted, arg_after, egress, env_of, gateway_containers,
                                      is_worker, of_kind, one, pod_env, quantity_bytes, redis_bytes,
                                      secret_data, secret_refs)

DOCS = _kustomize(CLUSTER)
NODES_SET = "redis-cluster"
CONTROL = "redis-control"
BUS_PORT = 16379
MASTERS = 3


def config() -> dict[str, str]:
    return one("ConfigMap", "gateway-config", DOCS)["data"]


def cluster_toml() -> dict[str, Any]:
    return tomllib.loads(config()["gateway.toml"])


def pool_names() -> list[str]:
    return [p["name"] for p in cluster_toml()["pools"]]


def node_names() -> list[str]:
    """Every cluster node's stable DNS name, from the StatefulSet and its Service."""
    sts = one("StatefulSet", NODES_SET, DOCS)
    svc = sts["spec"]["serviceName"]
    ns = sts["metadata"]["namespace"]
    return [f"{NODES_SET}-{i}.{svc}.{ns}.svc.cluster.local" for i in range(sts["spec"]["replicas"])]


def node_container() -> dict[str, Any]:
    [c] = one("StatefulSet", NODES_SET, DOCS)["spec"]["template"]["spec"]["containers"]
    return c


def job_container() -> dict[str, Any]:
    [c] = one("Job", "redis-cluster-create", DOCS)["spec"]["template"]["spec"]["containers"]
    return c


def workers() -> list[dict[str, Any]]:
    return [d for d in of_kind("Deployment", DOCS) if d["metadata"]["name"].startswith("gateway-worker-")]


# -- shape ---------------------------------------------------------------------------------
def test_the_single_redis_and_the_tier_workers_give_way_to_a_cluster_and_pool_workers():
    names = [(d["kind"], d["metadata"]["name"]) for d in DOCS]
    assert len(names) == len(set(names)), names
    assert ("StatefulSet", "redis") not in names and ("Service", "redis") not in names
    sts = one("StatefulSet", NODES_SET, DOCS)
    assert sts["spec"]["replicas"] == 6 and one("Service", sts["spec"]["serviceName"], DOCS)["spec"]["clusterIP"] == "None"
    assert one("Job", "redis-cluster-create", DOCS) and one("Deployment", CONTROL, DOCS)
    # one worker Deployment per pool, consuming every tier's queue of its pool and no other
    tiers = [t.name for t in Settings().tiers]
    assert sorted(w["metadata"]["name"] for w in workers()) == sorted(f"gateway-worker-{p}" for p in pool_names())
    for w in workers():
        pool = w["metadata"]["labels"]["gateway-tasks/pool"]
        argv = w["spec"]["template"]["spec"]["containers"][0]["command"]
        assert arg_after(argv, "-Q").split(",") == [f"gt.{t}.{pool}" for t in tiers]
        assert arg_after(argv, "-P") == "threads" and "-E" in argv
        # one autoscaler and one PDB each, as base/'s workers have
        [hpa] = [h for h in of_kind("HorizontalPodAutoscaler", DOCS) if h["spec"]["scaleTargetRef"]["name"]
                 == w["metadata"]["name"]]
        assert 2 <= hpa["spec"]["minReplicas"] == w["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
        assert one("PodDisruptionBudget", w["metadata"]["name"], DOCS)
    assert not of_kind("ScaledObject", DOCS)


def test_every_overlay_file_is_used_and_the_base_is_included_as_is():
    kust = yaml.safe_load((CLUSTER / "kustomization.yaml").read_text())
    assert "../base" in kust["resources"]
    named = set(kust["resources"]) | {p["path"] for p in kust["patches"] if "path" in p}
    files = {p.name for p in CLUSTER.glob("*.yaml")} - {"kustomization.yaml"}
    assert files <= named


def _normal(value: Any) -> Any:
    """Lists of named maps as maps by name: the order kustomize merges them in is its own."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(i, dict) and "name" in i for i in value):
        return {i["name"]: _normal(i) for i in value}
    if isinstance(value, list):
        return [_normal(i) for i in value]
    return value


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_renders_what_the_tests_check():
    out = subprocess.run(["kubectl", "kustomize", str(CLUSTER)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = {(d["kind"], d["metadata"]["name"]): _normal(d) for d in yaml.safe_load_all(out.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): _normal(d) for d in DOCS}
    assert sorted(rendered) == sorted(ours)
    for key, doc in ours.items():
        assert rendered[key] == doc, key


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_validates_against_the_kubernetes_schema(version):
    kv = pytest.importorskip("kubernetes_validate")
    for doc in DOCS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc}")


# -- the pools, the URLs and the settings --------------------------------------------------
def test_the_configmap_is_the_base_s_but_for_the_pools_and_the_redis_urls():
    base = tomllib.loads(one("ConfigMap", "gateway-config")["data"]["gateway.toml"])
    mine = cluster_toml()
    assert {k: v for k, v in mine.items() if k != "pools"} == {k: v for k, v in base.items() if k != "pools"}
    assert len(mine["pools"]) == MASTERS
    base_cm = one("ConfigMap", "gateway-config")["data"]
    assert set(config()) == set(base_cm) | {"GATEWAY_CONTROL_REDIS_URL"}
    assert config()["REDIS_USERNAME"] == base_cm["REDIS_USERNAME"]


def test_the_pools_sit_on_three_different_masters_as_the_configmap_says():
    ranges = slot_ranges(MASTERS)    # how `redis-cli --cluster create` cuts the slots of 3 masters
    masters = {p: next(i for i, r in enumerate(ranges) if slot_of(Keys().pool_tag(p)) in r) for p in pool_names()}
    assert sorted(masters.values()) == list(range(MASTERS)), masters
    text = (CLUSTER / "configmap.yaml").read_text()
    said = re.findall(r'"\{p:([\w-]+)\}"\s*= (\d+): master (\d)', text)
    assert sorted(p for p, _, _ in said) == sorted(pool_names())
    for pool, slot, master in said:
        assert (slot_of(f"{{p:{pool}}}"), masters[pool] + 1) == (int(slot), int(master)), pool


def test_redis_url_names_every_node_and_the_control_url_the_control_service():
    url = config()["REDIS_URL"]
    assert url.startswith("redis+cluster://") and "@" not in url      # credentials come from the env
    hosts = url.removeprefix("redis+cluster://").split(",")
    port = next(p["port"] for p in one("Service", NODES_SET, DOCS)["spec"]["ports"] if p["name"] == "redis")
    assert hosts == [f"{n}:{port}" for n in node_names()]
    assert job_env()["NODES"].split() == hosts                       # the Job forms those same nodes
    control = urlsplit(config()["GATEWAY_CONTROL_REDIS_URL"])
    service, namespace = control.hostname.split(".")[:2]
    assert (control.scheme, service, namespace) == ("redis", CONTROL, "gateway")
    svc = one("Service", service, DOCS)
    assert control.port == svc["spec"]["ports"][0]["port"]
    assert _matches({"matchLabels": svc["spec"]["selector"]}, _workloads(DOCS)[CONTROL])


def job_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in job_container()["env"] if "value" in e}


def test_every_gateway_pod_gets_the_settings_it_needs_under_their_names():
    """Every variable a gateway container gets is a setting's (ENV_SETTINGS), the config
    file's, Flower's auth or a pool's key; each gets REDIS_URL and the control URL from the
    ConfigMap, and a worker only its own pool's key."""
    keys = {p["name"]: p["api_key_env"] for p in cluster_toml()["pools"]}
    allowed = set(ENV_SETTINGS) | {"GATEWAY_CONFIG", "FLOWER_BASIC_AUTH"} | set(keys.values())
    seen = 0
    for workload, c in gateway_containers(DOCS):
        env = env_of(c)
        name = workload["metadata"]["name"]
        assert set(env) <= allowed, (name, set(env) - allowed)
        for var in ("REDIS_URL", "GATEWAY_CONTROL_REDIS_URL", "REDIS_USERNAME"):
            ref = env[var]["valueFrom"]["configMapKeyRef"]
            assert (ref["name"], ref["key"]) == ("gateway-config", var), name
        pool_keys = {v for v in env if v in keys.values()}
        assert pool_keys == ({keys[workload["metadata"]["labels"]["gateway-tasks/pool"]]} if is_worker(workload)
                             else set()), name
        seen += 1
    assert seen == len(pool_names()) + 3          # the pools' workers, the API, beat, Flower


@pytest.mark.parametrize("deployment", ["gateway-worker-openai", "gateway-worker-mistral", "gateway-api",
                                        "gateway-beat", "flower"])
def test_each_pod_s_environment_loads_cluster_settings(deployment, tmp_path):
    """What each pod loads from the environment the variant gives it: the cluster's nodes as
    redis_url, the control Redis, both with the ACL login; a worker has its own pool's key
    and no other, the API, beat and Flower none."""
    workload = one("Deployment", deployment, DOCS)
    [c] = workload["spec"]["template"]["spec"]["containers"]
    s = load_settings(env=pod_env(workload, c, tmp_path, docs=DOCS))
    assert s.redis_cluster and s.public().redis_url.startswith("redis+cluster://")
    password = secret_data("gateway-redis", DOCS)["REDIS_PASSWORD"]
    control = urlsplit(s.control_redis_url)
    assert (control.username, control.password, control.hostname) == \
        ("gateway", password, urlsplit(config()["GATEWAY_CONTROL_REDIS_URL"]).hostname)
    assert [p.name for p in s.pools] == pool_names()
    keys = secret_data(UPSTREAM_SECRET, DOCS)
    with_key = {p.name for p in s.pools if p.api_key}
    if is_worker(workload):
        pool = workload["metadata"]["labels"]["gateway-tasks/pool"]
        assert with_key == {pool} and s.pool(pool).api_key == keys[s.pool(pool).api_key_env]
        s.require_keys([pool])
    else:
        assert with_key == set()


# -- references ----------------------------------------------------------------------------
def test_every_referenced_configmap_secret_and_service_exists():
    secrets_seen = set()
    for kind in WORKLOADS:
        for w in of_kind(kind, DOCS):
            for name, key in secret_refs(w):
                data = secret_data(name, DOCS)
                assert key is None or key in data, (w["metadata"]["name"], name, key)
                secrets_seen.add(name)
            pod = w["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        assert ref["key"] in one("ConfigMap", ref["name"], DOCS)["data"], (w["metadata"]["name"], ref)
            for v in pod.get("volumes", []):
                if "configMap" in v:
                    data = one("ConfigMap", v["configMap"]["name"], DOCS)["data"]
                    assert all(i["key"] in data for i in v["configMap"].get("items", []))
    assert secrets_seen == {s["metadata"]["name"] for s in of_kind("Secret", DOCS)}   # none unused
    for svc in of_kind("Service", DOCS):
        assert any(_matches({"matchLabels": svc["spec"]["selector"]}, labels) for labels in _workloads(DOCS).values())
    for pdb in of_kind("PodDisruptionBudget", DOCS):
        assert any(_matches(pdb["spec"]["selector"], labels) for labels in _workloads(DOCS).values())
    for hpa in of_kind("HorizontalPodAutoscaler", DOCS):
        assert one("Deployment", hpa["spec"]["scaleTargetRef"]["name"], DOCS)


def test_each_secret_reaches_only_its_audience():
    readers: dict[str, set[str]] = {}
    for kind in WORKLOADS:
        for w in of_kind(kind, DOCS):
            for name, _ in secret_refs(w):
                readers.setdefault(name, set()).add(w["metadata"]["name"])
    pool_workers = {w["metadata"]["name"] for w in workers()}
    assert readers[UPSTREAM_SECRET] == pool_workers
    assert set(secret_data(UPSTREAM_SECRET, DOCS)) == {p["api_key_env"] for p in cluster_toml()["pools"]}
    assert readers["gateway-redis-cluster"] == {NODES_SET, "redis-cluster-create"}
    assert readers["gateway-redis"] == pool_workers | {"gateway-api", "gateway-beat", "flower", NODES_SET, CONTROL}
    assert readers["gateway-api"] == {"gateway-api"} and readers["gateway-flower"] == {"flower"}


# -- security ------------------------------------------------------------------------------
def test_every_pod_and_container_is_locked_down():
    names = []
    for name, pod in _pods(DOCS):
        names.append(name)
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        for c in pod.get("initContainers", []) + pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"] == {"drop": ["ALL"]} and not ctx.get("privileged"), name
    assert {NODES_SET, CONTROL, "redis-cluster-create"} <= set(names)
    images = _images(DOCS)
    listed = {i["name"] for i in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"]}
    for image in images:
        assert re.search(r"@sha256:[0-9a-f]{64}$", image) or _image_name(image) in listed, image


def _args_of(c: dict[str, Any]) -> list[str]:
    return c.get("args", [])


@pytest.mark.parametrize("workload", [NODES_SET, CONTROL])
def test_redis_memory_leaves_head_room_and_never_evicts(workload):
    kind = "StatefulSet" if workload == NODES_SET else "Deployment"
    [c] = one(kind, workload, DOCS)["spec"]["template"]["spec"]["containers"]
    args = _args_of(c)
    maxmemory = redis_bytes(arg_after(args, "--maxmemory"))
    assert 0 < maxmemory <= MAXMEMORY_SHARE * quantity_bytes(c["resources"]["limits"]["memory"])
    assert arg_after(args, "--maxmemory-policy") == "noeviction"
    assert arg_after(args, "--appendonly") == "yes"          # on the volume mounted at /data
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data"}
    if workload == NODES_SET:
        assert arg_after(args, "--cluster-enabled") == "yes"
        assert arg_after(args, "--cluster-config-file").startswith("/data/")
    else:
        [volume] = one(kind, workload, DOCS)["spec"]["template"]["spec"]["volumes"]
        assert one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], DOCS)


def acl_users(args: list[str]) -> dict[str, list[str]]:
    """--user NAME RULE... of a redis-server command line, by name."""
    at = [i for i, a in enumerate(args) if a == "--user"] + [len(args)]
    out = {}
    for start, end in zip(at, at[1:]):
        rules = args[start + 2:end]
        out[args[start + 1]] = rules[:next((i for i, r in enumerate(rules) if r.startswith("--")), len(rules))]
    return out


def test_the_nodes_acl_users_each_do_one_job():
    users = acl_users(_args_of(node_container()))
    assert users["default"] == ["off"]
    gateway = users[config()["REDIS_USERNAME"]]
    assert gateway[:2] == ["on", ">$(REDIS_PASSWORD)"] and "-@admin" in gateway and "-@dangerous" in gateway
    assert [r for r in gateway if r.startswith("~")] == [f"~{cluster_toml()['key_prefix']}*"]
    assert users["replication"][2:] == ["+psync", "+replconf", "+ping"]
    assert not [r for r in users["replication"] + users["cluster-admin"] if r.startswith(("~", "&", "+@"))]
    assert arg_after(_args_of(node_container()), "--masteruser") == "replication"
    # the control Redis: the same gateway user, no other
    [control] = one("Deployment", CONTROL, DOCS)["spec"]["template"]["spec"]["containers"]
    assert acl_users(_args_of(control)) == {"default": ["off"], "gateway": gateway}


def test_network_policies_admit_the_cluster_s_own_traffic_and_nothing_more():
    gateway_pods = {w["metadata"]["name"] for w in workers()} | {"gateway-api", "gateway-beat", "flower"}
    for target in (NODES_SET, CONTROL):
        assert admitted(target, 6379, DOCS) >= gateway_pods
    assert admitted(NODES_SET, 6379, DOCS) == gateway_pods | {NODES_SET, "redis-cluster-create"}
    assert admitted(NODES_SET, BUS_PORT, DOCS) == {NODES_SET}
    assert admitted(CONTROL, 6379, DOCS) == gateway_pods
    assert egress(NODES_SET, DOCS) == {(NODES_SET, "TCP", 6379), (NODES_SET, "TCP", BUS_PORT)}
    assert egress(CONTROL, DOCS) == set()
    dns = {("dns", "UDP", 53), ("dns", "TCP", 53)}
    assert egress("redis-cluster-create", DOCS) == {(NODES_SET, "TCP", 6379)} | dns
    for name in ("gateway-api", "gateway-beat", "flower"):
        assert egress(name, DOCS) == {(NODES_SET, "TCP", 6379), (CONTROL, "TCP", 6379)} | dns


# -- the nodes and the Job, run -------------------------------------------------------------
def _k8s_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command-line argument."""
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], value)


def _with(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-cli") is None or shutil.which("redis-server") is None,
                    reason="redis-server and redis-cli not installed")
def test_the_nodes_and_the_job_form_a_cluster_the_gateway_user_can_use(tmp_path):
    from redis.cluster import ClusterNode, RedisCluster

    from devtools.redis_cluster import node_port

    secrets = {"REDIS_PASSWORD": uuid.uuid4().hex, "REDIS_REPLICATION_PASSWORD": uuid.uuid4().hex,
               "REDIS_ADMIN_PASSWORD": uuid.uuid4().hex, "POD_IP": "127.0.0.1"}
    taken: set[int] = set()
    ports = []
    for _ in range(one("StatefulSet", NODES_SET, DOCS)["spec"]["replicas"]):
        ports.append(node_port(taken))
        taken |= {ports[-1], ports[-1] + 10000}
    nodes = []
    try:
        for port in ports:
            data = tmp_path / str(port)
            data.mkdir()
            args = [_k8s_expand(a, secrets) for a in _args_of(node_container())]
            args = _with(_with(_with(args, "--port", str(port)), "--dir", str(data)),
                         "--cluster-config-file", str(data / "nodes.conf"))
            nodes.append(subprocess.Popen(["redis-server", *args, "--bind", "127.0.0.1", "--daemonize", "no"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        job = job_container()
        script = job["args"][0]
        env = {"PATH": os.environ["PATH"], **{k: v for k, v in job_env().items()},
               "NODES": " ".join(f"127.0.0.1:{p}" for p in ports),
               "REDIS_ADMIN_PASSWORD": secrets["REDIS_ADMIN_PASSWORD"]}
        first = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "creating the cluster" in first.stdout
        again = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "the cluster exists" in again.stdout, again.stdout + again.stderr
        client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports], username="gateway",
                              password=secrets["REDIS_PASSWORD"], decode_responses=True)
        try:
            # 3 masters with a replica each, once every node's view has caught up (gossip)
            deadline = time.monotonic() + 30
            while True:
                shards = [sorted(n["role"] for n in shard["nodes"]) for shard in client.cluster_shards()]
                if shards == [["master", "replica"]] * MASTERS:
                    break
                assert time.monotonic() < deadline, shards
                time.sleep(0.2)
            for pool in pool_names():
                client.set(f"gt:{{p:{pool}}}:probe", pool)
                assert client.get(f"gt:{{p:{pool}}}:probe") == pool
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set("not-the-gateway-s-key", 1)
        finally:
            client.close()
        with redis.Redis(port=ports[0], username="gateway", password=secrets["REDIS_PASSWORD"]) as node:
            with pytest.raises(redis.exceptions.NoPermissionError):
                node.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[1])
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=ports[0]).ping()                          # the default user is off
        # every replica follows its master, logged in as `replication`
        deadline = time.monotonic() + 30
        for port in ports:
            with redis.Redis(port=port, username="cluster-admin", password=secrets["REDIS_ADMIN_PASSWORD"],
                             decode_responses=True) as node:
                while True:
                    info = node.info("replication")
                    if info["role"] == "master" or info.get("master_link_status") == "up":
                        break
                    assert time.monotonic() < deadline, info
                    time.sleep(0.2)
    finally:
        # all told at once; a master waits up to Redis's shutdown-timeout (10 s) for its replica
        # before it exits, so one still there after that is killed (its data is thrown away)
        for node in nodes:
            node.terminate()
        for node in nodes:
            stop_process(node, timeout_s=15.0)
