"""The multi-version key space (see store.py). Imports nothing from the rest of the server."""
