"""Authentication and role-based access control (etcd's auth, v3.5).

- `errors.py`  the auth errors with etcd's exact status code and text.
- `store.py`   the replicated auth store: enabled flag, users, roles, auth revision;
               changed only by `AuthCommand`s applied from the log. No I/O, no bcrypt.
- `perms.py`   the permission checker: pure functions from (store, user, request)
               to "allowed" or an error. Every service asks it, none decides alone.
- `tokens.py`  simple tokens: the node-local table token -> user with a TTL.
- `passwords.py` bcrypt hashing and checking, for the proposer and Authenticate only.

Nothing here imports grpc; `queue_server.api.auth` and `queue_server.api.auth_gate`
are the wire side.
"""
