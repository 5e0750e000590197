#!/bin/sh
# Run a command with its disk reads capped by the kernel (cgroup v1 blkio; root):
#   scripts/throttle.sh MBPS FOLDER -- COMMAND ...
# caps reads from the disk behind FOLDER (the offload folder) at MBPS MB/s (10**6 bytes/s) for
# COMMAND and its children, then removes the group (also on failure or a stop signal). Not root,
# no blkio, or FOLDER on no block device: COMMAND runs unthrottled, with a note saying so.
# (flexgen_sparpr/bench/throttle.py; the benchmarks' --throttle-read-mbps does the same in-process.)
set -e
[ $# -ge 3 ] || { echo "usage: scripts/throttle.sh MBPS FOLDER -- COMMAND ..." >&2; exit 2; }
mbps=$1; dir=$2; shift 2
[ "$1" = "--" ] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$here/.venv/bin/python}
exec "$PY" -m flexgen_sparpr.bench.throttle --read-mbps "$mbps" --dir "$dir" -- "$@"
