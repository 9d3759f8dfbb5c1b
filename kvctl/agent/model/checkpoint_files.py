"""Reading a checkpoint directory's JSON files: one place that turns a missing, oversized or
broken file into one `CheckpointError` line naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvctl.agent.model.errors import CheckpointError
from kvctl.units import format_bytes

# config.json, generation_config.json and shard indexes are kilobytes, tokenizer_config.json at
# most a few megabytes; a larger file is not one of them and is not read into memory.
MAX_JSON_BYTES = 64 << 20


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
        with file.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            data = b"" if size > MAX_JSON_BYTES else handle.read(size + 1)
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    if size > MAX_JSON_BYTES or len(data) > MAX_JSON_BYTES:
        raise CheckpointError(
            f"{name}: over {format_bytes(MAX_JSON_BYTES)}, too large for a checkpoint's JSON file"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise CheckpointError(f"{name}: invalid JSON ({' '.join(str(exc).split())})") from exc
