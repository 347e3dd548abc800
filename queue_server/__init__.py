"""queue_server: an etcd v3 server that is also a durable message queue.

Map of the package (imports point down this list, never up):

- `transport/` the native gRPC server: HTTP/2 frames (`h2.py`, no I/O), calls
              on a connection (`grpc_protocol.py`), the method table and the
              `Call` interface handlers see (`methods.py`), listeners and stop
              (`server.py`). Knows nothing of etcd. See docs/transport.md.
- `api/`      gRPC servicers, one module per etcd service (and `cqs.py` for the
              Change Queue Service), written against `transport.methods.Call`:
              validate, call the core, translate errors (`api/errors.py`), fill
              the response header. `service_table.py` builds the method table,
              `observer.py` and `auth_gate.py` are its middleware, and
              `grpcio_server.py` serves it on grpcio (--grpc-transport grpcio);
              with `tls.py` and `server.py`, the only parts that import grpc.
- `apply.py`  the state machine: log commands -> results, deterministic.
- `kv/`       KV request semantics: stateless validation and the executor that runs
              Range/Put/DeleteRange/Txn/Compaction on the store.
- `mvcc/`     revisions, per-key history, tombstones, compaction. No I/O.
- `mq/`       the etcd-key queue: key grammar, replicated queue state, dispatcher.
- `cqs/`      the Change Queue Service: per-queue SLA tree, replicated CQS state,
              the etcd watch view of CQS queues.
- `auth/`     users, roles, permissions (replicated), the permission checker,
              simple tokens; `api/auth.py` and `api/auth_gate.py` are its wire side.
- `lease/`, `recipes/`, `watch/` leases and their clock, server-side lock and
              election recipes, the watch hub.
- `storage/`  the single-node durable log (WAL + group commit), snapshots, recovery.
- `compactor.py` auto-compaction policy (etcd's --auto-compaction-*).
- `errors.py` the etcd errors the core reports, with their wire code and text.
- `config.py`, `cli.py` flags and ETCD_* variables -> one frozen Config.
- `tls.py`    the TLS flags' files -> gRPC credentials for client and peer URLs;
              `client_common_name(context)`, the client certificate's CN (the
              user name under --client-cert-auth, for auth).
- `http_health.py` the --listen-metrics-urls listener: etcd's /health, /readyz, /livez,
                 /metrics, and the dashboard (`/`, `/api/state`).
- `metrics.py`   the Prometheus registry and the collector read at scrape time.
- `dashboard.py` the dashboard's JSON; the page is `static/dashboard.html`.
- `queue_stats.py` each queue's figures, for both of those.
- `logs.py`      console or JSON log lines, with the request id of the call served.
- `server.py` composition and lifecycle: start, serve, graceful stop; with
              --initial-cluster it puts `cluster.node.ClusterLog` (Raft) where
              the single-node log would be.
"""
