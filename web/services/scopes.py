"""What an API key may do: its scope (all, inference, read), the adapter names it may use, and whether it
may call the base models. Every check here refuses with a 403 that names what the key lacks; the gateway
answers it in OpenAI's shape, the tenant API in its `{"detail": ...}` with the same `error` beside it.

- `all`: manage adapters and keys, read listings and usage, call models (every key made before scopes).
- `inference`: call models (and list them), nothing else.
- `read`: listings and usage, no calls to models, no changes.
An adapter list limits every use of an adapter by name (calls, listings, uploads, deletes, rollbacks);
managing keys takes a key with everything (scope `all`, every adapter, the base models), so no key can
make a key wider than itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex import wire

from ..db.models import KeyScope
from .errors import Forbidden

INSUFFICIENT_SCOPE = "insufficient_scope"  # OpenAI's `code` of every refusal here


class ScopeRefused(Forbidden):
    """A key asked for what its scope does not allow: 403, the scope named in the message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.error = wire.WireError(message, wire.PERMISSION_ERROR, INSUFFICIENT_SCOPE, param)


@dataclass(frozen=True)
class KeyLimits:
    """A key's scope; the default is a full key (and a signed-in console user)."""

    scope: KeyScope = KeyScope.ALL
    adapters: frozenset[str] | None = None  # None: every adapter of the tenant
    base_model: bool = True

    @property
    def full(self) -> bool:
        return self.scope == KeyScope.ALL and self.adapters is None and self.base_model

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters

    def visible(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if self.may_use(n)]

    def describe(self) -> str:
        """The key's scope in words, as every refusal names it."""
        parts = [f"scope `{self.scope.value}`"]
        if self.adapters is not None:
            listed = ", ".join(f"`{n}`" for n in sorted(self.adapters)[:10]) or "none"
            more = f" and {len(self.adapters) - 10} more" if len(self.adapters) > 10 else ""
            parts.append(f"adapters {listed}{more}")
        if not self.base_model:
            parts.append("no base model")
        return ", ".join(parts)


def require_manage(limits: KeyLimits, what: str) -> None:
    """Changes to adapters: scope `all`."""
    if limits.scope != KeyScope.ALL:
        raise ScopeRefused(f"This key ({limits.describe()}) cannot {what}: that needs a key of scope `all`.")


def require_read(limits: KeyLimits, what: str) -> None:
    """Listings and usage: scope `all` or `read`."""
    if limits.scope not in (KeyScope.ALL, KeyScope.READ):
        raise ScopeRefused(
            f"This key ({limits.describe()}) cannot {what}: that needs a key of scope `read` or `all`."
        )


def require_inference(limits: KeyLimits) -> None:
    """Calls to models: scope `all` or `inference`."""
    if limits.scope not in (KeyScope.ALL, KeyScope.INFERENCE):
        raise ScopeRefused(
            f"This key ({limits.describe()}) cannot call models: that needs a key of scope "
            "`inference` or `all`.",
            "model",
        )


def require_full(limits: KeyLimits, what: str) -> None:
    """Managing keys: a key with everything, so no key makes or renews a key wider than itself."""
    if not limits.full:
        raise ScopeRefused(
            f"This key ({limits.describe()}) cannot {what}: that needs a key of scope `all` with every "
            "adapter and the base models."
        )


def require_adapter(limits: KeyLimits, name: str, param: str | None = None) -> None:
    if not limits.may_use(name):
        raise ScopeRefused(f"This key ({limits.describe()}) may not use the adapter `{name[:128]}`.", param)


def require_base_model(limits: KeyLimits, model: str) -> None:
    if not limits.base_model:
        raise ScopeRefused(
            f"This key ({limits.describe()}) may not call the base model `{model[:256]}`.", "model"
        )
