"""Reading a checkpoint directory's JSON files: one place that turns a missing or broken file
into one `CheckpointError` line naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvctl.agent.model.errors import CheckpointError


def read_json(root: Path, name: str, required: bool) -> Any:
    """The parsed file `root/name`; None when it is absent and not `required`."""
    file = root / name
    if not file.is_file():
        if required:
            raise CheckpointError(
                f"{name}: not found in {root}; a checkpoint directory needs config.json and "
                "*.safetensors"
            )
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{name}: invalid JSON ({exc})") from exc
