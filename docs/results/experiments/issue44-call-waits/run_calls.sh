#!/usr/bin/env bash
# busy_call_training.py on an emulated N x 1 cluster (root); rank 0's output.
# usage: run_calls.sh NODES RATE [CALLS PAUSE_MS ROUNDS]
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=$1 rate=$2
shift 2
gradsync cluster up --nodes "$nodes" --rate "$rate" > /dev/null
trap 'gradsync cluster down > /dev/null' EXIT
for i in $(seq 0 $((nodes - 1))); do
  GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec gs-n$i python -m torch.distributed.run \
    --nnodes="$nodes" --nproc-per-node=1 --node-rank="$i" --master-addr=10.78.0.1 --master-port=29543 \
    "$here/busy_call_training.py" "$@" > "/tmp/call-probe-$i.log" 2>&1 &
done
wait
grep round /tmp/call-probe-0.log || tail -20 /tmp/call-probe-0.log
