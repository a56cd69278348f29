"""Where every benchmark's result goes: JSON (everything) and a markdown table, where asked."""

from __future__ import annotations

import json
from typing import Any


def save_result(
    result: dict[str, Any], json_path: str | None, markdown_path: str | None, markdown_text: str
) -> None:
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result, fh, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as fh:
            fh.write(markdown_text)
