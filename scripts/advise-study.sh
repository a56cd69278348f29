#!/usr/bin/env bash
# "Will compression help?" on paper, over the range Agarwal et al. (MLSys 2022) studied: the node
# cable from 1 to 100 Gbit/s and 8 to 1024 GPUs (1 to 128 nodes of 8), for each model of the
# what-if study (docs/whatif.md, "gradsync advise"). Inputs as scripts/whatif-study.sh: this
# machine's CPU profiles scaled to an assumed V100 fp32 step, the codec costs measured here
# (codecs the table lacks are timed here and scaled alike). Every command is a simulation.
#
# `scripts/advise-study.sh --gpu DIR` runs the same study on inputs measured on a GPU instead (the
# files scripts/gpu_check.sh writes into DIR: profile-resnet50-gpu.json, a profile of ResNet-50
# on that GPU, and codec-costs-gpu.json, the resident codecs timed there): no scaling, and the
# results go to DIR/advise-resnet50-gpu.{json,md} beside the CPU-scaled ones in docs/results/
# (scripts/advise_moves.py lists what moved between the two).
set -euo pipefail
cd "$(dirname "$0")/.."
R=docs/results
if [ "${1:-}" = "--gpu" ]; then
  G=${2:?--gpu needs the directory of the GPU check results}
  gradsync advise --profile "$G/profile-resnet50-gpu.json" --codec-costs "$G/codec-costs-gpu.json" \
    --cluster 8x8 --sweep inter=1,10,25,100gbit --sweep nodes=1,4,16,128 \
    --json "$G/advise-resnet50-gpu.json" --markdown "$G/advise-resnet50-gpu.md" >/dev/null
  python3 scripts/advise_moves.py "$R/advise-resnet50.json" "$G/advise-resnet50-gpu.json" | tee "$G/advise-moves.md"
  exit 0
fi
COSTS=$R/codec-costs-cpu.json
declare -A STEP=([resnet50]=100ms [vgg16]=190ms [bert-base]=350ms)
for model in resnet50 vgg16 bert-base; do
  gradsync advise --profile "$R/profile-$model-cpu.json" --step-time "${STEP[$model]}" --codec-costs "$COSTS" \
    --cluster 8x8 --sweep inter=1,10,25,100gbit --sweep nodes=1,4,16,128 \
    --json "$R/advise-$model.json" --markdown "$R/advise-$model.md" >/dev/null
done
