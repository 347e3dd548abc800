"""The front: a stateless server in front of an existing etcd cluster
(`queue-server --backend-endpoints`). It serves etcd's whole API by forwarding
each call to the backend, which keeps every byte of data. See
docs/cluster-design.md, "Fronts over etcd"."""
