"""Benchmark harness: our server and a real etcd side by side on loopback.

Run it with ``python -m benchmarks [--quick] [--suite NAME,...] [--json OUT]
[--out-dir DIR]``; docs/benchmarks.md explains the workloads and how to read the
results. The package owns nothing outside itself: it starts its own servers,
drives them with its own clients and stops what it started, by pid.

Modules:

- ``servers``: start/stop our server and etcd, readiness, CPU/RSS of a server pid.
- ``loadgen``: latency histogram, the in-flight driver, client worker processes.
- ``results``: the result types (a measurement, a row) and their JSON shape.
- ``workloads``: the suites and their workloads (one module per family).
- ``runner``: runs the chosen suites against both servers, prints progress.
- ``report``: machine facts, the text table, JSON, Markdown and PNG charts.
"""
