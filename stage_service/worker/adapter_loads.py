"""LoadAdapter on a worker without holding up its batches: the file is read and checked on a
thread while batches run; the main loop adds it to the transformer between two batches (peft's
layers cannot change under a forward pass), then answers the call."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stagemesh.stage_service.models.adapters import AdapterRegistry
from stagemesh.stage_service.models.adapters.registry import Prepared
from stagemesh.stage_service.transport import protocol

ATTACH_OP = "adapter_attach"


class BackgroundLoads:
    """`post`: puts a message on the worker's own request queue (the main loop takes it after the
    batch in flight)."""

    def __init__(self, registry: AdapterRegistry, post: Callable[[Any], None]) -> None:
        self._registry = registry
        self._post = post
        self._outcomes: dict[str, Prepared | Exception] = {}
        self._lock = threading.Lock()

    def start(self, msg: protocol.Control) -> None:
        threading.Thread(target=self._prepare, args=(msg,), name="adapter-load", daemon=True).start()

    def _prepare(self, msg: protocol.Control) -> None:
        outcome: Prepared | Exception
        try:
            outcome = self._registry.prepare(msg.args["name"], msg.args["path"])
        except Exception as exc:  # noqa: BLE001 - answered by the main loop, as the call's outcome
            outcome = exc
        with self._lock:
            self._outcomes[msg.rpc_id] = outcome
        self._post(protocol.Control(msg.rpc_id, ATTACH_OP, {"rpc_id": msg.rpc_id}))

    def attach(self, rpc_id: str) -> list:
        """On the main loop: add what the thread read (or raise what it met)."""
        with self._lock:
            outcome = self._outcomes.pop(rpc_id)
        if isinstance(outcome, Exception):
            raise outcome
        return [self._registry.attach(outcome)]
