"""Signed reasoning: what a client is handed so it can send a model's reasoning back.

Codex sends Responses ``reasoning`` items back with their
``encrypted_content`` (it asks for it with ``include:
["reasoning.encrypted_content"]``, and keeps nothing else of the reasoning);
Claude Code sends ``thinking`` blocks back with their ``signature``. Both are
opaque strings to the client. Here they are one tamper-evident token::

    prx1.<base64url(JSON {"id": completion id, "r": reasoning text})>.<base64url(HMAC-SHA256)>

A token that comes back is accepted only if its MAC is this deployment's:
the reasoning in it is then the reasoning the proxy recorded for that
completion (the id says which), never text a client made up or edited. The
key is ``--signing-key`` (``PROXIMA_SIGNING_KEY``), the same on every proxy
replica; without one it is derived from the admin token, and without that it
is random per process (tokens then do not survive a restart: a reasoning
item that cannot be verified is a 400).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from proxima.proxy.errors import BadRequest

_PREFIX = "prx1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class SealedReasoning:
    """What a verified token says: the completion and its reasoning."""

    completion_id: str
    reasoning: str


class ReasoningSeal:
    """Signs and verifies reasoning tokens with one key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def from_secrets(cls, signing_key: str | None, admin_token: str | None) -> ReasoningSeal:
        if signing_key:
            return cls(signing_key.encode())
        if admin_token:
            return cls(hashlib.sha256(b"proxima-reasoning-seal\0" + admin_token.encode()).digest())
        return cls(secrets.token_bytes(32))

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode("ascii"), hashlib.sha256).digest())

    def seal(self, completion_id: str, reasoning: str) -> str:
        payload = _b64(
            json.dumps({"id": completion_id, "r": reasoning}, ensure_ascii=False).encode()
        )
        return f"{_PREFIX}.{payload}.{self._mac(payload)}"

    def open(self, token: object, *, param: str) -> SealedReasoning:
        """The reasoning in ``token``; a 400 naming ``param`` if it is not one of ours (a
        token is ASCII: one with another character is refused before any comparison,
        which ``hmac.compare_digest`` refuses to make)."""
        if isinstance(token, str) and not token.isascii():
            raise BadRequest(
                f"{param} holds a character that is not ASCII; it was not issued by this "
                "server: reasoning can be sent back only as this server returned it.",
                param=param,
            )
        parts = token.split(".") if isinstance(token, str) else []
        if len(parts) == 3 and parts[0] == _PREFIX:
            payload, mac = parts[1], parts[2]
            if hmac.compare_digest(mac, self._mac(payload)):
                try:
                    data = json.loads(_unb64(payload))
                except ValueError:
                    data = None
                if (
                    isinstance(data, dict)
                    and isinstance(data.get("id"), str)
                    and isinstance(data.get("r"), str)
                ):
                    return SealedReasoning(data["id"], data["r"])
        raise BadRequest(
            f"{param} was not issued by this server, or was altered: reasoning can be sent "
            "back only as this server returned it.",
            param=param,
        )
