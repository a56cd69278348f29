"""Print one measured step of every rank from a merged `bench whatif --trace` file.

    python timeline.py TRACE.json STEP [MIN_MS]

STEP counts the traced steps from 0; times are milliseconds from the first rank's forward pass of
that step; spans shorter than MIN_MS (default 1) are left out, except the step's own phases.
"""

from __future__ import annotations

import json
import sys


def main(path: str, step: int, min_ms: float = 1.0) -> None:
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    ranks = sorted({e["pid"] for e in events if e.get("name") == "forward"})
    forwards = {
        r: sorted((e for e in events if e.get("name") == "forward" and e["pid"] == r), key=lambda e: e["ts"])
        for r in ranks
    }
    t0 = min(forwards[r][step]["ts"] for r in ranks)
    t1 = min((forwards[r][step + 1]["ts"] for r in ranks if len(forwards[r]) > step + 1), default=t0 + 1e6)
    for r in ranks:
        print("--- rank", r)
        spans = [e for e in events if e.get("pid") == r and e.get("ph") == "X" and t0 - 1000 <= e["ts"] < t1]
        for e in sorted(spans, key=lambda e: e["ts"]):
            if e["dur"] / 1e3 >= min_ms or e.get("cat") == "step":
                start, end = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
                print(
                    f"   {e.get('cat', '')[:7]:7s} tid{e.get('tid')} {e['name'][:34]:34s} "
                    f"{start:7.1f} {end:7.1f} ({e['dur'] / 1e3:6.1f})"
                )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
