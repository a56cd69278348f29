#!/usr/bin/env bash
# cable_beside_compute.py on an emulated 4 x 1 cluster at 250 Mbit/s (root); rank 0's output.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/../on_cluster.sh" 4 250mbit cable-probe "$here/cable_beside_compute.py"
grep round /tmp/cable-probe-0.log
