"""A local Redis Cluster of three masters for the tests: real ``redis-server`` processes on free
loopback ports, joined into one cluster by ``redis-cli --cluster create``.

Every pytest-xdist worker starts its own (ports picked at random and re-picked when taken, one
directory per worker), so two workers starting at the same moment never share a node. A short
``cluster-node-timeout`` keeps failure detection and recovery fast; ``appendfsync always``
makes a killed master come back with every write it acknowledged (the durable configuration
docs/stores.md recommends for a store that must not forget keys).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

__all__ = ["ClusterStartError", "LocalCluster", "start_private_server"]

NODE_TIMEOUT_MS = 1000
START_TIMEOUT = 20.0


class ClusterStartError(RuntimeError):
    """The local cluster could not be started (no redis-server, ports, a node that died)."""


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, rng: random.Random) -> list[int]:
    """``n`` ports P that are free together with their cluster-bus ports P + 10000."""
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 45000)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


@dataclass
class Node:
    """One ``redis-server --cluster-enabled yes`` process; its nodes.conf and AOF in ``dir``.
    With ``cluster=False``, a standalone server (no cluster, no AOF)."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    cluster: bool = True

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process (again, after :meth:`kill`: same port, same nodes.conf)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        log = (self.dir / "redis.log").open("ab")
        mode = (
            ["--cluster-enabled", "yes",
             "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--appendonly", "yes", "--appendfsync", "always"]
            if self.cluster
            else ["--appendonly", "no"]
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                *mode,
                "--save", "",
                "--dir", str(self.dir),
                "--daemonize", "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        client = self.client()
        try:
            while True:
                if self.proc.poll() is not None:
                    tail = (self.dir / "redis.log").read_text(errors="replace")[-600:]
                    raise ClusterStartError(f"redis-server on {self.port} exited: {tail}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError as exc:
                    if time.monotonic() > deadline:
                        raise ClusterStartError(f"no answer on port {self.port}") from exc
                    time.sleep(0.01)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL the process (a crash: no shutdown, no last write)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def state(self) -> str:
        """This node's ``cluster_state`` (``ok`` / ``fail``), or ``down``."""
        client = self.client()
        try:
            info = client.cluster("info")
        except redis.ConnectionError:
            return "down"
        finally:
            client.close()
        return str(info.get("cluster_state", "unknown"))  # redis-py parses CLUSTER INFO


def start_private_server(root: Path, attempts: int = 5) -> Node:
    """A standalone ``redis-server`` of the caller's own on a free loopback port: for tests
    that pause or break their server (``CLIENT PAUSE ALL`` on the shared one would stall every
    other test worker's Redis calls meanwhile)."""
    if shutil.which("redis-server") is None:
        raise ClusterStartError("redis-server is not installed")
    rng = random.Random()  # unseeded on purpose: xdist workers must pick different ports
    for attempt in range(attempts):
        (port,) = _free_ports(1, rng)
        node = Node(port, root / f"try{attempt}-{port}", cluster=False)
        try:
            node.start()
            return node
        except ClusterStartError:
            node.stop()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@dataclass
class LocalCluster:
    """Three masters, no replicas: ``url`` is the ``redis+cluster://`` URL of all three."""

    root: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self, attempts: int = 5) -> None:
        """Start three nodes on free ports and create the cluster; re-pick ports if another
        process took one between the check and the bind."""
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise ClusterStartError("redis-server / redis-cli are not installed")
        rng = random.Random()  # unseeded on purpose: xdist workers must pick different ports
        for attempt in range(attempts):
            ports = _free_ports(3, rng)
            self.nodes = [Node(p, self.root / f"try{attempt}-{p}") for p in ports]
            try:
                for node in self.nodes:
                    node.start()
                break
            except ClusterStartError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(n.address for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            check=False,
        )
        if created.returncode != 0:
            self.stop()
            raise ClusterStartError(f"redis-cli --cluster create failed: {created.stdout[-600:]}")
        self.wait_ok()

    def wait_ok(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until every node says ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while True:
            states = [n.state() for n in self.nodes]
            if states == ["ok"] * len(self.nodes):
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(f"cluster not ok after {timeout} s: {states}")
            time.sleep(0.02)

    def owner(self, key: str) -> Node:
        """The node whose slots hold ``key``."""
        client = self.nodes[0].client()
        try:
            slot = int(client.cluster("keyslot", key))
            for start, end, master, *_ in client.cluster("slots"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            client.close()
        raise AssertionError(f"no node serves the slot of {key!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
