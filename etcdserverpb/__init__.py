"""Protocol buffer definitions (etcd v3 API and internal log format) and generated code."""
