#!/usr/bin/env bash
# The outer step gradsync train --outer uses by default (docs/outer-loop.md, "The outer step"):
# the digits default (vgg-small, 12 epochs) on 2 nodes x 2 ranks, dense inside the nodes, the
# nodes meeting every H = 10 inner steps, for several outer learning rates and momenta, next to
# dense training, over seeds 0, 1 and 2 (configurations interleaved within each seed).
# Results: docs/results/outer-step-study/ (one JSON per run, summary.md). About 20 minutes on
# two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/results/outer-step-study}
mkdir -p "$OUT"
declare -A CONFIG=(
  [dense]=""
  [lr0.7-m0.9]="--outer 10 --outer-lr 0.7 --outer-momentum 0.9"
  [lr1.0-m0]="--outer 10 --outer-lr 1.0 --outer-momentum 0"
  [lr1.0-m0.3]="--outer 10 --outer-lr 1.0 --outer-momentum 0.3"
  [lr1.0-m0.5]="--outer 10 --outer-lr 1.0 --outer-momentum 0.5"
  [lr0.7-m0.5]="--outer 10 --outer-lr 0.7 --outer-momentum 0.5"
)
ORDER=(dense lr0.7-m0.9 lr1.0-m0 lr1.0-m0.3 lr1.0-m0.5 lr0.7-m0.5)
for seed in 0 1 2; do
  for name in "${ORDER[@]}"; do
    # shellcheck disable=SC2086  # (the options split on purpose)
    gradsync train --nodes 2 --per-node 2 --scheme none --seed "$seed" --quiet \
      ${CONFIG[$name]} --json "$OUT/$name-seed$seed.json" >"$OUT/$name-seed$seed.log" 2>&1
    echo "seed $seed $name done"
  done
done
python3 - "$OUT" "${ORDER[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
rows = ["| outer step | seed 0 | seed 1 | seed 2 | mean | vs dense (points) |", "|---|---|---|---|---|---|"]
dense = None
for name in names:
    acc = [json.loads((out / f"{name}-seed{s}.json").read_text())["history"][-1]["val_accuracy"] * 100 for s in (0, 1, 2)]
    mean = statistics.mean(acc)
    dense = mean if name == "dense" else dense
    gap = "" if name == "dense" else f"{mean - dense:+.2f}"
    rows.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in acc) + f" | {mean:.2f} | {gap} |")
(out / "summary.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
