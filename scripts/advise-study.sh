#!/usr/bin/env bash
# "Will compression help?" on paper, over the range Agarwal et al. (MLSys 2022) studied: the node
# cable from 1 to 100 Gbit/s and 8 to 1024 GPUs (1 to 128 nodes of 8), for each model of the
# what-if study (docs/whatif.md, "gradsync advise"). Inputs as scripts/whatif-study.sh: this
# machine's CPU profiles scaled to an assumed V100 fp32 step, the codec costs measured here
# (codecs the table lacks are timed here and scaled alike). Every command is a simulation.
set -euo pipefail
cd "$(dirname "$0")/.."
R=docs/results
COSTS=$R/codec-costs-cpu.json
declare -A STEP=([resnet50]=100ms [vgg16]=190ms [bert-base]=350ms)
for model in resnet50 vgg16 bert-base; do
  gradsync advise --profile "$R/profile-$model-cpu.json" --step-time "${STEP[$model]}" --codec-costs "$COSTS" \
    --cluster 8x8 --sweep inter=1,10,25,100gbit --sweep nodes=1,4,16,128 \
    --json "$R/advise-$model.json" --markdown "$R/advise-$model.md" >/dev/null
done
