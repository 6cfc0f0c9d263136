"""The platform: tenants and their keys and limits, the catalog of models and versions, canary
rollouts, the pool scaler's policy, and the admin endpoints."""
