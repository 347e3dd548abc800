"""Durable storage of the single-node log: WAL segments, snapshots, group commit."""
