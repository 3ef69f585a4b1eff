"""The demo that `loraplex up` sets up: a deployment for the local engine, a tenant with a console user
and an API key, and the trained demo adapter. Idempotent: a second start finds and reuses all of it
(only the deployment's endpoint follows the engine to its new port).

The demo's password and key are kept in `<data dir>/demo-credentials.json` (owner-readable only) so
they can be printed again: the database keeps only their hashes, as it does for everyone else's.
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.adapters import ArtifactStore, adapter_digest

from .db.models import AdapterStatus, ApiKey, Deployment, Tenant, UserRole
from .db.session import Database
from .schemas import DeploymentCreate
from .services import adapters, deployments, keys, tenants, users
from .services.keys import hash_key
from .services.uploads import UploadedFile
from .settings import Settings

DEMO_TENANT = "demo"
DEMO_EMAIL = "demo@loraplex.local"
DEMO_ADAPTER = "demo-uppercase"
DEPLOYMENT = "local"
CREDENTIALS_FILE = "demo-credentials.json"


@dataclass
class Demo:
    email: str
    password: str
    api_key: str
    adapter: str
    base_model: str


def ensure_demo(
    settings: Settings, base_model: str, engine_url: str, adapter_dir: Path, database: Database | None = None
) -> Demo:
    """Create what is missing of the demo and return how to use it."""
    db = database or Database(settings.database_url)
    saved = _read_credentials(settings.data_dir)
    pepper = settings.pepper()
    try:
        with db.session() as session:
            _ensure_deployment(session, base_model, engine_url)
            tenant = session.scalar(select(Tenant).where(Tenant.name == DEMO_TENANT))
            tenant_id = tenant.id if tenant else tenants.create_tenant(session, DEMO_TENANT).id
            password = saved.get("password") or secrets.token_urlsafe(12)
            user = users.find_by_email(session, DEMO_EMAIL)
            if user is None:
                users.create_user(session, DEMO_EMAIL, password, UserRole.MEMBER, tenant_id)
            elif "password" not in saved:  # the credentials file was lost: a new password to print
                users.set_password(session, user.id, password)
            api_key = saved.get("api_key", "")
            if not _key_works(session, api_key, pepper):
                api_key = keys.create_key(session, tenant_id, "loraplex up", pepper).key
            _ensure_adapter(session, settings, tenant_id, adapter_dir)
    finally:
        if database is None:
            db.dispose()
    demo = Demo(DEMO_EMAIL, password, api_key, DEMO_ADAPTER, base_model)
    _write_credentials(settings.data_dir, demo)
    return demo


def _ensure_deployment(session: Session, base_model: str, engine_url: str) -> None:
    existing = session.scalar(select(Deployment).where(Deployment.name == DEPLOYMENT))
    if existing is None:
        spec = DeploymentCreate.model_validate(
            {"name": DEPLOYMENT, "base_model": base_model, "endpoints": [engine_url]}
        )
        # `loraplex up` only: its engine listens on loopback beside the control plane.
        deployments.create_deployment(session, spec, allow_loopback=True)
    elif existing.endpoints != [engine_url]:  # the engine listens on a new port each start
        existing.endpoints = [engine_url]
        session.commit()


def _key_works(session: Session, key: str, pepper: bytes) -> bool:
    if not key:
        return False
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key, pepper)))
    return row is not None and row.revoked_at is None and row.expires_at is None


def _ensure_adapter(session: Session, settings: Settings, tenant_id: uuid.UUID, adapter_dir: Path) -> None:
    """Upload the demo adapter unless it is there, ready, with the digest of the one shipped now (an
    older release's adapter, or one stored before whole-adapter digests, is replaced)."""
    store = settings.artifact_store()
    existing = adapters.find_adapter(session, tenant_id, DEMO_ADAPTER)
    if existing is not None:
        if existing.status == AdapterStatus.READY and existing.sha256 == adapter_digest(adapter_dir):
            return
        adapters.delete_adapter(session, tenant_id, DEMO_ADAPTER, store)
    _upload(session, settings, store, tenant_id, adapter_dir)


def _upload(
    session: Session, settings: Settings, store: ArtifactStore, tenant_id: uuid.UUID, adapter_dir: Path
) -> None:
    files = sorted(p for p in adapter_dir.iterdir() if p.suffix in (".json", ".safetensors"))
    if not files:
        raise FileNotFoundError(f"no PEFT adapter files in {adapter_dir}")
    streams = [p.open("rb") for p in files]
    try:
        uploaded = [UploadedFile(p.name, s) for p, s in zip(files, streams, strict=True)]
        limit = settings.max_upload_bytes
        adapters.upload_adapter(session, store, tenant_id, DEMO_ADAPTER, DEPLOYMENT, uploaded, limit)
    finally:
        for stream in streams:
            stream.close()


def _read_credentials(data_dir: Path) -> dict[str, str]:
    path = data_dir / CREDENTIALS_FILE
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except ValueError:
        return {}
    return {k: v for k, v in loaded.items() if isinstance(v, str)} if isinstance(loaded, dict) else {}


def _write_credentials(data_dir: Path, demo: Demo) -> None:
    path = data_dir / CREDENTIALS_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps(asdict(demo), indent=2) + "\n")
