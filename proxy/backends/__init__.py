"""Inference backends: the SGLang HTTP client, its wire schema, and the routing pool."""
