"""Console users: argon2id password hashes, creation by admins (or the CLI), and password checks."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from ..db.models import Tenant, User, UserRole, utcnow
from .errors import Conflict, Invalid, NotFound

MIN_PASSWORD_CHARS = 10
# argon2 hashes whatever it is given; a cap keeps a sign-in form from becoming a CPU sink.
MAX_PASSWORD_CHARS = 256
# Deliberately loose: the address only has to look like one; nothing is sent to it.
EMAIL = re.compile(r"^[^@\s]{1,64}@[^@\s]+\.[^@\s]+$")

_hasher = PasswordHasher()  # argon2id with the library's recommended costs
# Checked against when the email is unknown, so a miss takes as long as a wrong password.
_DUMMY_HASH = _hasher.hash("not the password of anyone")


@dataclass(frozen=True)
class UserView:
    """A user as pages show it; never carries the hash."""

    id: uuid.UUID
    email: str
    role: UserRole
    tenant_id: uuid.UUID | None
    tenant_name: str | None
    tenant_disabled: bool
    disabled: bool
    tenant_fair_share_weight: float = 1.0  # the playground's requests carry it like a key's

    @property
    def is_admin(self) -> bool:
        return self.role == UserRole.ADMIN

    @property
    def can_sign_in(self) -> bool:
        return not self.disabled and not self.tenant_disabled


def to_view(user: User) -> UserView:
    return UserView(
        id=user.id,
        email=user.email,
        role=user.role,
        tenant_id=user.tenant_id,
        tenant_name=user.tenant.name if user.tenant else None,
        tenant_disabled=bool(user.tenant and user.tenant.disabled),
        disabled=user.disabled,
        tenant_fair_share_weight=user.tenant.fair_share_weight if user.tenant else 1.0,
    )


def normalize_email(email: str) -> str:
    return email.strip().lower()


def check_email(email: str) -> str:
    email = normalize_email(email)
    if len(email) > 320 or not EMAIL.match(email):
        raise Invalid(f"{email!r} is not an email address")
    return email


def check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_CHARS:
        raise Invalid(f"the password must have at least {MIN_PASSWORD_CHARS} characters")
    if len(password) > MAX_PASSWORD_CHARS:
        raise Invalid(f"the password must have at most {MAX_PASSWORD_CHARS} characters")


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def create_user(
    session: Session, email: str, password: str, role: UserRole, tenant_id: uuid.UUID | None
) -> UserView:
    email = check_email(email)
    check_password(password)
    if role == UserRole.MEMBER and tenant_id is None:
        raise Invalid("a member belongs to a tenant: choose one")
    if tenant_id is not None and session.get(Tenant, tenant_id) is None:
        raise NotFound(f"no tenant with id {tenant_id}")
    user = User(email=email, password_hash=hash_password(password), role=role, tenant_id=tenant_id)
    session.add(user)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"a user with the email {email} already exists") from None
    return get_user(session, user.id)


def set_password(session: Session, user_id: uuid.UUID, password: str) -> None:
    check_password(password)
    user = _load(session, user_id)
    user.password_hash = hash_password(password)
    session.commit()


def make_admin(session: Session, user_id: uuid.UUID) -> None:
    user = _load(session, user_id)
    user.role = UserRole.ADMIN
    user.disabled = False
    session.commit()


def set_disabled(session: Session, user_id: uuid.UUID, disabled: bool) -> UserView:
    user = _load(session, user_id)
    user.disabled = disabled
    session.commit()
    return to_view(user)


def _load(session: Session, user_id: uuid.UUID) -> User:
    user = session.scalar(select(User).where(User.id == user_id).options(selectinload(User.tenant)))
    if user is None:
        raise NotFound(f"no user with id {user_id}")
    return user


def get_user(session: Session, user_id: uuid.UUID) -> UserView:
    return to_view(_load(session, user_id))


def find_by_email(session: Session, email: str) -> UserView | None:
    user = session.scalar(
        select(User).where(User.email == normalize_email(email)).options(selectinload(User.tenant))
    )
    return to_view(user) if user else None


def list_users(session: Session, tenant_id: uuid.UUID | None = None) -> list[UserView]:
    query = select(User).options(selectinload(User.tenant)).order_by(User.email)
    if tenant_id is not None:
        query = query.where(User.tenant_id == tenant_id)
    return [to_view(u) for u in session.scalars(query)]


def verify(session: Session, email: str, password: str) -> UserView | None:
    """The user whose email and password these are, else None (also for a disabled one: the caller
    tells them apart with `can_sign_in`, after the password proved who is asking)."""
    user = session.scalar(
        select(User).where(User.email == normalize_email(email)).options(selectinload(User.tenant))
    )
    if len(password) > MAX_PASSWORD_CHARS:
        return None
    try:
        _hasher.verify(user.password_hash if user else _DUMMY_HASH, password)
    except (VerificationError, InvalidHashError):
        return None
    if user is None:
        return None
    if _hasher.check_needs_rehash(user.password_hash):  # costs raised since it was hashed
        user.password_hash = hash_password(password)
    user.last_sign_in_at = utcnow()
    session.commit()
    return to_view(user)
