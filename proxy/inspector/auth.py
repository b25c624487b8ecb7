"""Who may see the inspector: the admin token, given once, then a cookie.

A browser cannot send a bearer header when it follows a link, so the token is given once:
on the login form (``POST /ui/login``) or as ``?token=`` on any ``/ui`` page, which answers a
redirect to the same page without it (the token never stays in the address bar or the
history). Either sets the cookie ``proxima_inspector``: HttpOnly (no script reads it),
SameSite=Strict (no other site's page sends it), path ``/ui``, Secure over HTTPS. Its value is
an HMAC of a fixed label under the admin token: it proves the token was given without being
the token, and it stops working when the proxy's token changes.

The token is checked as the ``/admin`` routes check it (``proxima.proxy.auth.is_admin_token``,
constant time); a request that sends the token as a bearer header (or ``x-api-key``) is let in
as the ``/admin`` routes let it in (``proxima.proxy.api.deps.get_principal``).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request, Response
from proxima.proxy.api.deps import get_principal
from proxima.proxy.auth import is_admin_token
from proxima.proxy.errors import AuthenticationFailed, PermissionDenied
from proxima.proxy.state import state_of

COOKIE = "proxima_inspector"
PATH = "/ui"
_LABEL = b"proxima inspector session v1"


def admin_token(request: Request) -> str | None:
    """The proxy's admin token (None: none configured, so nobody may sign in)."""
    secret = state_of(request).settings.admin_token
    return secret.get_secret_value() if secret is not None else None


def cookie_value(token: str) -> str:
    """What the cookie holds for the admin token ``token``."""
    return hmac.new(token.encode("utf-8"), _LABEL, hashlib.sha256).hexdigest()


def token_is_admin(request: Request, token: str) -> bool:
    """Whether ``token`` is the admin token (the ``/admin`` routes' comparison)."""
    return is_admin_token(token, admin_token(request))


async def signed_in(request: Request) -> bool:
    """Whether the request carries the inspector's cookie or the admin token as a header."""
    token = admin_token(request)
    if token is None:
        return False
    cookie = request.cookies.get(COOKIE)
    if cookie is not None and hmac.compare_digest(cookie.encode(), cookie_value(token).encode()):
        return True
    if request.headers.get("authorization") or request.headers.get("x-api-key"):
        try:
            return (await get_principal(request)).is_admin
        except (AuthenticationFailed, PermissionDenied):
            return False
    return False


def sign_in(request: Request, response: Response) -> None:
    """Set the cookie on ``response`` (the admin token was just checked)."""
    token = admin_token(request)
    assert token is not None
    response.set_cookie(
        COOKIE,
        cookie_value(token),
        path=PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def sign_out(response: Response) -> None:
    response.delete_cookie(COOKIE, path=PATH, httponly=True, samesite="strict")


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path of the inspector, never another site."""
    if not target or not target.startswith(PATH) or target.startswith("//") or "\\" in target:
        return PATH + "/sessions"
    return target
