"""The queue keyspace `/q/` and `/queue/`: its grammar, its shared config, its router.

- `grammar.py` the key grammar of both spellings, and the queue-shaped keys
               with a broken part that are refused (pure, no state).
- `config.py`  the JSON of `/q/{name}/config`, parsed once for every product,
               and the typed, range-checked reads of its fields (the schema).
- `router.py`  `KeyspaceRouter`, the one hook object the KV executor calls: it
               parses a key once and hands it to the product that owns the queue
               (`QueuePlugin`: the etcd-key queue in `mq/`, CQS in `cqs/`).

Nothing here knows either product; they are plugged in by the state machine.
"""
