#!/usr/bin/env bash
# Run one probe script on every node of an emulated N x 1 cluster (root), one rank per node,
# each rank's output in /tmp/NAME-N.log; the cluster is taken down on exit.
# usage: on_cluster.sh NODES RATE NAME SCRIPT [ARGS...]
set -u
nodes=$1 rate=$2 name=$3 script=$4
shift 4
gradsync cluster up --nodes "$nodes" --rate "$rate" > /dev/null
trap 'gradsync cluster down > /dev/null' EXIT
for i in $(seq 0 $((nodes - 1))); do
  GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec gs-n$i python -m torch.distributed.run \
    --nnodes="$nodes" --nproc-per-node=1 --node-rank="$i" --master-addr=10.78.0.1 --master-port=29543 \
    "$script" "$@" > "/tmp/$name-$i.log" 2>&1 &
done
wait
