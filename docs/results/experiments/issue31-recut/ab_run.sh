#!/bin/bash
# Alternating pairs of runs: the planner before the re-cut (a worktree of 1b8dc5f at $OLD, with
# the built _native*.so copied into its src/gradsync) and after it (this checkout).
#   git worktree add /tmp/old 1b8dc5f && cp src/gradsync/_native*.so /tmp/old/src/gradsync/
#   ROUNDS="1 2 3 4 5 6" ./ab_run.sh 4x1 100mbit vgg-small 32 4x1-100mbit-vgg-small \
#       "local,ddp-powersgd:rank=1,powersgd:rank=1,auto"
# Summary: python ../issue31-last-step/ab_summary.py 4x1-100mbit-vgg-small ab
shape=$1; link=$2; model=$3; batch=$4; tag=$5; shift 5
here=$(cd "$(dirname "$0")" && pwd); new=$(cd "$here/../../../.." && pwd)/src
for r in ${ROUNDS:-1 2 3}; do
  for v in old new; do
    if [ $v = old ]; then pp=${OLD:-/tmp/old}/src; else pp=$new; fi
    (cd /tmp && PYTHONPATH=$pp timeout 900 python -m gradsync bench train --emulate "$shape" --link "$link" \
      --model "$model" --batch-size "$batch" --contenders "$@" --rounds ${RUN_ROUNDS:-3} \
      --json "$here/ab/$tag-$v-$r.json" > "$here/ab/$tag-$v-$r.log" 2>&1)
    echo "$v $r rc=$?"
  done
done
