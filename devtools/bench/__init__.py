"""Benchmarks: the router (``make bench``) and tenant crons (``make bench-beat``)."""
