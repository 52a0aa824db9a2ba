"""Worker side of async output: hand device outputs to a background thread that copies them to
the host on a side stream and packs them, so the main thread can start the next forward pass.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Any

import torch

from stagemesh.core import logs
from stagemesh.stage_service import platform
from stagemesh.stage_service.transport import ipc, protocol

log = logs.get_logger("stagemesh.async_output")

DRAIN_TIMEOUT_S = 10.0


def new_output_id() -> str:
    return uuid.uuid4().hex


class ResultWriter:
    """The worker's result pipe with one writer at a time (main loop and background thread)."""

    def __init__(self, results):
        self._results = results
        self._lock = threading.Lock()

    def put(self, message: Any) -> None:
        with self._lock:
            self._results.put(message)

    def close(self) -> None:
        """Close the pipe once any write in progress is done (before os._exit): each put has
        written its whole message by the time it returns."""
        with self._lock:
            self._results.close()


def copy_to_host(obj: Any, stream: platform.Stream) -> Any:
    """Queue device->host copies of every tensor in `obj` on `stream` (pinned, non-blocking);
    CPU tensors are returned as they are. The caller synchronizes the stream.

    Tensors whose views together cover one device storage (a batch output split into its
    requests' slices) come over as one copy of that storage and stay views of it: one transfer
    and one pinned buffer per batch instead of per request, and the packer judges each slice by
    the batch's storage, as it does on the CPU."""
    whole = {}
    for key, views in covering_groups(_device_tensors(obj)).items():
        raw = storage_bytes(views[0])
        whole[key] = platform.host_buffer_like(raw)
        whole[key].copy_(raw, non_blocking=True)
    return _copy(obj, whole)


def _device_tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _device_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _device_tensors(v)


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def covering_groups(tensors) -> dict[tuple, list[torch.Tensor]]:
    """Storage key -> the tensors viewing it, for each storage that two or more of `tensors`
    share and cover (their view bytes add up to at least its size)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_storage_key(t), []).append(t)
    return {
        key: views
        for key, views in groups.items()
        if len(views) > 1 and sum(v.numel() * v.element_size() for v in views) >= views[0].untyped_storage().nbytes()
    }


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t`, as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def same_view(storage_copy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`'s view (offset, shape, strides, dtype) of a byte-for-byte copy of its storage."""
    return torch.empty(0, dtype=t.dtype).set_(storage_copy.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _copy(obj: Any, whole: dict[tuple, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj
        base = whole.get(_storage_key(obj))
        if base is not None:
            return same_view(base, obj)
        host = platform.host_buffer_like(obj)
        host.copy_(obj, non_blocking=True)
        return host
    if isinstance(obj, dict):
        return {k: _copy(v, whole) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v, whole) for v in obj)
    return obj


class AsyncOutputThread:
    """One daemon thread per worker that turns (outputs, id, event) into OUTPUT_READY messages."""

    def __init__(self, device: str, packer: ipc.Packer, writer: ResultWriter):
        self._stream = platform.Stream(device)
        self._packer = packer
        self._writer = writer
        self._work: queue.Queue = queue.Queue()
        self._in_flight = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="async-output", daemon=True)
        self._thread.start()

    def submit(
        self, output_id: str, outputs: Any, event: platform.DeviceEvent, started: platform.DeviceEvent | None = None
    ) -> None:
        """`event` follows the forward pass that produced `outputs`; a timing `started` event
        before it (with `event` a timing event too) reports that pass's device time."""
        with self._idle:
            self._in_flight += 1
        self._work.put((output_id, outputs, event, started))

    @property
    def in_flight(self) -> int:
        with self._idle:
            return self._in_flight

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until every submitted output has been sent; True at once when idle."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("async output drain timed out", in_flight=self._in_flight, timeout_s=timeout_s)
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(DRAIN_TIMEOUT_S)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            output_id, outputs, event, started = item
            try:
                payload = self._host_payload(outputs, event)
                # Both events are complete: the copy waited for `event`.
                seconds = event.seconds_since(started) if started is not None else 0.0
                self._writer.put(protocol.OutputReady(output_id, payload=payload, compute_seconds=seconds))
            except Exception as exc:
                log.exception("async output failed", output_id=output_id)
                self._send_error(output_id, f"{type(exc).__name__}: {exc}")
            finally:
                del outputs, item
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _host_payload(self, outputs: Any, event: platform.DeviceEvent) -> Any:
        with self._stream.active():
            self._stream.wait_event(event)  # the forward pass that produced `outputs` is done
            host = copy_to_host(outputs, self._stream)
            copied = platform.DeviceEvent(self._stream.device, blocking=True).record(self._stream)
        # Sleep, not spin, until the copies land: this thread waits while the main thread
        # launches the next forward pass, and a spinning wait takes CPU from it (on an SMT host,
        # its core's other half).
        copied.synchronize()
        return self._packer.pack(host)

    def _send_error(self, output_id: str, message: str) -> None:
        try:
            self._writer.put(protocol.OutputReady(output_id, error=message))
        except Exception:
            log.exception("could not report async output failure", output_id=output_id)
