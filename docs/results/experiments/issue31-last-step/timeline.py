"""Where a step's synchronization waits, read from a merged ``gradsync bench train --trace`` file.

Per measured step: when the ranks' backward passes end (mean and last, counted from the first
forward start of the step), when the synchronization ends (the last rank's), and the tail
between the last backward end and the synchronization's end.

    python timeline.py TRACE.json[.gz]
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys


def slices(events: list[dict], rank: int, thread: int) -> list[dict]:
    mine = [e for e in events if e["pid"] == rank and e["tid"] == thread]
    return sorted(mine, key=lambda e: e["ts"])


def main(path: str) -> None:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
        trace = json.load(fh)
    world = trace["otherData"]["world"]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    training = {r: slices(events, r, 1) for r in range(world)}
    forwards = {r: [e for e in training[r] if e["name"] == "forward"] for r in range(world)}
    steps = min(len(f) for f in forwards.values()) - 1
    rows = []
    for i in range(steps):
        start = min(forwards[r][i]["ts"] for r in range(world))
        end = max(forwards[r][i + 1]["ts"] for r in range(world))
        bw_end, sync_end = [], []
        for r in range(world):
            step = [e for e in training[r] if start <= e["ts"] < end]
            bw = [e for e in step if e["name"] == "backward"]
            wait = [e for e in step if e["name"] == "sync wait"]
            if not bw or not wait:
                continue
            bw_end.append((bw[-1]["ts"] + bw[-1]["dur"] - start) / 1e3)
            sync_end.append((wait[-1]["ts"] + wait[-1]["dur"] - start) / 1e3)
        rows.append((statistics.mean(bw_end), max(bw_end), max(sync_end)))
        print(
            f"step {i}: backward ends mean {rows[-1][0]:6.1f} ms, last {rows[-1][1]:6.1f} ms; "
            f"synchronized at {rows[-1][2]:6.1f} ms (tail {rows[-1][2] - rows[-1][1]:6.1f} ms)"
        )
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"median: backward ends mean {med[0]:.1f}, last {med[1]:.1f}; synchronized {med[2]:.1f}; "
        f"tail {statistics.median(r[2] - r[1] for r in rows):.1f} ms"
    )


if __name__ == "__main__":
    main(sys.argv[1])
