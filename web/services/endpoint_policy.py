"""Which static engine URLs a deployment may name: the control plane sends the internal token to each.

The gateway and engine sync present the one internal token of every engine to a deployment's endpoints,
so an endpoint is where that token goes. Refused, whatever the admin meant:
- a user name or password in the URL (`http://user:pw@host`): credentials in a row every admin reads, and
  a classic way to disguise the host (`http://engine.example.com@169.254.169.254`);
- link-local addresses (169.254.0.0/16, fe80::/10), where clouds serve instance metadata and credentials,
  and the metadata services' other addresses and names (fd00:ec2::254, 168.63.129.16, 100.100.100.200,
  metadata.google.internal, ...), IPv4 written inside IPv6 (::ffff:169.254.169.254) included;
- loopback and unspecified addresses (127.0.0.0/8, ::1, 0.0.0.0, localhost): the control plane's own
  host, unless `LORAPLEX_ALLOW_LOOPBACK_ENDPOINTS` is on, as `loraplex up` sets it (its engine listens on
  127.0.0.1 beside the control plane).
A host name is judged as written: one that resolves to such an address later is not caught here (the
chart's NetworkPolicy and the cloud's metadata protections are the layer for that).
Pure: `endpoint_problem` returns the reason or None.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Instance metadata and platform services outside the link-local ranges.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::23",  # AWS EKS Pod Identity agent over IPv6
        "168.63.129.16",  # Azure WireServer
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud (classic)
    )
)
METADATA_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.tencentyun.com",
    }
)
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
# NAT64 gateways turn 64:ff9b::a.b.c.d into a connection to a.b.c.d.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def endpoint_problem(url: str, allow_loopback: bool) -> str | None:
    """Why the control plane must not send the internal token to `url`; None when it may."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if "@" in parts.netloc:
        return "carries a user name or password (userinfo): give the engine's host and port only"
    if not host:
        return "names no host"
    host = host.rstrip(".").lower()
    if host in METADATA_NAMES or host.endswith(".metadata.google.internal"):
        return "names a cloud metadata service, which hands out the node's credentials"
    address = _address(host)
    if address is None:
        if host in LOOPBACK_NAMES or host.endswith(".localhost"):
            return None if allow_loopback else _LOOPBACK
        return None
    if address in METADATA_ADDRESSES:
        return "is a cloud metadata or platform address, which hands out the node's credentials"
    if address.is_link_local:
        return "is a link-local address (169.254.0.0/16, fe80::/10), where clouds serve instance metadata"
    if address.is_loopback or address.is_unspecified:
        return None if allow_loopback else _LOOPBACK
    return None


_LOOPBACK = (
    "is the control plane's own host (loopback); engines are reached at their own address "
    "(LORAPLEX_ALLOW_LOOPBACK_ENDPOINTS=true permits it, as `loraplex up` does)"
)


def _address(host: str) -> IPAddress | None:
    """The address a host stands for when it is one (any spelling the resolver accepts), else None."""
    try:
        address: IPAddress = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            # inet_aton reads what getaddrinfo does: 2852039166, 0xa9fea9fe, 0251.0376.0251.0376, 127.1.
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address
