"""Benchmark harnesses: our server and a real etcd side by side on loopback, driven by Go clients.

Each harness is run as ``python -m benchmarks.NAME``; docs/benchmarks.md explains the workloads
and how to read the results. A harness starts its own servers, drives them with Go load
generators (etcd's ``tools/benchmark``, our ``tools/queue-bench``) and stops what it started, by
pid.

Modules:

- ``servers``: our server and etcd as processes (alone or as cluster members), free ports, and
  the CPU and memory figures read from /proc.
- ``options``: the command line every harness shares, the Go tools it finds or builds, the
  server of a kind it names, the facts a report opens with and how a report ends.
- ``runs``: one run of a Go tool, bounded and measured, and what ``tools/queue-bench`` answers.
- ``etcd_tool``: KV, lease, STM and watch workloads under etcd's own load generator.
- ``queue_tool``: the etcd-key queue, etcd's queue recipe and CQS under ``tools/queue-bench``.
- ``cluster_tool``: the same tools against 3-member clusters, and leader failover.
- ``keyspace_tool``: a large keyspace loaded part after part, a restart on it, its growth.
- ``front_tool``, ``front_queue_tool``: KV and the etcd-key queue through fronts over etcd.
"""
