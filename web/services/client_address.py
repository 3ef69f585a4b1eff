"""The address a request came from, seen through the reverse proxies the platform trusts.

Behind an ingress every request's peer is the ingress, so throttling by peer would lock every user out
at once. A proxy appends the address it received the request from to a header (X-Forwarded-For by
default); only proxies we trust are believed, so the client is the right-most hop that is not one of
them: anything to its left was written by the client itself and proves nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# A forwarded header is the tenant's text until proven otherwise: read this much of it, this many hops.
MAX_HEADER_CHARS = 4096
MAX_HOPS = 32
# IPv6 clients get a /64 each from their provider; counting single addresses would let one client
# rotate through 2**64 of them.
IPV6_PREFIX = 64


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or single addresses) as networks; ValueError naming the one that is not."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{cidr.strip()[:64]!r} is not an IP network (CIDR) or address") from None
    return tuple(networks)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address, trusted: Sequence[Network]) -> bool:
    return any(address.version == net.version and address in net for net in trusted)


def client_address(peer: str | None, forwarded: str | None, trusted: Sequence[Network]) -> str | None:
    """The client's address: the peer itself unless the peer is a trusted proxy; then the right-most
    hop of `forwarded` (a comma-separated list, nearest proxy last) that is not a trusted proxy."""
    peer_address = _address(peer) if peer else None
    if peer_address is None:
        return peer
    if not trusted or not forwarded or not _trusted(peer_address, trusted):
        return str(peer_address)
    nearest = peer_address
    for hop in reversed(forwarded[-MAX_HEADER_CHARS:].split(",")[-MAX_HOPS:]):
        address = _address(hop)
        if address is None:  # not an address: the trusted hop that passed it on is all we know
            break
        nearest = address
        if not _trusted(address, trusted):
            break
    return str(nearest)


def throttle_key(address: str) -> str:
    """What one client is counted as: its address, or its /64 for IPv6."""
    parsed = _address(address)
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{parsed}/{IPV6_PREFIX}", strict=False))
    return str(parsed) if parsed is not None else address[:64]
