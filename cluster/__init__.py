"""Node-to-node replication: a cluster of members behind one Raft log.

- `raft/`          the Raft algorithm as an I/O-free core, and its simulator
- `node.py`        the driver: ClusterLog, the Proposer of a clustered member
- `storage.py`     a member's raft WAL, hard state and snapshots
- `transport.py`   peer-to-peer gRPC (raft messages, forwarded proposals)
- `membership.py`  the member table and MemberAdd/Remove/Update
"""
