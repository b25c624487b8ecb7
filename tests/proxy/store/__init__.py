"""Tests of the trajectory store (``proxima.proxy.store``) and its migrations."""
