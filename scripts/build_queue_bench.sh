#!/usr/bin/env bash
# Build the queue load generator (tools/queue-bench, our own Go code) offline: Debian's Go and
# Debian's packaged Go sources (etcd 3.4.23's etcdserverpb, grpc, golang/protobuf 1.3, google/uuid)
# in GOPATH mode, no module downloads. The CQS stubs are generated from etcdserverpb/cqs.proto
# into the temporary GOPATH with Debian's protoc and protoc-gen-go (golang/protobuf 1.3.5,
# plugins=grpc); nothing generated is written into the repository.
# Usage: scripts/build_queue_bench.sh [OUT]   (default: $TMPDIR/queue-bench)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${TMPDIR:-/tmp}/queue-bench}
need=()
command -v go >/dev/null || need+=(golang-go)
[[ -d /usr/share/gocode/src/go.etcd.io/etcd/etcdserver/etcdserverpb ]] || need+=(golang-etcd-server-dev)
[[ -d /usr/share/gocode/src/github.com/google/uuid ]] || need+=(golang-github-google-uuid-dev)
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v protoc-gen-go >/dev/null || need+=(golang-goprotobuf-dev)
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi
gp=$(mktemp -d)
trap 'rm -rf "$gp"' EXIT
pkg="$gp/src/queuebench"
mkdir -p "$pkg/cqspb"
cp "$repo"/tools/queue-bench/*.go "$pkg/"
# paths=source_relative puts cqs.pb.go in cqspb/ (the .proto has no go_package); the timestamp
# maps to golang/protobuf 1.3's own ptypes, so the stubs use one protobuf runtime.
protoc -I "$repo/etcdserverpb" -I /usr/include \
  --go_out="plugins=grpc,paths=source_relative,Mgoogle/protobuf/timestamp.proto=github.com/golang/protobuf/ptypes/timestamp,Mcqs.proto=queuebench/cqspb:$pkg/cqspb" \
  "$repo/etcdserverpb/cqs.proto"
# Go's own build cache (so a rebuild takes seconds), or a temporary one where there is none.
cache=${GOCACHE:-$(go env GOCACHE 2>/dev/null || true)}
[[ -n "$cache" && "$cache" != off ]] || cache="$gp/cache"
mkdir -p "$(dirname "$out")"
(cd "$pkg" && GO111MODULE=off GOPATH="$gp:/usr/share/gocode" GOCACHE="$cache" go build -o "$out" queuebench)
echo "$out"
