#!/usr/bin/env bash
# The GPU check, one command on any machine with CUDA and its own PyTorch (no package index
# needed: gradsync is taken from ./src). At most 6 minutes: every stage runs under its own
# timeout and prints a line before it starts, so a stage that stalls costs its own limit only.
#   1. the GPU tier: tests/test_gpu.py (wrap, the DDP hook, FSDP2 and gradsync train on CUDA; host
#      synchronizations counted; resident codecs replayed as CUDA graphs against their eager
#      path) and tests/test_kernels.py (the fused Triton kernels on CUDA against the references);
#   2. the codec table (scripts/gpu_codec_table.py): every selection and quantization codec,
#      resident as gradsync runs it (replayed graphs) and eager (GRADSYNC_CUDA_GRAPHS=0), with
#      and without error feedback, against torch.topk and the copy floor, 2^20..2^26, k = 1 %;
#   3. codec work in a real step (gradsync bench gpu-step): ResNet-50 at batch 64 under bf16
#      autocast, auto's plan for 4 nodes on 25 Gbit/s and fixed schemes rehearsed in a world of
#      one, beside DDP and DDP's PowerSGD hook;
#   4. planning inputs measured on this GPU: a profile of ResNet-50 and the codec-cost table
#      (resident codecs on this GPU), then the advise study on them (a simulation);
#   5. the main job on one GPU.
# Results go to $OUT (default /tmp/gpucheck-out) with the device, torch and CUDA versions; copy
# them to docs/results/gpu/. `scripts/gpu_check.sh cluster` instead runs the emulated 4x1 cluster
# (root, ip and tc), meant for a machine with a core per rank (8 or more).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpucheck-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
stage() {  # stage SECONDS LOGFILE COMMAND...: run under a timeout, say how it ended
  local limit=$1 file=$2; shift 2
  timeout "$limit" "$@" >"$OUT/$file" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "   stopped at its limit of $limit s" | tee -a "$OUT/summary.txt"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo "   exit status $rc" | tee -a "$OUT/summary.txt"
  return 0
}

if [ "${1:-}" = "cluster" ]; then
  log "4x1 emulated cluster at 250 Mbit/s on $(nproc) cores, 420 s at most"
  for tool in ip tc; do command -v "$tool" >/dev/null || { log "no $tool on this machine: skipped"; exit 0; }; done
  stage 420 whatif.log python3 -m gradsync bench whatif --emulate 4x1 --link 250mbit --model vgg --batch-size 16 \
      --rounds 2 --contenders local,ddp,ddp-powersgd:rank=1,hitopk:density=0.01,powersgd:rank=4,auto \
      --json "$OUT/whatif-4x1-250mbit.json"
  tail -n 12 "$OUT/whatif.log" >> "$OUT/summary.txt"
  exit 0
fi

log "machine"
{ nvidia-smi -L; nproc
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import triton; print('triton', triton.__version__)" || echo "no triton"
  python3 -c "import gradsync; print('gradsync from', gradsync.__file__)"; } 2>&1 | tee -a "$OUT/summary.txt"
git rev-parse HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/summary.txt"

log "1. the GPU tier (tests/test_gpu.py, tests/test_kernels.py), 110 s at most"
stage 110 gpu-tier.log python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py
tail -n 3 "$OUT/gpu-tier.log" | tee -a "$OUT/summary.txt"

log "2. the codec table: resident (replayed) and eager, 45 s at most"
stage 45 gpu-codecs.log python3 scripts/gpu_codec_table.py "$OUT/gpu-codecs.json" --sizes 20,24,26 --reps 10
grep -cE "ERROR" "$OUT/gpu-codecs.log" | sed 's/^/codec errors: /' | tee -a "$OUT/summary.txt"

log "3. codec work in a ResNet-50 step (gradsync bench gpu-step), 60 s at most"
stage 60 gpu-step.log python3 -m gradsync bench gpu-step --model resnet50 --batch-size 64 --autocast bf16 \
    --schemes hitopk:density=0.01,chunktopk:density=0.01,powersgd:rank=4,onebit --auto-link 25gbit \
    --auto-nodes 4 --rounds 3 --warmup 4 --steps 8 --json "$OUT/gpu-step-resnet50.json" \
    --markdown "$OUT/gpu-step-resnet50.md"
tail -n 14 "$OUT/gpu-step.log" >> "$OUT/summary.txt"

log "4. planning inputs on this GPU: profile, codec costs, advise study; 90 s at most"
stage 25 profile.log python3 -m gradsync profile --model resnet50 --batch-size 64 --device cuda --steps 10 \
    --powersgd-hook-ranks 1,4 --out "$OUT/profile-resnet50-gpu.json"
stage 30 codec-costs.log python3 -m gradsync whatif --profile "$OUT/profile-resnet50-gpu.json" --cluster 8x8 \
    --scheme hitopk:density=0.01,powersgd:rank=4,auto --codec-device cuda \
    --save-codec-costs "$OUT/codec-costs-gpu.json"
stage 35 advise.log bash scripts/advise-study.sh --gpu "$OUT"
tail -n 2 "$OUT/codec-costs.log" "$OUT/advise.log" >> "$OUT/summary.txt"

log "5. the main job on one GPU, 30 s at most"
stage 30 train-cuda.log python3 -m gradsync train --nproc 1 --epochs 2 --scheme chunktopk:density=0.01 \
    --json "$OUT/train-cuda.json"
tail -n 4 "$OUT/train-cuda.log" >> "$OUT/summary.txt"

log "done; files in $OUT"
