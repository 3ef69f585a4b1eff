"""The pod network: one Linux bridge on the host, one network namespace per pod joined to it by a veth pair.

Every pod gets its own IP on the bridge's /24 and its own loopback, so two pods can both listen on :8000
as their manifests say. The host keeps the bridge's first address (the node: API server, Postgres and the
S3 server listen there) and the Service IPs, which the userspace proxy serves (see proxy.py).
`ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts, which is how pods resolve Service names.
Names carry this process's id, so `Network.sweep_stale()` can remove what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

from tests.cluster.leftovers import pid_alive

NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
PREFIX = "lpx"
_instances = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


class Network:
    """The bridge, the pod namespaces and the Service addresses of one harness run."""

    def __init__(self, subnet: str | None = None) -> None:
        pid = os.getpid()
        instance = next(_instances)
        self.tag = f"{PREFIX}{pid}{chr(ord('a') + instance % 26)}"
        # A /24 per network, from the pid and the instance, so that two runs on one machine rarely meet.
        self.subnet = ipaddress.ip_network(subnet or f"10.{244 + instance % 10}.{pid % 250}.0/24")
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])  # the node: host-side services listen here
        self._pod_ips = [str(h) for h in hosts[1:200]]
        self._service_ips = [str(h) for h in hosts[200:]]
        self.bridge = f"{self.tag}br"
        self.namespaces: dict[str, str] = {}  # pod key -> netns name
        self._veths: dict[str, str] = {}  # netns -> host end
        self._ips: dict[str, str] = {}  # netns -> ip
        self._service_addresses: dict[str, str] = {}  # service key -> ip
        self._counter = 0
        self._lock = threading.RLock()  # pod threads add and remove namespaces concurrently
        self.hosts: dict[str, str] = {}  # name -> ip, written to every pod's hosts file
        self.external_hosts: dict[str, str] = {}  # names of what runs outside the cluster (add_host)
        self._pod_names: dict[str, str] = {}  # netns -> pod name (the pod's own line in its hosts file)

    # --- the node -----------------------------------------------------------------------------------
    def up(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def down(self) -> None:
        """Remove every namespace, veth, Service address and the bridge; never raises."""
        with self._lock:
            for netns in list(self._veths):
                with contextlib.suppress(Exception):
                    self._remove_namespace(netns)
        with contextlib.suppress(Exception):
            ip("link", "del", self.bridge, check=False)

    @staticmethod
    def sweep_stale() -> list[str]:
        """Delete namespaces and bridges left by harness runs whose process is gone (a SIGKILLed pytest)."""
        removed = []
        listing = ip("netns", "list", check=False).stdout.split()
        links = ip("-o", "link", "show", check=False).stdout
        names = {n for n in listing if n.startswith(PREFIX)}
        names |= {
            part.split(":")[1].strip().split("@")[0]
            for part in links.splitlines()
            if part.split(":")[1].strip().startswith(PREFIX)
        }
        for name in sorted(names):
            match = re.match(rf"{PREFIX}(\d+)", name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            if name in listing:
                ip("netns", "del", name, check=False)
                shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
            else:
                ip("link", "del", name, check=False)
            removed.append(name)
        return removed

    # --- pods ---------------------------------------------------------------------------------------
    def add_namespace(self) -> tuple[str, str]:
        """A fresh namespace with eth0 on the bridge and a default route to the node: (netns, pod IP)."""
        with self._lock:  # the whole of it: down() must see every namespace it has to remove
            self._counter += 1
            netns = f"{self.tag}-{self._counter}"
            # Never reused within a run: a client holding a dead pod's address must not reach a new pod.
            address = self._pod_ips.pop(0)
            host_end = f"{self.tag}v{self._counter}"[:15]
            ip("netns", "add", netns)
            self._veths[netns] = host_end
            self._ips[netns] = address
            ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", host_end, "master", self.bridge, "up")
            ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
            ip("-n", netns, "route", "add", "default", "via", self.gateway)
            (ETC_NETNS / netns).mkdir(parents=True, exist_ok=True)
            # No DNS server is reachable from a pod (names come from the hosts file): with no nameserver
            # line the resolver asks 127.0.0.1, which refuses at once, instead of timing out for seconds.
            (ETC_NETNS / netns / "resolv.conf").write_text("options timeout:1 attempts:1\n")
            self.write_hosts(netns)
            return netns, address

    def remove_namespace(self, netns: str) -> None:
        with self._lock:
            self._remove_namespace(netns)

    def _remove_namespace(self, netns: str) -> None:
        host_end = self._veths.pop(netns, None)
        if host_end:
            ip("link", "del", host_end, check=False)  # takes the pod's end with it
        ip("netns", "del", netns, check=False)
        shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
        self._pod_names.pop(netns, None)
        self._ips.pop(netns, None)

    def write_hosts(self, netns: str, pod_name: str = "") -> None:
        pod_name = self._pod_names.setdefault(netns, pod_name) if pod_name else self._pod_names.get(netns, "")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        if pod_name and netns in self._ips:
            lines.append(f"{self._ips[netns]} {pod_name}")
        names = {**self.external_hosts, **self.hosts}
        lines += [f"{address} {name}" for name, address in sorted(names.items())]
        path = ETC_NETNS / netns / "hosts"
        # Rewritten in place, never replaced: a running pod sees it through a bind mount of this inode.
        with path.open("a+") as handle:
            handle.seek(0)
            handle.truncate()
            handle.write("\n".join(lines) + "\n")

    def set_hosts(self, hosts: dict[str, str]) -> None:
        """Replace the cluster's name table and rewrite every pod's hosts file."""
        with self._lock:
            if hosts == self.hosts:
                return
            self.hosts = dict(hosts)
            for netns in list(self._veths):
                with contextlib.suppress(OSError):  # a pod being removed
                    self.write_hosts(netns)

    def add_host(self, name: str, address: str) -> None:
        """A name every pod resolves, as a DNS record outside the cluster would provide."""
        with self._lock:
            self.external_hosts[name] = address
            for netns in list(self._veths):
                with contextlib.suppress(OSError):
                    self.write_hosts(netns)

    # --- Services -----------------------------------------------------------------------------------
    def service_address(self, key: str) -> str:
        """A stable virtual IP for a Service, added to the bridge so that pods route to the host proxy."""
        with self._lock:
            if key not in self._service_addresses:
                address = self._service_ips.pop(0)
                ip("addr", "add", f"{address}/32", "dev", self.bridge)
                self._service_addresses[key] = address
            return self._service_addresses[key]
