"""Where a benchmark's figures go: one JSON file in the folder given as --out (made if missing)."""

from __future__ import annotations

import json
import os


def write_json(out: str | None, name: str, obj) -> str | None:
    """Write obj as out/name (indented JSON); nothing when out is empty. Returns the file's path."""
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path
