"""The ready file: how a service started with port 0 tells its supervisor where it listens."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write(path: str | os.PathLike, address: str, metrics: str = "", health: str = "", **more: str) -> None:
    """`metrics`: the /metrics HTTP address, `health`: the plaintext health port's address, when
    the service has one; `more`: further addresses (the gateway's `http`). Empty ones are left out."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    extra = {key: value for key, value in {"metrics": metrics, "health": health, **more}.items() if value}
    info = {"address": address, "pid": os.getpid(), **extra}
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)  # readers never see a half-written file


def read(path: str | os.PathLike) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
