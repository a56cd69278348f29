"""Per stored `bench whatif` result, the effective cores that would make each contender's
prediction equal its measured step (bisection between 1 and 2 cores, every other input as the
result recorded it), next to the cores read from `local` and from the contention probe.

    cd docs/results && python experiments/issue44-fitted-cores/fit_cores.py bench-whatif-4x1-250mbit-ps.json

A contender still predicted slow at 2 cores shows 2.0; one still fast at 1 core shows 1.0."""

import json
import sys
from pathlib import Path

import gradsync.apps.commands.bench.whatif as bench_whatif

CONTENDERS = ("local", "powersgd:rank=4", "hitopk:density=0.01", "auto", "zeroone-adam")


def predicted(stored: dict, cores: float) -> dict[str, tuple[float, float]]:
    bench_whatif.cores_from_local = lambda cont, rows: cores  # every prediction at these cores
    out = bench_whatif.compare(json.loads(json.dumps(stored)))
    return {r["contender"]: (r["predicted_ms"], r["measured_ms"]) for r in out["rows"]}


for path in sys.argv[1:]:
    result = json.loads(Path(path).read_text())
    stored = {k: v for k, v in result.items() if k not in ("rows", "predicted", "summary")}
    cont = result["contention"]
    local = next(m for m in result["measured"] if m["contender"] == "local")["step_ms"]
    fitted = {}
    for name in CONTENDERS:
        if name not in {m["contender"] for m in result["measured"]}:
            continue
        lo, hi = 1.0, 2.0
        for _ in range(12):
            mid = (lo + hi) / 2
            p, m = predicted(stored, mid)[name]
            lo, hi = (mid, hi) if p > m else (lo, mid)
        fitted[name] = round((lo + hi) / 2, 2)
    read = cont["ranks_per_host"] * cont["alone_ms"] / local
    print(f"{path}: from local {read:.2f}, from the probe {cont['effective_cores']:.2f}, fitted {fitted}")
