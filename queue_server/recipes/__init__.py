"""Server-side recipes built from KV + Lease + Watch (etcd's v3lock and v3election),
using the node's own state and log as their client."""
