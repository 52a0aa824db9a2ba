"""A stage's outputs in shared memory (stage_service/transport/relay.py, server._encode_outputs):
large outputs go whole in segments the reader gets back exactly, small ones stay inline, and no
segment outlives a cancelled encoding, a caller that never reads, or the stage."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from stagemesh.core import shared_tensors  # noqa: E402
from stagemesh.stage_service import server  # noqa: E402
from stagemesh.stage_service.transport import relay, tensors  # noqa: E402


def _exists(name: str) -> bool:
    return (shared_tensors.SHM_DIR / name).exists()


def test_large_outputs_go_whole_in_segments_and_small_ones_inline():
    big = torch.randn(600, 1024, dtype=torch.bfloat16)  # 1.2 MB: over the bound
    small = torch.arange(10, dtype=torch.int64)
    messages = server._encode_outputs({"prompt_embeds": big, "ids": small}, "tensor", shared_memory=True)
    outputs = {name: t for m in messages for name, t in m.outputs.items()}
    assert outputs["prompt_embeds"].shm_name and not outputs["prompt_embeds"].data
    assert not outputs["ids"].shm_name and outputs["ids"].data
    assert sum(m.ByteSize() for m in messages) < 1000  # the names, not the bytes
    assert torch.equal(tensors.from_proto(outputs["prompt_embeds"], "inputs[prompt_embeds]"), big)
    assert torch.equal(tensors.from_proto(outputs["ids"]), small)
    assert not _exists(outputs["prompt_embeds"].shm_name)


def test_without_shared_memory_every_output_is_inline():
    big = torch.randn(600, 1024)
    (message,) = server._encode_outputs({"x": big}, "tensor")
    assert not message.outputs["x"].shm_name and len(message.outputs["x"].data) == big.numel() * 4


def test_a_full_dev_shm_sends_the_output_inline(monkeypatch):
    def full(data, owner_pid):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_tensors, "export", full)
    big = torch.randn(600, 1024)
    (message,) = server._encode_outputs({"x": big}, "tensor", shared_memory=True)
    assert not message.outputs["x"].shm_name
    assert torch.equal(tensors.from_proto(message.outputs["x"]), big)


def test_names_nobody_read_are_unlinked_after_a_while_and_at_stop():
    sent = relay.SentSegments(unread_after_s=0.05)
    first = tensors.to_shared_proto(torch.zeros(300_000, dtype=torch.float32), 1).shm_name
    second = tensors.to_shared_proto(torch.zeros(300_000, dtype=torch.float32), 1).shm_name
    sent.sent([first])
    time.sleep(0.1)
    sent.sent([second])  # the first is stale by now
    assert not _exists(first) and _exists(second)
    sent.drop_all()
    assert not _exists(second)


def test_a_cancelled_encoding_unlinks_what_it_still_makes():
    release = threading.Event()
    made: list[str] = []

    def encode(outputs):
        release.wait(5)
        messages = server._encode_outputs(outputs, "tensor", shared_memory=True)
        made.extend(relay.names_in(messages))
        return messages

    async def cancel_midway():
        task = asyncio.ensure_future(relay.encoded(encode, {"x": torch.ones(400_000)}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(100):  # the thread finishes, then its callback unlinks
            await asyncio.sleep(0.02)
            if made and not any(_exists(n) for n in made):
                return
        raise AssertionError(f"left behind: {[n for n in made if _exists(n)]}")

    asyncio.run(cancel_midway())
    assert made
