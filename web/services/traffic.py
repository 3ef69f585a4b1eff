"""Canary splits: the bare name's requests shared between ready versions by weight, e.g. {"1": 90, "2": 10}.

A split pins where the name's requests go: while it stands, an upload does not move them (a new version is
ready but gets requests only by `name@N` until the split names it), and a rollback ends it (the chosen
version takes every request again). A request that names its caller (OpenAI's `user`) gets the same version
every time while the split is sticky and unchanged: its caller hashes to a point of the weights laid end to
end in version order, so raising the newest version's weight only moves callers onto it. Other requests
draw at random. The choice is made once, when the gateway resolves the request, and the request keeps that
version (its own engine adapter) to its end, whatever the split becomes meanwhile.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Callable, Mapping

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ..db.models import Adapter, AdapterName, AdapterStatus
from ..schemas import AdapterPublic
from .adapters import get_adapter, lock_name
from .errors import Conflict, NotFound

# A split shares the name between at most this many versions; each weight is at most MAX_WEIGHT.
MAX_SPLIT_VERSIONS = 16
MAX_WEIGHT = 1_000_000


def choose_version(
    split: Mapping[str, int],
    sticky: bool,
    caller: str | None,
    salt: str,
    draw: Callable[[int], int] = random.randrange,
) -> int:
    """The version of `split` one request goes to: by `caller`'s hash when sticky and named (salted with
    the tenant and name, so one caller lands independently under different names), else `draw(total)`."""
    weighted = sorted((int(v), w) for v, w in split.items() if w > 0)
    total = sum(w for _, w in weighted)
    if sticky and caller is not None:
        digest = hashlib.sha256(f"{salt}\x00{caller}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") % total
    else:
        point = draw(total)
    for version, weight in weighted:
        if point < weight:
            return version
        point -= weight
    raise AssertionError("a point below the total falls in one of the weights")


def split_salt(tenant_id: uuid.UUID, name: str) -> str:
    return f"{tenant_id}/{name}"


def set_traffic(
    session: Session, tenant_id: uuid.UUID, name: str, split: Mapping[int, int], sticky: bool = True
) -> AdapterPublic:
    """Share the bare name's requests between the versions of `split` by weight. Every version must be
    ready; the active version stays what it was (the name's listing shows it, and a rollback returns all
    requests to the version it names)."""
    if lock_name(session, tenant_id, name) is None:
        session.rollback()
        raise NotFound(f"no adapter named {name!r}")
    ready = set(
        session.scalars(
            select(Adapter.version).where(
                Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.status == AdapterStatus.READY
            )
        )
    )
    not_ready = sorted(set(split) - ready)
    if not_ready:
        session.rollback()
        raise Conflict(
            f"version {not_ready[0]} of adapter {name!r} is not a ready version; a split shares requests "
            "between ready versions only"
        )
    session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(traffic={str(v): w for v, w in sorted(split.items())}, sticky=sticky)
    )
    session.commit()
    return get_adapter(session, tenant_id, name)


def clear_traffic(session: Session, tenant_id: uuid.UUID, name: str) -> AdapterPublic:
    """End the split: every request for the bare name goes to the active version again."""
    if lock_name(session, tenant_id, name) is None:
        session.rollback()
        raise NotFound(f"no adapter named {name!r}")
    session.execute(
        update(AdapterName)
        .where(AdapterName.tenant_id == tenant_id, AdapterName.name == name)
        .values(traffic=None)
    )
    session.commit()
    return get_adapter(session, tenant_id, name)
