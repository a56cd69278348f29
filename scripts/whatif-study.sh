#!/usr/bin/env bash
# Paper 02's what-if study redone with gradsync whatif (docs/whatif.md, "Extrapolation").
# Compute: this machine's CPU profiles scaled to an assumed V100 fp32 step (--step-time, below);
# codec costs: docs/results/codec-costs-cpu.json (measured here), scaled by the same ratio.
# Every command is a simulation: the whole script takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
R=docs/results
COSTS=$R/codec-costs-cpu.json
CONTENDERS='paper02,ddp,hierarchical,hitopk:density=0.01,powersgd:rank=4,auto'
declare -A STEP=([resnet50]=100ms [resnet101]=170ms [vgg16]=190ms [bert-base]=350ms)
for model in resnet50 resnet101 vgg16 bert-base; do
  common=(--profile "$R/profile-$model-cpu.json" --step-time "${STEP[$model]}" --codec-costs "$COSTS")
  # scaling factor against the inter-node bandwidth, 8 nodes x 8 GPUs (paper 02, figures 3 and 6)
  gradsync whatif "${common[@]}" --cluster 8x8 --scheme "$CONTENDERS" --sweep inter=1,10,25,100gbit \
    --json "$R/whatif-$model-8x8-inter.json" --markdown "$R/whatif-$model-8x8-inter.md" \
    --png "$R/whatif-$model-8x8-inter.png" >/dev/null
  # against the number of nodes of 8 GPUs at 25 Gbit/s (paper 02, figure 7 at 100 Gbit/s)
  gradsync whatif "${common[@]}" --cluster 2x8 --inter 25gbit --scheme "$CONTENDERS" \
    --sweep nodes=2,4,8,16 --sweep inter=25gbit,100gbit \
    --json "$R/whatif-$model-nodes.json" --markdown "$R/whatif-$model-nodes.md" \
    --png "$R/whatif-$model-nodes.png" >/dev/null
  # against the compression ratio at 10 and 100 Gbit/s (paper 02, figure 8): paper 02's free
  # bandwidth divisor next to hitopk at density 1/R with its real encode cost, once as the
  # planner decides (plan=auto) and once compressing every bucket it may (plan=compress)
  for plan in auto compress; do
    gradsync whatif "${common[@]}" --cluster 8x8 --scheme 'paper02:ratio={ratio},ddp,hitopk:density={density}' \
      --sync-option "plan=$plan" --sweep ratio=2,5,10,100 --sweep inter=10gbit,100gbit \
      --json "$R/whatif-$model-ratio-$plan.json" --markdown "$R/whatif-$model-ratio-$plan.md" \
      --png "$R/whatif-$model-ratio-$plan.png" >/dev/null
  done
done
