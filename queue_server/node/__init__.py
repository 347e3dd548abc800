"""The node: what one member does with what its state machine applied.

- `driver.py`    `NodeDriver`: each applied command's `Effects` to the parts that
                 act on them (watch hub, deliveries, CQS waiters, lease clock),
                 and the node's one clock (`timers.py`).
- `timers.py`    `Timers`: one timer loop over `due(now)` policies, with the
                 clock injected (tests use a fake one).
- `consumers.py` `ConsumerDirectory`: which watches are queue consumers (asking
                 the keyspace router), for either product, and their registry keys.
"""
