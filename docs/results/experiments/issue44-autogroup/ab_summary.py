"""Per contender and autogroup setting: the measured steps over the rounds of ab.sh and the
prediction errors (each launch predicts from its own profile and calibration)."""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "ab")
steps: dict[tuple[str, str], list[float]] = defaultdict(list)
errors: dict[tuple[str, str], list[float]] = defaultdict(list)
for path in sorted(here.glob("autogroup*-round*.json")):
    result = json.loads(path.read_text())
    setting = path.name.removeprefix("autogroup")[0]  # the switch ab.sh set: autogroup<0|1>-round<n>
    for row in result["rows"]:
        steps[(row["contender"], setting)].append(row["measured_ms"])
        errors[(row["contender"], setting)].append(100 * row["error"])
print("| contender | autogroups | measured ms (rounds) | median | prediction error (rounds) |")
print("|---|---|---|---|---|")
for (name, setting), ms in sorted(steps.items()):
    errs = errors[(name, setting)]
    print(
        f"| {name} | {'on' if setting == '1' else 'off'} | {', '.join(f'{m:.0f}' for m in ms)} "
        f"| {statistics.median(ms):.1f} | {', '.join(f'{e:+.1f} %' for e in errs)} |"
    )
