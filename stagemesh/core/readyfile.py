"""The ready file: how a service started with port 0 tells its supervisor where it listens."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write(path: str | os.PathLike, address: str, metrics: str = "") -> None:
    """`metrics`: the /metrics HTTP address when the service has one (key left out otherwise)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    info = {"address": address, "pid": os.getpid(), **({"metrics": metrics} if metrics else {})}
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)  # readers never see a half-written file


def read(path: str | os.PathLike) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
