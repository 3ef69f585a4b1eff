"""High availability through kopf peering: several operator replicas, one of them active.

kopf's peering is a priority scheme, not a lock: every operator writes a keep-alive (its priority and a
lifetime) into the status of a peering object, and an operator pauses while a live peer has a higher
priority, or the same one (then all of them pause). So each replica draws a random priority at startup:
the highest live one works, the others watch nothing and run no daemons until its keep-alive stops (a clean
exit withdraws it at once; a crash is noticed when its `lifetime` runs out).

The peering is cluster-wide (one `ClusterKopfPeering`) even for an operator that watches a few namespaces:
one object to create and to grant, whatever the namespaces. The operator creates it when it is missing, so
the chart needs no custom resource of a CRD it installs in the same release (Helm cannot map such a kind
before the CRD exists).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import kopf
import kubernetes

PEERING_GROUP = "kopf.dev"
PEERING_VERSION = "v1"
PEERING_PLURAL = "clusterkopfpeerings"
# kopf reads an unset priority as 0; a drawn one is never 0, so an explicit --priority is kept.
PRIORITY_RANGE = (1, 2**31 - 1)
REQUEST_TIMEOUT_S = 10.0


def configure(settings: kopf.OperatorSettings, lifetime_seconds: float) -> bool:
    """Cluster-wide peering with a random priority, when `kopf run --peering=NAME` asked for peering.

    False (nothing changed) for `--standalone`, and for kopf's auto-detection mode (neither flag): that
    mode is for a developer's `kopf run`, which should not create objects in the cluster.
    """
    if settings.peering.standalone or not settings.peering.mandatory:
        return False
    settings.peering.clusterwide = True
    settings.peering.lifetime = max(1, round(lifetime_seconds))
    if settings.peering.priority == 0:
        settings.peering.priority = random.randint(*PRIORITY_RANGE)
    return True


async def ensure_peering_object(api_client: kubernetes.client.ApiClient, name: str) -> None:
    """Create the ClusterKopfPeering `name` unless it exists; TemporaryError while its CRD is missing."""
    await asyncio.to_thread(_ensure_sync, api_client, name)


def _ensure_sync(api_client: kubernetes.client.ApiClient, name: str) -> None:
    api = kubernetes.client.CustomObjectsApi(api_client)
    body: dict[str, Any] = {
        "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}",
        "kind": "ClusterKopfPeering",
        "metadata": {"name": name},
    }
    try:
        api.create_cluster_custom_object(
            PEERING_GROUP, PEERING_VERSION, PEERING_PLURAL, body, _request_timeout=REQUEST_TIMEOUT_S
        )
    except kubernetes.client.ApiException as error:
        if error.status == 409:
            return  # another replica (or an earlier run) made it
        if error.status == 404:
            raise kopf.TemporaryError(
                "the ClusterKopfPeering CRD (kopf.dev/v1) is not installed yet: install the chart's CRDs",
                delay=5,
            ) from error
        raise
