"""Leases: the replicated lease table (lessor.py) and the leader's expiry clock (expiry.py)."""
