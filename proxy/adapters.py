"""Policies: the base model or one named LoRA adapter, and how requests name them.

One base model serves many policies. A *policy* is the base (``adapter`` is
``None``, SQL NULL) or a named adapter whose name matches ``ADAPTER_NAME``.
Each adapter has its own version sequence (from 1; its version 0 is the base
weights with no adapter applied), admission, pushes and production state.

Which policy a request uses is decided by its credential: a session's key
serves the session's adapter, a production key the adapter it was created
for. The ``model`` of a request may name the policy too, as
``"<served-model>:<adapter>"``; a name that disagrees with the credential is
refused (``policy_of_model``), and a model without ``:`` says nothing.
"""

from __future__ import annotations

import re

ADAPTER_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""What an adapter's name looks like: lower-case letters, digits, ``_`` and ``-``, up to 64."""


def check_adapter(name: str | None) -> str | None:
    """``name`` if it is a valid adapter name (or ``None``, the base); else ``ValueError``."""
    if name is None:
        return None
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(
            f"adapter name {name!r} is not valid: use 1-64 characters of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def policy_label(adapter: str | None) -> str:
    """How logs and messages name a policy: the adapter's name, or ``base``."""
    return "base" if adapter is None else f"adapter {adapter}"


class PolicyMismatch(ValueError):
    """A request's ``model`` names another policy than its credential serves."""


def policy_of_model(model: str | None, *, adapter: str | None) -> None:
    """Check that ``model`` agrees with the credential's policy ``adapter``.

    ``"<served>:<adapter>"`` must name the credential's adapter; a model with no
    ``:`` (any name: the served model, or what a harness sends) names no policy
    and always agrees. Raises ``PolicyMismatch`` with a message for the client.
    """
    if not model or ":" not in model:
        return
    named = model.rsplit(":", 1)[1]
    if named == (adapter or ""):
        return
    if adapter is None:
        raise PolicyMismatch(
            f"model {model!r} names adapter {named!r}, but this key serves the base model; "
            "use the model name without ':<adapter>' or a key of that adapter"
        )
    raise PolicyMismatch(
        f"model {model!r} names adapter {named!r}, but this key serves adapter {adapter!r}"
    )
