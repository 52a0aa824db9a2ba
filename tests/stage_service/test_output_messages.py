"""A stage's outputs as Execute's messages: within one message when they fit, else each large
tensor (a video's frames) in pieces of whole rows across several, none past the bound, which the
gateway joins back (codec.join_rows) into exactly the tensors the runner returned."""

from __future__ import annotations

import torch

from stagemesh.core import codec
from stagemesh.stage_service import server
from stagemesh.stage_service.transport import tensors


def _joined(messages) -> dict:
    out: dict = {}
    for message in messages:
        for name, piece in message.outputs.items():
            out[name] = codec.join_rows(out.get(name), piece)
    return out


def test_small_outputs_are_one_message():
    outputs = {"image": torch.rand(8, 8, 3), "seed": torch.tensor([3])}
    messages = server._encode_outputs(outputs, "tensor")
    assert len(messages) == 1
    assert _joined(messages) == {name: tensors.to_proto(t) for name, t in outputs.items()}


def test_a_video_past_the_bound_comes_in_pieces_under_it(monkeypatch):
    bound = 4096
    monkeypatch.setattr(server, "OUTPUT_MESSAGE_BYTES", bound)
    outputs = {"video": torch.rand(9, 8, 8, 3), "small": torch.rand(4)}  # 768 bytes a frame
    messages = server._encode_outputs(outputs, "tensor")
    assert len(messages) > 1
    assert all(sum(len(t.data) for t in m.outputs.values()) <= bound for m in messages)
    assert _joined(messages) == {name: tensors.to_proto(t) for name, t in outputs.items()}
