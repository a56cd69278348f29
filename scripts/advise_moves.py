"""What moved between two ``gradsync advise`` studies of one model (for example the CPU-scaled
one in docs/results/ and the one on inputs measured on a GPU): at every point both cover, the
first choice of each and the fastest contender's step, as a markdown table, the points whose
choice moved marked.

    python scripts/advise_moves.py BEFORE.json AFTER.json
"""

from __future__ import annotations

import json
import sys
from typing import Any


def points(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["point"]: a for a in doc["advice"]}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    docs = []
    for path in argv:
        with open(path) as fh:
            docs.append(json.load(fh))
    before, after = (points(d) for d in docs)
    rows = [
        f"Advice on {docs[0].get('profiled_on', '?')} inputs ({argv[0]}) against "
        f"{docs[1].get('profiled_on', '?')} ({argv[1]})",
        "",
        "| point | before: choice (step ms) | after: choice (step ms) | moved |",
        "|---|---|---|---|",
    ]
    moved = 0
    for point in sorted(set(before) & set(after), key=lambda p: (before[p]["nodes"], before[p]["inter_bps"])):
        b, a = before[point], after[point]
        b_ms, a_ms = b["ranking"][0]["step_ms"], a["ranking"][0]["step_ms"]
        changed = b["choice"] != a["choice"]
        moved += changed
        mark = "**yes**" if changed else ""
        rows.append(f"| {point} | {b['choice']} ({b_ms:.1f}) | {a['choice']} ({a_ms:.1f}) | {mark} |")
    rows.append("")
    rows.append(f"{moved} of {len(set(before) & set(after))} first choices moved.")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
