#!/usr/bin/env bash
# The GPU check, one command on any machine with CUDA and its own PyTorch (no package index
# needed: gradsync is taken from ./src). About 8 minutes on an H100:
#   1. the GPU tier (tests/test_gpu.py: wrap, the DDP hook, FSDP2 and gradsync train on CUDA,
#      host synchronizations per step counted with torch.cuda.set_sync_debug_mode);
#   2. the codec table on CUDA (scripts/gpu_codec_table.py: every selection and quantization
#      codec, with and without error feedback, against torch.topk and the copy floor, 2^20..2^26);
#   3. the main job on one GPU.
# Results go to $OUT (default /tmp/gpucheck-out) with the device, torch and CUDA versions; copy
# them to docs/results/gpu/. `scripts/gpu_check.sh cluster` instead runs the emulated 4x1 cluster
# (root, ip and tc), meant for a machine with a core per rank (8 or more).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpucheck-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

if [ "${1:-}" = "cluster" ]; then
  log "4. emulated 4x1 at 250 Mbit/s on $(nproc) cores, 420 s at most"
  command -v ip >/dev/null && command -v tc >/dev/null || { log "no ip/tc on this machine: skipped"; exit 0; }
  timeout 420 python3 -m gradsync bench whatif --emulate 4x1 --link 250mbit --model vgg --batch-size 16 \
      --rounds 2 --contenders local,ddp,ddp-powersgd:rank=1,hitopk:density=0.01,powersgd:rank=4,auto \
      --json "$OUT/whatif-4x1-250mbit.json" 2>&1 | tail -n 30 | tee "$OUT/whatif.log"
  tail -n 12 "$OUT/whatif.log" >> "$OUT/summary.txt"
  exit 0
fi

log "machine"
{ nvidia-smi -L; nproc
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  python3 -c "import gradsync; print('gradsync from', gradsync.__file__)"; } 2>&1 | tee -a "$OUT/summary.txt"

log "1. the GPU tier (tests/test_gpu.py), 240 s at most"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tier.log" | tail -n 25
tail -n 3 "$OUT/gpu-tier.log" >> "$OUT/summary.txt"

log "2. the codec table on CUDA, 150 s at most"
timeout 150 python3 scripts/gpu_codec_table.py "$OUT/gpu-codecs.json" 2>&1 | tee "$OUT/gpu-codecs.log" | tail -n 80
grep -cE "ERROR" "$OUT/gpu-codecs.log" | sed 's/^/codec errors: /' >> "$OUT/summary.txt"

log "3. the main job on one GPU, 120 s at most"
timeout 120 python3 -m gradsync train --nproc 1 --epochs 3 --scheme chunktopk:density=0.01 \
    --json "$OUT/train-cuda.json" 2>&1 | tail -n 25 | tee "$OUT/train-cuda.log"
tail -n 4 "$OUT/train-cuda.log" >> "$OUT/summary.txt"

log "done; files in $OUT"
