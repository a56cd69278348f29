#!/bin/sh
# Issue 16: the Transformer LM experiments of docs/benchmarks.md ("The Transformer LM"), one
# `gradsync train` run each (about 3.5 minutes on this 2-core machine). The perplexity is the
# summary's final val_perplexity.
set -e
BASE="--data text --model transformer --epochs 12 --batch-size 32 --seq-len 64 --optimizer sgd \
  --momentum 0.9 --clip-grad 1.0 --weight-decay 0 --plan compress --quiet --nodes 2 --per-node 2"
run() { name=$1; shift; gradsync train $BASE "$@" --json "transformer-$name.json"; }
run dense-lr0125 --scheme none --lr 0.125
run dense-lr025 --scheme none --lr 0.25
run dense-lr1 --scheme none --lr 1.0
run topk-lr025 --scheme allgather/topk:density=0.01 --lr 0.25 --density-schedule exp@1
run topk-exp2 --scheme allgather/topk:density=0.01 --lr 0.5 --density-schedule exp@2
run topk-lr025-exp2 --scheme allgather/topk:density=0.01 --lr 0.25 --density-schedule exp@2
run topk5 --scheme allgather/topk:density=0.05 --lr 0.5 --density-schedule exp@1
run hitopk-exp2 --scheme hitopk:density=0.01 --lr 0.5 --density-schedule exp@2
run dgc-exp2 --scheme dgc:density=0.01+ef:momentum=0.9 --momentum 0 --lr 0.5 --density-schedule exp@2
# top-k at 5 % over 24 epochs (docs/results/experiments/transformer-24-topk5.json)
gradsync train $BASE --epochs 24 --scheme allgather/topk:density=0.05 --lr 0.5 --density-schedule exp@1 \
  --json transformer-24-topk5.json
