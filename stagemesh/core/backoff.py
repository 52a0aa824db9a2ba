"""One restart backoff policy: the delays between attempts, and how many attempts there are.

Used by the stage engine when a worker group restarts and by the supervisor when a child
service restarts, each with its own delays.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    delays: tuple[float, ...]  # seconds to wait after failure k (k = 0, 1, ...); the last one repeats

    def __post_init__(self) -> None:
        assert self.delays and all(d >= 0 for d in self.delays), self.delays

    @property
    def attempts(self) -> int:
        return len(self.delays)

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` earlier failures (capped at the last delay)."""
        return self.delays[min(max(failures, 0), len(self.delays) - 1)]

    def schedule(self) -> Iterator[tuple[int, float]]:
        """(attempt, delay after it if it fails) for each of the bounded attempts, from 1."""
        return enumerate(self.delays, start=1)
