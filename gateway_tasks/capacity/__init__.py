"""Capacity planning: the capacity model (pure) and the cron demand forecast as data."""
