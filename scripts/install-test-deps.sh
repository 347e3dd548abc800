#!/usr/bin/env bash
# Install what the tests need on a Debian 12 machine: the Debian packages, this package with its
# test and bench extras, Patroni 4 and the npm packages. The README's test command and .ci/run
# both call this script, so the two cannot drift. Run it as root (or as a user with sudo) from
# any directory; it installs into the `python` on PATH. Idempotent: what is there is kept.
# The third-party tool sources (h2spec, etcd's benchmark tool) are not installed here: see
# $QS_SHARED_TOOLS in the README ("Third-party tools").
# Usage: scripts/install-test-deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
python=$(command -v python)
as_root() {
  if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

echo "== system packages (etcdctl for compat tests, etcd as the reference server, chromium for the dashboard test,"
echo "   nghttp2-client and Go with h2spec's libraries for the HTTP/2 client tests, Go with etcd's sources and protoc"
echo "   for the queue load generator, PostgreSQL 15 and Debian's Patroni for tests/integration/test_patroni.py,"
echo "   Node.js and npm for tests/compat/test_node_etcd3.py)"
h2spec_go="golang-go golang-github-fatih-color-dev golang-github-spf13-cobra-dev golang-golang-x-net-dev"
# tools/queue-bench (scripts/build_queue_bench.sh, tests/bench/test_queue_tool.py)
queue_bench_go="golang-etcd-server-dev golang-github-google-uuid-dev protobuf-compiler golang-goprotobuf-dev"
# tests/integration/test_patroni.py: Patroni 3.0.2 with python3-psycopg2 and python3-etcd (Patroni 4.x
# below runs on these too), run by Debian's python3 as an unprivileged user, as PostgreSQL must be
patroni_deb="postgresql-15 patroni python3-psycopg2 python3-etcd"
# Debian's nodejs and npm only where there is no npm: NodeSource's nodejs ships its own npm and
# conflicts with Debian's npm package (`nodejs : Conflicts: npm`).
node_deb=""
command -v npm >/dev/null || node_deb="nodejs npm"
if ! command -v etcdctl >/dev/null || ! command -v etcd >/dev/null || ! command -v chromium >/dev/null \
  || ! command -v nghttp >/dev/null || ! command -v go >/dev/null || [[ ! -d /usr/share/gocode/src/github.com/fatih/color ]] \
  || ! command -v protoc-gen-go >/dev/null || [[ ! -d /usr/share/gocode/src/go.etcd.io/etcd/etcdserver/etcdserverpb ]] \
  || [[ ! -x /usr/bin/patroni || ! -x /usr/lib/postgresql/15/bin/postgres ]] || [[ -n $node_deb ]]; then
  as_root apt-get update -qq
  # shellcheck disable=SC2086 # the lists are words
  as_root apt-get install -y -qq etcd-client etcd-server chromium nghttp2-client $h2spec_go $queue_bench_go \
    $patroni_deb $node_deb >/dev/null
fi
etcdctl version | sed -n 1p
etcd --version | sed -n 1p

echo "== python packages"
"$python" -m pip install -q --disable-pip-version-check -e '.[test]'
# Patroni 4.x (nested txns, raft_term checks) for tests/integration/test_patroni.py: pure Python, outside
# /root so the unprivileged user that runs PostgreSQL can read it; its dependencies are Debian's (above).
PATRONI4=4.1.5
if ! grep -qs "'$PATRONI4'" /usr/local/lib/qs-patroni4/patroni/version.py; then
  as_root rm -rf /usr/local/lib/qs-patroni4
  as_root "$python" -m pip install -q --disable-pip-version-check --no-deps --target /usr/local/lib/qs-patroni4 \
    "patroni==$PATRONI4"
fi

echo "== node packages (the npm etcd3 client for tests/compat/test_node_etcd3.py)"
(cd tests/compat/node && npm ci --no-audit --no-fund --silent)
