#!/usr/bin/env bash
# outer_probe.py on an emulated N x 1 cluster (root); rank 0's output.
# usage: run_outer.sh NODES RATE [CODEC ROUNDS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1 rate=$2
shift 2
bash "$here/../on_cluster.sh" "$nodes" "$rate" outer-probe "$here/outer_probe.py" "$@"
grep -v Warning /tmp/outer-probe-0.log | tail -20
