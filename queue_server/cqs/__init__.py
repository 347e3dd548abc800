"""The Change Queue Service (issue 5; seeds 000 and 001). The plan: docs/cqs-design.md.

- tree.py        the per-queue SLA priority structure, pure (no clock, no protobuf)
- state.py       the replicated part, the keyspace router's plugin: queues from their
                 config, publications, dequeue / settle / enqueue commands, expiry
                 at each command's `now_ms`
- commands.py    the proposer's side: CQS commands stamped with its clock and tokens
- visibility.py  the timer policy: proposes the expiry of in-flight notifications
                 whose visibility passed (the leader's, in a cluster)
- watch_view.py  the node-local etcd watch consumers of CQS queues
"""
