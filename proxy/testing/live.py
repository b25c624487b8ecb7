"""Test-facing name of :class:`proxy.process.ProxyProcess`."""

from proxy.process import ProxyProcess as LiveProxy

__all__ = ["LiveProxy"]
