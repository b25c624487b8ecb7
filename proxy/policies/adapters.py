"""Policies: the base model or one named LoRA adapter, and how requests name them.

One base model serves many policies. A *policy* is the base (``adapter`` is
``None``, SQL NULL) or a named adapter whose name matches ``ADAPTER_NAME_PATTERN``.
Each adapter has its own version sequence (from 1; its version 0 is the base
weights with no adapter applied), admission, pushes and production state.

Which policy a request uses is decided by its credential: a session's key
serves the session's adapter, a production key the adapter it was created
for. The ``model`` of a request may name the policy too, as
``"<served-model>:<adapter>"`` (``split_policy``); a name that disagrees with
the credential is refused (400, ``param: "model"``), and any other model name
says nothing. The admin token has no policy of its own: its ``model`` picks one.
"""

from __future__ import annotations

from proxima.proxy.backends.protocol import ADAPTER_NAME_PATTERN


def check_adapter(name: str | None) -> str | None:
    """``name`` if it is a valid adapter name (or ``None``, the base); else ``ValueError``."""
    if name is None:
        return None
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"adapter name {name!r} is not valid: use 1-64 characters of a-z, 0-9, '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def policy_label(adapter: str | None) -> str:
    """How logs and messages name a policy: the adapter's name, or ``base``."""
    return "base" if adapter is None else f"adapter {adapter}"


def split_policy(model: str, served: str) -> tuple[str, str | None]:
    """``"<served>:<adapter>"`` -> ``(served, adapter)``; any other name -> ``(model, None)``.

    Only the served model's name followed by ``:`` names an adapter, so a
    harness's own model name (which may hold a ``:``) names none.
    """
    prefix = served + ":"
    if model.startswith(prefix):
        return served, model[len(prefix) :]
    return model, None
