"""Watchers and the fan-out of applied events (see hub.py). No I/O, no asyncio."""
