"""core/v1 Events about an InferenceDeployment: what `kubectl describe infdep` and `kubectl get events` show.

The operator posts them itself rather than through kopf's logger-driven posting, which startup() limits to
warnings (kopf's own handler chatter would bury these). Events aggregate like the kubelet's: the name is a
digest of the object, type, reason and message, so repeating the same event bumps `count` and
`lastTimestamp` of one Event instead of adding another. Posting is best effort: an Event that cannot be
written is logged and never fails a reconcile.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from loraplex.operator.kube import KubeClient, KubeError
from loraplex.operator.spec import GROUP, KIND, VERSION

logger = logging.getLogger(__name__)

COMPONENT = "loraplex-operator"
NORMAL = "Normal"
WARNING = "Warning"
# Reasons, in one place for docs/operator.md's table.
SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"
CREATED = "Created"
ROLLING_OUT = "RollingOut"
POLICY_VIOLATION = "PolicyViolation"
FOREIGN_OBJECT = "ForeignObject"
INVALID_SPEC = "InvalidSpec"
METRICS_REFUSED = "MetricsRefused"  # engines refused the autoscaler's token on /metrics
INFERENCE_POOL_DISABLED = "InferencePoolDisabled"  # a CR asks for a pool the operator may not make
# The API server refuses longer messages; a condition message is cut the same way.
MAX_MESSAGE = 1024


def event_name(meta: Mapping[str, Any], kind: str, reason: str, message: str) -> str:
    digest = hashlib.sha256(f"{meta.get('uid')}\0{kind}\0{reason}\0{message}".encode()).hexdigest()[:16]
    return f"{meta['name']}.{digest}"


def event_body(
    body: Mapping[str, Any], kind: str, reason: str, message: str, now: str, instance: str
) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(meta, kind, reason, message), "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": kind,
        "reason": reason,
        "message": message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "...",
        "source": {"component": COMPONENT},
        "reportingComponent": f"{GROUP}/operator",
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


async def post(kube: KubeClient, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    """Create the Event, or count one more of the same; errors are logged, never raised."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = event_body(body, kind, reason, message, now, os.environ.get("HOSTNAME", COMPONENT))
    meta = event["metadata"]
    try:
        try:
            await kube.create(event)  # the common case is a new event: one request
            return
        except KubeError as error:
            if error.status != 409:
                raise
        existing = await kube.get("Event", meta["namespace"], meta["name"])
        if existing is None:
            return  # expired between the two calls: the event was seen, that is enough
        count = int(existing.get("count") or 1) + 1
        version = (existing.get("metadata") or {}).get("resourceVersion")
        patch = {"metadata": {"resourceVersion": version}, "count": count, "lastTimestamp": now}
        await kube.patch("Event", meta["namespace"], meta["name"], patch)
    except KubeError as error:
        # A 409 on the patch: a concurrent post of the same event won; the count is one short.
        logger.warning("could not post event %s %s: %s", reason, message, error)
