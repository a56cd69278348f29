"""Replay stored ``bench whatif`` results with the gradsync on ``PYTHONPATH`` and print, per file,
every contender's error, then per contender the median absolute error over the files (``local``
left out of the totals). With ``--call-wait MS`` every collective that starts while the worker
computes also waits MS milliseconds (``Cpu.busy_call``, the constant instead of the probe's
reading): what one constant per call would need to be to make a shape's contenders right.

    PYTHONPATH=src python replay_errors.py docs/results/bench-whatif-4x1-250mbit-*.json
    PYTHONPATH=src python replay_errors.py --call-wait 5 docs/results/bench-whatif-4x1-250mbit-*.json
"""

import argparse
import json
import statistics

from gradsync.apps.commands.bench.whatif import compare


def short(name: str) -> str:
    if name.startswith("outer"):
        return "outer streamed" if "fragments" in name else "outer"
    return name.split("@")[0]


parser = argparse.ArgumentParser()
parser.add_argument("--call-wait", type=float, default=None)
parser.add_argument("files", nargs="+")
args = parser.parse_args()
per: dict[str, list[float]] = {}
for path in args.files:
    with open(path) as f:
        result = json.load(f)
    if "profile" not in result:
        continue  # stored before results carried their profile: nothing to replay
    if args.call_wait is not None:
        result["contention"]["busy_call_ms"] = [args.call_wait, args.call_wait]
    rows = compare(result, args.call_wait is not None)["rows"]
    print(path.rsplit("/", 1)[-1], " ".join(f"{short(r['contender'])} {100 * r['error']:+.1f}" for r in rows))
    for r in rows:
        if r["contender"] != "local":
            per.setdefault(short(r["contender"]), []).append(abs(r["error"]))
every = [e for v in per.values() for e in v]
print(
    f"all: median absolute error {100 * statistics.median(every):.1f} %, beyond 10 %: "
    f"{sum(e > 0.1 for e in every)} of {len(every)}"
)
for name, errors in per.items():
    print(
        f"  {name:32s} {len(errors):3d} files, median absolute error {100 * statistics.median(errors):5.1f} %"
    )
