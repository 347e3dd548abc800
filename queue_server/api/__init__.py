"""gRPC servicers of the etcd v3 API (the only grpc-importing package of the core)."""
