#!/usr/bin/env bash
# outer_probe.py on an emulated N x 1 cluster (root); rank 0's output.
# usage: run_outer.sh NODES RATE [CODEC ROUNDS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1 rate=$2; shift 2
gradsync cluster up --nodes "$nodes" --rate "$rate" > /dev/null
trap 'gradsync cluster down > /dev/null' EXIT
for i in $(seq 0 $((nodes - 1))); do
  GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec gs-n$i python -m torch.distributed.run \
    --nnodes="$nodes" --nproc-per-node=1 --node-rank="$i" --master-addr=10.78.0.1 --master-port=29543 \
    "$here/outer_probe.py" "$@" > "/tmp/outer-probe-$i.log" 2>&1 &
done
wait
grep -v Warning /tmp/outer-probe-0.log | tail -20
