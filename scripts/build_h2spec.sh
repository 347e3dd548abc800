#!/usr/bin/env bash
# Build h2spec-run (tools/h2spec-run, our driver) against the unmodified h2spec library in
# ../shared/tools/h2spec/upstream, offline: Debian's Go and Go packages, GOPATH mode.
# Usage: scripts/build_h2spec.sh OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
upstream="$root/../shared/tools/h2spec/upstream"
out=${1:?usage: build_h2spec.sh OUT}
need="golang-go golang-github-fatih-color-dev golang-github-spf13-cobra-dev golang-golang-x-net-dev"
if ! command -v go >/dev/null || [[ ! -d /usr/share/gocode/src/github.com/fatih/color ]]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $need >/dev/null
fi
gp=$(mktemp -d)
trap 'rm -rf "$gp"' EXIT
mkdir -p "$gp/src/github.com/summerwind" "$gp/src/h2spec-run"
cp -r "$upstream" "$gp/src/github.com/summerwind/h2spec"
cp "$root/tools/h2spec-run/main.go" "$gp/src/h2spec-run/"
mkdir -p "$(dirname "$out")"
GO111MODULE=off GOPATH="$gp:/usr/share/gocode" GOCACHE="${GOCACHE:-$gp/cache}" go build -o "$out" h2spec-run
echo "$out"
