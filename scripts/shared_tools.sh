#!/usr/bin/env bash
# Print the folder of the third-party tool sources that the tests and CI build (h2spec's library
# in h2spec/upstream, etcd v3.4.23's benchmark tool in etcd-benchmark/): $QS_SHARED_TOOLS, by
# default ../shared/tools, a relative value taken from the repository root. The folder may not
# exist; callers check for what they need. The same rule for Python: tests/support/shared_tools.py.
# Usage: dir=$(scripts/shared_tools.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd -P)
dir=${QS_SHARED_TOOLS:-../shared/tools}
[[ $dir == /* ]] || dir="$root/$dir"
realpath -m -s "$dir"
