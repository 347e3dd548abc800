"""Helpers shared by the test tiers: real server processes on loopback ports."""
