"""The ready file: how a service started with port 0 tells its supervisor where it listens."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write(path: str | os.PathLike, address: str) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(tmp, target)  # readers never see a half-written file


def read(path: str | os.PathLike) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
