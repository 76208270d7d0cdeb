"""Tenants: the registry (tier, hashed API key) and their quotas at submit (lua/tenants/)."""
