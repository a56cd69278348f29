#!/bin/bash
# Alternating pairs of runs: the engine before the last-step change (a worktree of 54609e8 at
# $OLD, with the built _native*.so copied into its src/gradsync) and after it (this checkout).
#   git worktree add /tmp/old 54609e8 && cp src/gradsync/_native*.so /tmp/old/src/gradsync/
#   ROUNDS="1 2 3 4 5 6" ./ab_run.sh 2x1 200mbit 2x1-200mbit local,hitopk:density=0.01,powersgd:rank=4,auto
#   ./ab_run.sh 4x1 250mbit 4x1-250mbit local,hitopk:density=0.01,powersgd:rank=4,auto
shape=$1; link=$2; tag=$3; shift 3
here=$(cd "$(dirname "$0")" && pwd); new=$(cd "$here/../../../.." && pwd)/src
for r in ${ROUNDS:-1 2 3}; do
  for v in old new; do
    if [ $v = old ]; then pp=${OLD:-/tmp/old}/src; else pp=$new; fi
    (cd /tmp && PYTHONPATH=$pp timeout 900 python -m gradsync bench train --emulate "$shape" --link "$link" \
      --model vgg --batch-size 16 --contenders "$@" --rounds 1 --steps 10 \
      --json "$here/ab/$tag-$v-$r.json" > "$here/ab/$tag-$v-$r.log" 2>&1)
    echo "$v $r rc=$?"
  done
done
