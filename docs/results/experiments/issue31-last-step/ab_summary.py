"""Pairs of ``gradsync bench train`` runs, the engine before (old) and after (new) the last-step
change, read from ``ab/TAG-{old,new}-R.json``: each contender's step per run and old/new per pair.

    python ab_summary.py 2x1
    python ab_summary.py 4x1-100mbit-vgg-small ../issue31-recut/ab   (another experiment's runs)
"""

from __future__ import annotations

import json
import pathlib
import sys


def main(tag: str, folder: str | None = None) -> None:
    here = pathlib.Path(folder) if folder else pathlib.Path(__file__).parent / "ab"
    runs: dict[str, dict[str, list[tuple[float, float | None]]]] = {}
    for version in ("old", "new"):
        for path in sorted(here.glob(f"{tag}-{version}-*.json")):
            rows = json.loads(path.read_text())["rows"]
            for row in rows:
                entry = runs.setdefault(row["contender"], {}).setdefault(version, [])
                entry.append((row["step_ms"], row.get("exposed_ms")))
    for contender, by in runs.items():
        old, new = by.get("old", []), by.get("new", [])
        pairs = [o[0] / n[0] for o, n in zip(old, new, strict=False)]
        ratios = sorted(pairs)
        median = ratios[len(ratios) // 2] if len(ratios) % 2 else sum(ratios[len(ratios) // 2 - 1 :][:2]) / 2
        print(f"{contender}")
        print("  old step ms: " + ", ".join(f"{s:.0f}" for s, _ in old))
        print("  new step ms: " + ", ".join(f"{s:.0f}" for s, _ in new))
        if contender != "local":
            print("  old exposed: " + ", ".join(f"{e:.0f}" for _, e in old if e is not None))
            print("  new exposed: " + ", ".join(f"{e:.0f}" for _, e in new if e is not None))
        print(f"  old/new per pair: {', '.join(f'{r:.3f}' for r in pairs)} (median {median:.3f})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
