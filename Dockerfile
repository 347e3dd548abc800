# One image for every member of a queue-server cluster (see docker-compose.yml).
#
#   docker build -t queue-server .
#   docker run --rm -p 2379:2379 queue-server \
#     --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls http://localhost:2379
#
# Every flag can also be given as an ETCD_* variable (ETCD_NAME, ETCD_INITIAL_CLUSTER...).
#
# Pinned to Debian 12 (bookworm): its etcd-client is etcdctl 3.4, the version the
# project's tests run against, there for operators (`docker compose exec n1 etcdctl
# ...`). The healthcheck in docker-compose.yml asks /health with Python's urllib.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ETCDCTL_API=3

RUN apt-get update \
    && apt-get install -y --no-install-recommends etcd-client \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Only what the package is built from: no .git, caches or benchmark results in the layer.
COPY pyproject.toml README.md ./
COPY etcdserverpb ./etcdserverpb
COPY queue_server ./queue_server
COPY raft ./raft
RUN pip install . && rm -rf /src/build

# An unprivileged user; the data dir exists in the image with its owner, so a named
# volume mounted there starts out writable by that user.
RUN useradd --system --home-dir /var/lib/queue-server --shell /usr/sbin/nologin queue \
    && mkdir -p /var/lib/queue-server \
    && chown queue:queue /var/lib/queue-server
USER queue
WORKDIR /var/lib/queue-server

# 2379: clients (etcd v3 gRPC API); 2380: the other members (Raft); 2381: /health
# when --listen-metrics-urls asks for it.
EXPOSE 2379 2380 2381
VOLUME ["/var/lib/queue-server"]

ENTRYPOINT ["queue-server"]
CMD ["--data-dir", "/var/lib/queue-server", \
     "--listen-client-urls", "http://0.0.0.0:2379", \
     "--advertise-client-urls", "http://localhost:2379"]
