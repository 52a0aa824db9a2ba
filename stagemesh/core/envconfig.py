"""Settings read from the environment at each use (so a running service picks up a change)."""

from __future__ import annotations

import math
import os


def positive_seconds(name: str, default: float, warned: set[str], log, event: str) -> float:
    """$name as a positive, finite number of seconds; unset gives `default`. A bad value gives
    `default` and one warning per distinct value (`warned` remembers which were reported)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    if raw not in warned:
        warned.add(raw)
        log.warning(event, variable=name, value=raw, default_s=default)
    return default
