"""The images of one Generate arrive as separate requests of one request id, announced with their
count (core.rpc.IMAGES_HEADER). Dispatched as they come, the first would run alone and the next
behind it (a worker holds two batches), so a request of four images would take three passes; held
back until its images have arrived (briefly: at most GROUP_WAIT_S), they share one batch."""

from __future__ import annotations

from collections.abc import Iterable

from stagemesh.stage_service.engine.request import StageRequest

# Longest a request waits for the rest of its images (they are sent at once: they usually arrive
# within a millisecond, or a few on a busy host).
GROUP_WAIT_S = 0.02


class ImageGroups:
    def __init__(self) -> None:
        # (request id, images) -> [arrived, still running]; an entry lives while one of them does.
        self._groups: dict[tuple[str, int], list[int]] = {}

    @staticmethod
    def _key(req: StageRequest) -> tuple[str, int]:
        return req.request_id, req.images

    def join(self, req: StageRequest) -> None:
        if req.images > 1:
            counts = self._groups.setdefault(self._key(req), [0, 0])
            counts[0] += 1
            counts[1] += 1

    def leave(self, req: StageRequest) -> None:
        counts = self._groups.get(self._key(req)) if req.images > 1 else None
        if counts is not None:
            counts[1] -= 1
            if counts[1] <= 0:
                del self._groups[self._key(req)]

    def hold_for(self, head: StageRequest, waiting: Iterable[StageRequest], max_batch: int, now: float) -> float:
        """Seconds to hold `head` back so that more of its images can join its batch; 0: go now
        (it has no images to wait for, they have all arrived, a batch of them is full, or it
        has waited GROUP_WAIT_S already)."""
        if head.images <= 1 or self._groups.get(self._key(head), [head.images])[0] >= head.images:
            return 0.0
        mates = sum(1 for r in waiting if self._key(r) == self._key(head))
        if mates >= max_batch:
            return 0.0
        return max(0.0, head.arrived + GROUP_WAIT_S - now)
