"""Node-to-node replication (Raft log adapter, peer transport). Arrives with the cluster issue."""
