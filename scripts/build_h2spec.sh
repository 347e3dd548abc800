#!/usr/bin/env bash
# Build h2spec-run (tools/h2spec-run, our driver) against the unmodified h2spec library in
# $QS_SHARED_TOOLS/h2spec/upstream (default ../shared/tools, see scripts/shared_tools.sh and the
# README's "Third-party tools"), offline: Debian's Go and Go packages, GOPATH mode.
# Usage: scripts/build_h2spec.sh OUT   (exits 3, saying so, when the h2spec sources are absent)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?usage: build_h2spec.sh OUT}
upstream="$("$root/scripts/shared_tools.sh")/h2spec/upstream"
if [[ ! -d $upstream ]]; then
  echo "build_h2spec.sh: no h2spec sources at $upstream: set QS_SHARED_TOOLS to the folder" \
    "that holds h2spec/upstream (README, \"Third-party tools\")" >&2
  exit 3
fi
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
