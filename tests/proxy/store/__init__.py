"""Tests of the trajectory store (``proxy.store``) and its migrations."""
