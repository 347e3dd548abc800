"""The Change Queue Service (issue 5; seeds 000 and 001). So far: the per-queue SLA
priority structure (tree.py), pure and unit-tested. The plan: docs/cqs-design.md."""
