"""KV request semantics on top of the MVCC store: validation and execution."""
