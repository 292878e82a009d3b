"""Who a request comes from: API keys, each naming a tenant (`--api-keys FILE`), or the one shared
`--auth-token`, or nobody (an open front: one tenant). Pure but for reading the file.

The keys file: one `TENANT KEY` per line (whitespace between); blank lines and lines starting with
`#` are skipped. A tenant may have several keys; a key names one tenant. A tenant is a name of
letters, digits and `._-` (at most 64); a key is at least 16 characters without whitespace.

A request's key is compared with every key in constant time (`hmac.compare_digest` on SHA-256
digests, every one compared): how long the check takes says nothing about which key is close.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from ampd.front.index import tenant_scope

__all__ = ["Tenant", "KeyRing", "parse_api_keys", "load_api_keys", "OPEN", "MIN_KEY_CHARS"]

MIN_KEY_CHARS = 16
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    name: str
    scope: str  # its sessions' scope in the index (ampd.front.index.tenant_scope)

    @property
    def prefix_scope(self) -> str:
        """Its sessions' prefix scope (OpenSession.prefix_scope): a decode worker shares KV blocks
        only within one, since a shared block shows in the cached tokens and TTFT of whoever shares
        it. The open tenant's is the deployment's shared scope (empty), as for plain gRPC clients."""
        return self.scope if self.name else ""

    @classmethod
    def of(cls, name: str) -> "Tenant":
        return cls(name, tenant_scope(name))


OPEN = Tenant.of("")  # every request of a front without keys, or with the shared token


def parse_api_keys(text: str, source: str = "api keys") -> dict[str, str]:
    """key -> tenant from the file's text. Raises ValueError naming the line."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}:{n}: expected 'TENANT KEY', got {len(parts)} fields")
        tenant, key = parts
        if not _TENANT.fullmatch(tenant):
            raise ValueError(f"{source}:{n}: tenant must be 1-64 letters, digits or ._-")
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"{source}:{n}: key shorter than {MIN_KEY_CHARS} characters")
        if key in out:
            raise ValueError(f"{source}:{n}: key already given (line of tenant {out[key]!r})")
        out[key] = tenant
    if not out:
        raise ValueError(f"{source}: no keys")
    return out


def load_api_keys(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_api_keys(f.read(), path)
    except OSError as exc:
        raise ValueError(f"--api-keys: cannot read {path}: {exc.strerror}") from None


def _h(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The tenant of an `Authorization` header. ``keys`` (key -> tenant) when given, else the one
    ``shared`` token (one tenant), else none: every request is the open tenant."""

    def __init__(self, keys: dict[str, str] | None = None, shared: str = "") -> None:
        self._keys = [(_h(k), Tenant.of(t)) for k, t in (keys or {}).items()]
        if not self._keys and shared:
            self._keys = [(_h(shared), OPEN)]
        self.open = not self._keys

    def tenant(self, authorization: str) -> Tenant | None:
        """The tenant the header's bearer key names; None: missing or wrong."""
        if self.open:
            return OPEN
        scheme, _, key = authorization.partition(" ")
        d = _h(key.strip()) if scheme.lower() == "bearer" else b""
        found = None
        for digest, tenant in self._keys:  # every key compared: no early exit
            if hmac.compare_digest(d, digest):
                found = tenant
        return found
