#!/usr/bin/env bash
# cable_beside_compute.py on an emulated 4 x 1 cluster at 250 Mbit/s (root); rank 0's output.
set -u
here=$(cd "$(dirname "$0")" && pwd)
nodes=4
gradsync cluster up --nodes $nodes --rate 250mbit
trap 'gradsync cluster down' EXIT
for i in $(seq 0 $((nodes - 1))); do
  GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec gs-n$i python -m torch.distributed.run \
    --nnodes=$nodes --nproc-per-node=1 --node-rank=$i --master-addr=10.78.0.1 --master-port=29541 \
    "$here/cable_beside_compute.py" > "/tmp/cable-probe-$i.log" 2>&1 &
done
wait
grep round /tmp/cable-probe-0.log
