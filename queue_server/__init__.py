"""queue_server: an etcd v3 server that is also a durable message queue.

Map of the package by layers, top first. A part is a folder or a module right
under `queue_server/`. A part imports only parts of lower layers: never one of
its own layer, never one above. Parts that share a layer need have nothing to
do with each other; the number says only how far the part sits from the bottom.
There are as many layers as the longest chain of imports has parts (cli.py ->
server.py -> api/ -> config.py -> quota.py -> apply.py -> mq/ -> watch/ ->
mvcc/ -> storage/), so no two could be merged. `tests/unit/test_package_layers.py`
reads this map and checks every import against it.

- layer 9: the command
  - `cli.py` the `queue-server` command: flags -> Config -> Server (or, with
    --backend-endpoints, FrontServer), signals, exit status.
- layer 8: what the command runs
  - `server.py` composition and lifecycle: builds the parts, hands them to the
    node driver, binds the ports; graceful stop. With --initial-cluster it puts
    `replication.driver.ClusterLog` (Raft) where the local log would be.
  - `front/` a front over an existing etcd, keeping no data: every etcd method
    forwarded as bytes (`forward.py`), the backend connection (`upstream.py`,
    and our HTTP/2 client for unary calls, `h2_client.py`, kept on the
    backend's leader by `leader.py`), the etcd-key queue
    over etcd (`queues.py`: consumer registrations, one dispatcher per queue),
    CQS over etcd (`cqs.py`, `cqs_queue.py`, `cqs_fanout.py`), the election
    they share (`election.py`), coalesced watches (`watch_coalesce.py`), its
    lifecycle (`server.py`).
  - `restore.py` `queue-server restore`: a data dir from a snapshot file.
- layer 7: what the ports serve
  - `api/` gRPC servicers, one module per etcd service (and `cqs.py` for the
    Change Queue Service), written against `transport.methods.Call`: validate,
    propose or read, translate errors (`api/errors.py`), fill the header.
    `service_table.py` builds the method table, `observer.py` and
    `auth_gate.py` are its middleware, `gateway_routes.py` maps etcd's
    HTTP/JSON gateway URLs onto it.
  - `metrics_listener.py` the --listen-metrics-urls listener: /health, /readyz,
    /livez, /metrics, the dashboard; its requests read by h11, as the gateway's.
  - `dashboard.py` the dashboard's JSON, history and redrive.
  - `metrics.py` the Prometheus registry and its collector.
  - `tls.py` the TLS flags' files -> server contexts and credentials.
- layer 6: the node, its two logs, the settings
  - `node/` the node driver: each applied command's effects to the parts that
    act on them; the node's one clock (timer policies); which watches are
    queue consumers (`node/consumers.py`).
  - `local_log.py` the single-node log behind apply's `Proposer` seam: WAL +
    group commit, checkpoints into the backend, recovery.
  - `replication/` a cluster member's log behind the same seam: the Raft member
    driver `ClusterLog`, its raft storage, the typed peer wire, membership.
  - `recipes/` server-side lock and election recipes (an in-process client).
  - `queue_stats.py` each queue's figures, for the dashboard and the metrics.
  - `config.py` flags and ETCD_* variables -> one frozen Config.
- layer 5: policies over the state machine
  - `quota.py` --quota-backend-bytes: the NOSPACE alarm before a write.
  - `compactor.py` auto-compaction policy (etcd's --auto-compaction-*).
- layer 4: the state machine
  - `apply.py` log command -> result and `Effects`, deterministic, fail-stop;
    `Applier`, the one path from a log into it.
- layer 3: the two queue products and KV, plugged in by the state machine
  - `mq/` the etcd-key queue: replicated state, delivery into watches, ack
    policy, member session, redrive Txns.
  - `cqs/` the Change Queue Service: SLA tree, replicated state, the etcd watch
    view.
  - `kv/` KV request semantics: stateless validation and the executor that runs
    Range/Put/DeleteRange/Txn/Compaction on the store.
- layer 2: the keyspace, watches, and the rest of the replicated state
  - `keyspace/` the queue keyspace `/q/` and `/queue/`: key grammar, the shared
    config document, the router the KV executor calls.
  - `watch/` the watch hub: watchers, fan-out, catch-up from history.
  - `lease/` leases and their expiry clock.
  - `auth/` users, roles, permissions and tokens.
  - `alarms.py` the alarm table.
- layer 1: the store, and the types of proposing
  - `mvcc/` revisions, per-key history, tombstones, compaction. No I/O.
  - `proposals.py` `Propose` (a log's propose as a function), `Spawn` (start a
    node task) and `ApplyResult`, for the parts below apply.
- layer 0: leaves, importing nothing of the package
  - `storage/` the LMDB backend (etcd's buckets), the WAL, snapshot files (our
    data-only QSNAP2, and etcd's bbolt database both ways), and how a revision
    is named (`revisions.py`).
  - `transport/` the native gRPC server, knowing nothing of etcd: HTTP/2 frames
    (`h2.py`, no I/O), calls on a connection, the method table, the `Call`
    interface and the one handler runner (`methods.py`), the HTTP/1.1 JSON
    gateway on the same port (`gateway.py`), the same table on grpcio's server
    (`grpcio_fallback.py`, --grpc-transport grpcio). See docs/transport.md.
  - `errors.py` the etcd errors the core reports (wire code and text).
  - `logs.py` console or JSON log lines (grpc C-core's stderr lines too).
  - `durations.py` Go's duration text ("30s", "1m30s"), read the same for flags
    and queue settings.
  - `admission.py` what both logs check before appending (request size, apply
    gap).
- beside the layers: imports nothing of the package outside itself, and
  nothing in the package imports it
  - `client/` a client library for both queues (asyncio and blocking). It needs
    only grpcio, protobuf and the generated stubs in `etcdserverpb/`, so it
    could ship as a distribution of its own; today the one `queue-server`
    distribution carries it with the server's dependencies. Importing
    `queue_server.client` loads no other module of the package (this file
    imports nothing).

`raft/`, the Raft algorithm with no I/O, is a library beside the package: it
imports nothing of it, nor etcdserverpb, grpc or asyncio.
"""
