"""Where every benchmark's result goes: JSON (everything) and a markdown table, where asked."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any


def pick_names(text: str, allowed: Iterable[str], option: str) -> list[str]:
    """A comma-separated option value as names, each one of ``allowed`` (a ValueError naming
    ``option`` and the allowed names otherwise)."""
    allowed = list(allowed)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in allowed for n in names):
        raise ValueError(f"{option} takes names from {', '.join(allowed)}, got {text!r}")
    return names


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; a ``|`` inside a cell (``auto:candidates=a|b``) is escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(columns), "|" + "---|" * len(columns), *(line(r) for r in rows)]) + "\n"


def save_result(
    result: dict[str, Any], json_path: str | None, markdown_path: str | None, markdown_text: str
) -> None:
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(markdown_text)
