#!/bin/bash
# Issue 31's before/after (docs/benchmarks.md): the commit the work started from (356f205) and
# this one, alternating in rounds on the emulated cluster (root). "before" runs from a worktree of
# that commit with the kernels built here (the C source is the same):
#   git worktree add /tmp/before 356f205 && cp src/gradsync/_native*.so /tmp/before/src/gradsync/
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ba}; mkdir -p "$OUT"
shape() { # nodes per_node rate model batch contenders tag rounds
  gradsync cluster up --nodes $1 --rate $3 >/dev/null 2>&1
  for r in $(seq 1 $8); do
    for v in before after; do
      if [ $v = before ]; then PP=/tmp/before/src; else PP=; fi
      PYTHONPATH=$PP gradsync cluster launch --per-node $2 -- bench train --model $4 --batch-size $5 \
        --contenders "$6" --rounds 1 --json $OUT/$7-$v-$r.json > $OUT/$7-$v-$r.log 2>&1
      echo "$(date +%T) $7 $v $r rc=$?"
    done
  done
  gradsync cluster down >/dev/null 2>&1
}
shape 2 2 100mbit vgg 16 "local,hitopk:density=0.01,auto" 2x2-100mbit-vgg 3
shape 4 1 100mbit vgg-small 32 "local,ddp-powersgd:rank=1,auto,hitopk:density=0.01" 4x1-100mbit-vgg-small 4
shape 2 1 200mbit vgg 16 "local,hitopk:density=0.01,auto,powersgd:rank=4" 2x1-200mbit-vgg 3
echo done
