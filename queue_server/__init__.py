"""queue_server: an etcd v3 server that is also a durable message queue.

Map of the package (imports point down this list, never up):

- `api/`      gRPC servicers, one module per etcd service: validate, call the core,
              translate errors (`api/errors.py`), fill the response header. The only
              package that imports grpc.
- `apply.py`  the state machine: log commands -> results, deterministic.
- `kv/`       KV request semantics: stateless validation and the executor that runs
              Range/Put/DeleteRange/Txn/Compaction on the store.
- `mvcc/`     revisions, per-key history, tombstones, compaction. No I/O.
- `storage/`  the single-node durable log (WAL + group commit), snapshots, recovery.
- `compactor.py` auto-compaction policy (etcd's --auto-compaction-*).
- `errors.py` the etcd errors the core reports, with their wire code and text.
- `config.py`, `cli.py` flags and ETCD_* variables -> one frozen Config.
- `server.py` composition and lifecycle: start, serve, graceful stop.
"""
