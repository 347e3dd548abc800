"""The etcd-key queue (seed 004): produce by put, consume by watch, ack by delete.

- keys.py        the key grammar of /q/ and /queue/ (pure parsing)
- state.py       the replicated part: index counters, delivery attempts, settings,
                 depth; turns a producer put into a message key inside apply
- dispatcher.py  the node-local part: pending order, consumers, prefetch windows,
                 round-robin delivery over watch streams, redelivery
"""
