"""Policies and where they are served: adapters, deployments, production (promotion, canary,
rollback), the fleet's shared state, and admission of training sessions (staleness)."""
