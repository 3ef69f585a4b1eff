"""Read the engines' Prometheus text: parse it into samples, and scrape every ready pod once per period.

What the autoscaler makes of the samples (the signals, their rates and the adapter demand) is
operator/signals.py; this module is the wire side: the text format, the pods to ask, and the request,
including the one place that says how the operator presents the internal token (`scrape_headers`).

The text is read as hostile: a body is cut at MAX_METRICS_BYTES, a line that does not parse is skipped,
and label values are read in one pass (no regular expression over a label list).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loraplex import wire

logger = logging.getLogger(__name__)

# An engine's /metrics is tens of kilobytes; a body past this is cut (and its last line dropped).
MAX_METRICS_BYTES = 4 * 1024 * 1024
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """Every sample line of Prometheus text format (comments skipped, a malformed line skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        sample = _parse_line(line)
        if sample is None:
            logger.debug("unparsable metrics line: %r", line[:200])
        else:
            samples.append(sample)
    return samples


def _parse_line(line: str) -> Sample | None:
    match = _NAME.match(line)
    if match is None:
        return None
    labels: dict[str, str] = {}
    at = match.end()
    if at < len(line) and line[at] == "{":
        parsed = _parse_labels(line, at + 1)
        if parsed is None:
            return None
        labels, at = parsed
    fields = line[at:].split()
    if not fields or len(fields) > 2:  # value, and an optional timestamp
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return Sample(match.group(), labels, value)


def _parse_labels(line: str, at: int) -> tuple[dict[str, str], int] | None:
    """The labels from just after `{`, and the index after the closing `}`; None if malformed."""
    labels: dict[str, str] = {}
    while True:
        while at < len(line) and line[at] in " ,":
            at += 1
        if at < len(line) and line[at] == "}":
            return labels, at + 1
        name = _LABEL_NAME.match(line, at)
        if name is None or line[name.end() : name.end() + 2] != '="':
            return None
        at = name.end() + 2
        chars = []
        while at < len(line) and line[at] != '"':
            if line[at] == "\\" and at + 1 < len(line):
                chars.append(_ESCAPES.get(line[at + 1], line[at + 1]))
                at += 2
            else:
                chars.append(line[at])
                at += 1
        if at >= len(line):
            return None  # the value never closed
        labels[name.group()] = "".join(chars)
        at += 1


def parse_metric(text: str, name: str) -> float | None:
    """Sum of every finite sample of `name` (all label sets) in Prometheus text format; None when absent."""
    return sum_of(parse_samples(text), name)


def sum_of(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """Sum of the finite samples of `name` whose labels include `labels`; None when there is none."""
    total: float | None = None
    for sample in samples:
        if sample.name != name or not math.isfinite(sample.value):
            continue
        if all(sample.labels.get(key) == value for key, value in labels.items()):
            total = sample.value + (total or 0.0)
    return total


@dataclass(frozen=True)
class PodTarget:
    """A ready engine pod to scrape: its uid (the key a rate is kept under) and its base URL."""

    uid: str
    url: str


def ready_pods(pods: Sequence[Mapping[str, Any]], port_name: str = "http") -> list[PodTarget]:
    """Each Ready, not-terminating pod with an IP and the engine container's named port."""
    targets = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        ip = status.get("podIP")
        port = _named_port(pod, port_name)
        if ready and ip and port:
            url = f"http://{ip}:{port}"
            targets.append(PodTarget(uid=str(meta.get("uid") or url), url=url))
    return targets


def ready_pod_targets(pods: Sequence[Mapping[str, Any]], port_name: str = "http") -> list[str]:
    """http://IP:PORT of each Ready, not-terminating pod (the port is the engine container's named port)."""
    return [target.url for target in ready_pods(pods, port_name)]


def _named_port(pod: Mapping[str, Any], port_name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == port_name:
                return int(port["containerPort"])
    return None


def scrape_headers(internal_token: str) -> dict[str, str]:
    """How the operator presents the internal token to an engine's /metrics, in one place: as a bearer
    token (how Prometheus scrapes a protected endpoint) and in the gateway's own header (wire.py), so
    either check the engine makes finds it. No token, no headers (an engine without one serves /metrics
    openly)."""
    if not internal_token:
        return {}
    return {"Authorization": f"Bearer {internal_token}", wire.INTERNAL_TOKEN_HEADER: internal_token}


@dataclass(frozen=True)
class Scrape:
    """One period's answers: each pod's samples by uid; the pods that refused the token (401/403)."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    refused: tuple[str, ...] = ()


async def scrape_pods(
    session: aiohttp.ClientSession, targets: Sequence[PodTarget], timeout_s: float, internal_token: str = ""
) -> Scrape:
    """Every pod's /metrics at once; a pod that does not answer in time is left out (the autoscaler
    counts it as silent), one that refuses the token is named in `refused`."""
    headers = scrape_headers(internal_token)

    async def one(target: PodTarget) -> tuple[PodTarget, list[Sample] | None, bool]:
        try:
            async with session.get(
                f"{target.url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status in (401, 403):
                    return target, None, True
                resp.raise_for_status()
                body = await resp.content.read(MAX_METRICS_BYTES)
                text = body.decode("utf-8", "replace")
                if len(body) == MAX_METRICS_BYTES:
                    text = text.rsplit("\n", 1)[0]  # the last line may be cut in half
                return target, parse_samples(text), False
        except (aiohttp.ClientError, TimeoutError) as error:
            logger.info("no metrics from %s: %s", target.url, error)
            return target, None, False

    results = await asyncio.gather(*(one(target) for target in targets))
    return Scrape(
        samples={target.uid: samples for target, samples, _ in results if samples is not None},
        refused=tuple(target.url for target, _, refused in results if refused),
    )
