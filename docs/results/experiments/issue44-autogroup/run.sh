#!/usr/bin/env bash
# The probe on an emulated 4 x 1 cluster at 250 Mbit/s (root), with the scheduler's autogroups
# on and then off, in ROUNDS alternating rounds; one JSON line per run in results.jsonl.
# (kernel.sched_autogroup_enabled, set by hand for each run and put back at the end.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nodes=4
gradsync cluster up --nodes $nodes --rate 250mbit
was=$(cat /proc/sys/kernel/sched_autogroup_enabled)
trap 'echo $was > /proc/sys/kernel/sched_autogroup_enabled; gradsync cluster down' EXIT
: > "$here/results.jsonl"
for round in ${ROUNDS:-1 2}; do
  for setting in 1 0; do
    echo $setting > /proc/sys/kernel/sched_autogroup_enabled
    for i in $(seq 0 $((nodes - 1))); do
      GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec gs-n$i python -m torch.distributed.run \
        --nnodes=$nodes --nproc-per-node=1 --node-rank=$i --master-addr=10.78.0.1 --master-port=29541 \
        "$here/allreduce_beside_compute.py" > "/tmp/autogroup-probe-$i.log" 2>&1 &
    done
    wait
    grep -h '^{' /tmp/autogroup-probe-0.log | sed "s/^{/{\"round\": $round, /" >> "$here/results.jsonl"
  done
done
python - "$here/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"round {r['round']} autogroup {r['autogroup']}: " + ", ".join(
        f"{k} {v['median_ms']:.1f} ms" for k, v in r["summary"].items()))
PY
