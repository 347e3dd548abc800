"""queue_server: an etcd v3 server that is also a durable message queue.

Map of the package, top first. Imports point down this list, never up, and
never sideways between names that share a line; `tests/unit/test_package_layers.py`
reads this list and checks every import against it. `raft/`, the Raft algorithm
with no I/O, is a library beside the package and imports nothing from it.

- `client/`    a client library for both queues (asyncio and blocking), over
                grpcio and etcdserverpb: nothing in the server imports it.
- `cli.py`      the `queue-server` command: flags -> Config -> Server (or, with
                --backend-endpoints, FrontServer), signals, exit status.
- `front/`      a front over an existing etcd: every etcd method forwarded as bytes
                (`forward.py`), the backend connection (`upstream.py`, and our own
                HTTP/2 client for unary calls, `h2_client.py`), the etcd-key queue
                over etcd (`queues.py`: consumer registrations, one dispatcher per
                queue), its lifecycle (`server.py`). Keeps no data.
- `server.py`   composition and lifecycle: builds the parts, hands them to the node
                driver, binds the ports; graceful stop. With --initial-cluster it
                puts `replication.driver.ClusterLog` (Raft) where the local log would be.
- `api/`        gRPC servicers, one module per etcd service (and `cqs.py` for the
                Change Queue Service), written against `transport.methods.Call`:
                validate, propose or read, translate errors (`api/errors.py`), fill
                the header. `service_table.py` builds the method table,
                `observer.py` and `auth_gate.py` are its middleware, and
                `gateway_routes.py` maps etcd's HTTP/JSON gateway URLs onto it.
- `tls.py`      the TLS flags' files -> server contexts and credentials.
- `config.py`   flags and ETCD_* variables -> one frozen Config.
- `metrics_listener.py`, `dashboard.py`, `metrics.py` the --listen-metrics-urls
                listener (/health, /readyz, /livez, /metrics, the dashboard; its
                requests read by h11, as the gateway's), the dashboard's JSON,
                history and redrive, the Prometheus registry and its collector.
- `queue_stats.py` each queue's figures, for the dashboard and the metrics.
- `recipes/`    server-side lock and election recipes (an in-process client).
- `quota.py`    --quota-backend-bytes: the NOSPACE alarm before a write.
- `compactor.py` auto-compaction policy (etcd's --auto-compaction-*).
- `replication/`, `local_log.py` the two logs behind apply's `Proposer` seam: a
                cluster member (the Raft member driver `ClusterLog`, its raft
                storage, the typed peer wire and membership), and the single-node
                log (WAL + group commit, checkpoints into the backend, recovery).
- `restore.py`  `queue-server restore`: a data dir from a snapshot file.
- `node/`       the node driver: each applied command's effects to the parts that
                act on them; the node's one clock (timer policies); which watches
                are queue consumers (`node/consumers.py`).
- `apply.py`    the state machine: log command -> result and `Effects`, deterministic,
                fail-stop; `Applier`, the one path from a log into it.
- `mq/`, `cqs/` the two queue products, plugged into the keyspace router: the
                etcd-key queue (replicated state, delivery into watches, ack
                policy, member session, redrive Txns) and the Change Queue Service (SLA tree,
                replicated state, the etcd watch view). Neither imports the other.
- `keyspace/`   the queue keyspace `/q/` and `/queue/`: key grammar, the shared
                config document, the router the KV executor calls.
- `kv/`         KV request semantics: stateless validation and the executor that runs
                Range/Put/DeleteRange/Txn/Compaction on the store.
- `watch/`      the watch hub: watchers, fan-out, catch-up from history.
- `lease/`, `auth/`, `alarms.py` leases and their expiry clock; users, roles,
                permissions and tokens; the alarm table.
- `mvcc/`       revisions, per-key history, tombstones, compaction. No I/O.
- `proposals.py` the types of proposing: `Propose` (a log's propose as a function),
                `Spawn` (start a node task) and `ApplyResult`, for the parts below apply.
- `errors.py`, `logs.py`, `durations.py`, `admission.py` the etcd errors the core
                reports (wire code and text); console or JSON log lines (grpc
                C-core's stderr lines too); Go's duration text ("30s", "1m30s"),
                read the same for flags and queue settings; what both logs check
                before appending (request size, apply gap).
- `storage/`    a leaf: the LMDB backend (etcd's buckets), the WAL, snapshot
                files (our data-only QSNAP2, and etcd's bbolt database both ways),
                and how a revision is named (`revisions.py`). Imports nothing
                of the server.
- `transport/`  the native gRPC server: HTTP/2 frames (`h2.py`, no I/O), calls on
                a connection, the method table, the `Call` interface and the one
                handler runner (`methods.py`), the HTTP/1.1 JSON gateway on the
                same port (`gateway.py`), and the same table on grpcio's server
                (`grpcio_fallback.py`, --grpc-transport grpcio). Knows nothing
                of etcd. See docs/transport.md.
"""
