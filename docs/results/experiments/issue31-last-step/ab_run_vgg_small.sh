#!/bin/bash
# As ab_run.sh, on 4 x 1 at 100 Mbit/s with vgg-small (batch 32), three rounds per run:
#   ./ab_run_vgg_small.sh 4x1-100mbit-vgg-small "local,ddp-powersgd:rank=1,powersgd:rank=1,auto"
tag=$1; shift
here=$(cd "$(dirname "$0")" && pwd); new=$(cd "$here/../../../.." && pwd)/src
for r in ${ROUNDS:-1 2 3}; do
  for v in old new; do
    if [ $v = old ]; then pp=${OLD:-/tmp/old}/src; else pp=$new; fi
    (cd /tmp && PYTHONPATH=$pp timeout 900 python -m gradsync bench train --emulate 4x1 --link 100mbit \
      --model vgg-small --batch-size 32 --contenders "$@" --rounds 3 \
      --json "$here/ab/$tag-$v-$r.json" > "$here/ab/$tag-$v-$r.log" 2>&1)
    echo "$v $r rc=$?"
  done
done
