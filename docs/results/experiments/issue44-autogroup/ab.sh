#!/usr/bin/env bash
# bench whatif on an emulated 4 x 1 cluster at 250 Mbit/s (root), the scheduler's autogroups on
# and off in alternating rounds on one cluster (kernel.sched_autogroup_enabled, set by hand before
# each launch and put back at the end). One JSON per launch in ab/; summarize with ab_summary.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$here/ab"
gradsync cluster up --nodes 4 --rate 250mbit
was=$(cat /proc/sys/kernel/sched_autogroup_enabled)
trap 'echo $was > /proc/sys/kernel/sched_autogroup_enabled; gradsync cluster down' EXIT
for round in ${ROUNDS:-1 2 3}; do
  for setting in 1 0; do
    echo $setting > /proc/sys/kernel/sched_autogroup_enabled
    gradsync cluster launch --per-node 1 --timeout 900 -- bench whatif --model vgg --batch-size 16 \
      --rounds 1 --contenders "${CONTENDERS:-local,powersgd:rank=4,hitopk:density=0.01}" \
      --json "$here/ab/autogroup$setting-round$round.json" > "$here/ab/autogroup$setting-round$round.log" 2>&1
  done
done
