#!/usr/bin/env bash
# busy_call_training.py on an emulated N x 1 cluster (root); rank 0's output.
# usage: run_calls.sh NODES RATE [CALLS PAUSE_MS ROUNDS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1 rate=$2
shift 2
bash "$here/../on_cluster.sh" "$nodes" "$rate" call-probe "$here/busy_call_training.py" "$@"
grep round /tmp/call-probe-0.log || tail -20 /tmp/call-probe-0.log
