"""API keys and who is calling.

Three kinds of bearer token reach the proxy:

- the admin token (``--admin-token``): admin routes, session creation, and
  unrecorded inference;
- a session key (``POST /rl/sessions``): inference recorded into its own
  session, reward and finish of that session only;
- a production key (``proxima keys create``): inference served by the current
  policy, recorded into production sessions when the key's recording is on.

Keys are random (256 bits) and only their SHA-256 is stored; the admin token
is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from enum import StrEnum

from proxima.proxy.errors import AuthenticationFailed, PermissionDenied
from proxima.proxy.store.records import ApiKeyRecord, SessionRecord

SESSION_KEY_PREFIX = "sk-proxima-s-"
PRODUCTION_KEY_PREFIX = "sk-proxima-"


def new_key(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
            "or 'x-api-key: <key>'."
        )
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationFailed("Malformed Authorization header; expected 'Bearer <key>'.")
    return token


def is_admin_token(token: str, admin_token: str | None) -> bool:
    if not admin_token:
        return False
    return hmac.compare_digest(token.encode("utf-8"), admin_token.encode("utf-8"))


class PrincipalKind(StrEnum):
    ADMIN = "admin"
    SESSION = "session"
    PRODUCTION = "production"


@dataclass(frozen=True, slots=True)
class Principal:
    kind: PrincipalKind
    session: SessionRecord | None = None
    api_key: ApiKeyRecord | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind is PrincipalKind.ADMIN

    def require_admin(self) -> None:
        if not self.is_admin:
            raise PermissionDenied("This endpoint needs the admin token.")

    def may_access_session(self, session: SessionRecord) -> bool:
        if self.is_admin:
            return True
        if self.kind is PrincipalKind.SESSION:
            return self.session is not None and self.session.id == session.id
        return self.api_key is not None and session.api_key_id == self.api_key.id
