#!/usr/bin/env bash
# trial_probe.py on an emulated N x 1 cluster (root); rank 0's output.
# usage: run_trials.sh NODES RATE [ROUNDS STEPS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1 rate=$2
shift 2
bash "$here/../on_cluster.sh" "$nodes" "$rate" trial-probe "$here/trial_probe.py" "$@"
grep -v Warning /tmp/trial-probe-0.log | tail -20
