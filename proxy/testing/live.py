"""Test-facing name of :class:`proxima.proxy.server_process.ProxyProcess`."""

from proxima.proxy.server_process import ProxyProcess as LiveProxy

__all__ = ["LiveProxy"]
