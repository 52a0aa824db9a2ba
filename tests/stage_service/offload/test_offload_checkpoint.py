"""Direct-checkpoint mmap plan: accepted only when proven, otherwise the ordinary loader runs
before the model is touched, and the reason is logged."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs
from torch import nn

from stagemesh.stage_service.offload import load_or_fallback
from stagemesh.weight_store.checkpoint import CheckpointError, map_tensors, read_index


class _Net(nn.Module):
    """Blocks, a persistent buffer, a non-persistent buffer and a post-load hook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("freqs", torch.arange(8.0) / 8, persistent=False)
        self.hooked = 0
        self.register_load_state_dict_post_hook(lambda module, keys: module._count())
        self.post_loaded = False

    def _count(self) -> None:
        self.hooked += 1

    def post_load_weights(self) -> None:
        self.post_loaded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) * self.scale + self.freqs
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"net.{k}": v.clone() for k, v in _Net().state_dict().items()}


def _write(tmp_path: Path, state: dict[str, torch.Tensor], name: str = "model") -> Path:
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def _mapping(ptr: int) -> tuple[str, str | None] | None:
    """(permissions, file) of the mapping that holds address `ptr` in this process."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= ptr < hi:
            return perms, rest[-1] if len(rest) >= 4 else None
    return None


def test_good_checkpoint_is_mapped_not_copied(tmp_path: Path):
    state = _state()
    path = _write(tmp_path, state)
    net = _Net()
    called = []
    reason = load_or_fallback([path], {"net.": net}, lambda: called.append(1))
    assert reason is None and not called
    for name, t in net.state_dict().items():
        assert torch.equal(t, state[f"net.{name}"])
        # A view of the file mapping, read-only and shared: the page cache itself, which can be
        # page-locked in place (a private mapping would be copied page by page first).
        assert _mapping(t.data_ptr()) == ("r--s", str(path)), name
    # Restored non-persistent buffer, post-load hook and post_load_weights all ran.
    assert torch.equal(net.freqs, torch.arange(8.0) / 8)
    assert net.hooked == 1 and net.post_loaded
    reference = _Net()
    reference.load_state_dict({k[4:]: v for k, v in state.items()})
    x = torch.randn(2, 6)
    assert torch.equal(net(x), reference(x))


def test_sharded_checkpoint_over_several_files(tmp_path: Path):
    state = _state()
    names = sorted(state)
    files = [
        _write(tmp_path, {k: state[k] for k in names[:3]}, "a"),
        _write(tmp_path, {k: state[k] for k in names[3:]}, "b"),
    ]
    net = _Net()
    assert load_or_fallback(files, {"net.": net}, lambda: None) is None
    assert {_mapping(t.data_ptr()) for t in net.state_dict().values()} == {("r--s", str(f)) for f in files}


def _drop(state):
    state.pop("net.blocks.1.bias")


def _reshape(state):
    state["net.blocks.2.weight"] = torch.zeros(8, 9)


def _retype(state):
    state["net.embed.bias"] = state["net.embed.bias"].half()


def _extra(state):
    state["text_encoder.weight"] = torch.zeros(2)


@pytest.mark.parametrize(
    "change,needle",
    [
        (_drop, "missing tensor(s) net.blocks.1.bias"),
        (_reshape, "net.blocks.2.weight: shape (8, 9)"),
        (_retype, "net.embed.bias: dtype torch.float16"),
        (_extra, "no planned module owns: text_encoder.weight"),
    ],
)
def test_refused_plans_fall_back_before_touching_the_model(tmp_path: Path, change, needle):
    state = _state()
    change(state)
    path = _write(tmp_path, state)
    net = _Net()
    before = {k: (v, v.data_ptr(), v.clone()) for k, v in net.state_dict(keep_vars=True).items()}
    seen_during_fallback = []

    def fallback() -> None:
        # The ordinary loader gets the model exactly as it was.
        seen_during_fallback.extend(
            k
            for k, v in net.state_dict(keep_vars=True).items()
            if v is before[k][0] and v.data_ptr() == before[k][1] and torch.equal(v, before[k][2])
        )

    with capture_logs() as logs:
        reason = load_or_fallback([path], {"net.": net}, fallback)
    assert reason is not None and needle in reason
    assert sorted(seen_during_fallback) == sorted(before)
    assert any(e.get("reason") == reason and e["log_level"] == "warning" for e in logs)


def test_tensor_parallel_and_unreadable_files_fall_back(tmp_path: Path):
    path = _write(tmp_path, _state())
    calls = []
    reason = load_or_fallback([path], {"net.": _Net()}, lambda: calls.append(1), tp_size=2)
    assert "TP1 only" in reason and calls == [1]
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 16)
    assert "header length" in load_or_fallback([broken], {"net.": _Net()}, lambda: calls.append(1))
    missing = load_or_fallback([tmp_path / "absent.safetensors"], {"net.": _Net()}, lambda: calls.append(1))
    assert "unreadable" in missing and calls == [1, 1, 1]


def test_meta_non_persistent_buffers_and_load_callbacks_fall_back(tmp_path: Path):
    path = _write(tmp_path, _state())
    with torch.device("meta"):
        meta_net = _Net()
    assert "no value to restore" in load_or_fallback([path], {"net.": meta_net}, lambda: None)

    class Fused(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):  # a loader that rewrites tensors
            return super()._load_from_state_dict(*args, **kwargs)

    net = _Net()
    net.embed = Fused(6, 8)
    assert "load callback" in load_or_fallback([path], {"net.": net}, lambda: None)


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_one_header_reader_serves_the_plan_and_sleep(tmp_path: Path):
    """stagemesh.weight_store.checkpoint.read_index is the only safetensors header reader: it checks the
    header against the file, and the plan refuses what it refuses."""
    state = _state()
    path = _write(tmp_path, state)
    index = read_index(path, validate=True)
    mapped = map_tensors(path)
    assert set(index) == set(mapped) == set(state)
    for name, t in state.items():
        r = index[name]
        assert (r.path, r.dtype, r.shape, r.nbytes) == (path, t.dtype, tuple(t.shape), t.numel() * t.element_size())
        assert torch.equal(mapped[name], t)
    # 12 bytes for a float32 [2] tensor: the offsets disagree with shape and dtype.
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}
    bad = _raw_safetensors(tmp_path / "bad.safetensors", {"net.embed.bias": entry}, bytes(12))
    with pytest.raises(CheckpointError, match="inconsistent data offsets"):
        read_index(bad)
    reason = load_or_fallback([bad], {"net.": _Net()}, lambda: None)
    assert "inconsistent data offsets" in reason
    # The data would run past the end of the file.
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    short = _raw_safetensors(tmp_path / "short.safetensors", {"x": entry}, bytes(8))
    assert "inconsistent data offsets" in load_or_fallback([short], {"net.": _Net()}, lambda: None)
