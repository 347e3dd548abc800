"""The etcd-key queue (seed 004): produce by put, consume by watch, ack by delete.

- state.py       the replicated part, the keyspace router's plugin: index counters,
                 delivery attempts, produce times, settings, consumers and who
                 holds what; turns a producer put into a message key and assigns
                 messages, inside apply; on a backend, one row per message in
                 table t:mq
- delivery.py    the node-local part: consumer watches here, assignments into
                 WatchResponses, hand-over keys, delivery leases, requeues
- ack_policy.py  the timer policy: ack deadlines and stuck consumers
- session.py     a cluster member's session lease, which its consumers' registry keys use
"""
