"""The parallel direct loader (models/direct_load.py) and the diffusers components built on meta
and filled by it (diffusers_adapter/direct.py): the same tensors as safetensors' own load and the
same modules as from_pretrained, on real files; a failed read leaves nothing open behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch import nn

from stagemesh.stage_service.models import direct_load
from stagemesh.stage_service.models.diffusers_adapter import open_folder, synthetic
from stagemesh.stage_service.models.diffusers_adapter.direct import load_components
from stagemesh.stage_service.models.diffusers_adapter.loading import component_class
from stagemesh.weight_store.checkpoint import CheckpointError

PIECE = 4096  # small pieces: tensors split across pieces and threads


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(37, 129, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 3, 7, generator=g).to(torch.float16),
        "f32_big": torch.randn(3000, 11, generator=g),  # many pieces
        "i64": torch.arange(-50, 50, dtype=torch.int64),
        "u8": torch.randint(0, 255, (333,), dtype=torch.uint8, generator=g),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("direct-load")]


def test_tensors_equal_safetensors_own_load(tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_file(mixed_tensors(), path)
    got = direct_load.read_tensors([path], "cpu", threads=3, piece_bytes=PIECE)
    assert_same(got, load_file(path))


def test_sharded_checkpoint_reads_every_shard(tmp_path):
    tensors = mixed_tensors()
    names = sorted(tensors)
    shards = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    save_file({n: tensors[n] for n in names[:4]}, shards[0])
    save_file({n: tensors[n] for n in names[4:]}, shards[1])
    got = direct_load.read_tensors(shards, "cpu", threads=4, piece_bytes=PIECE)
    assert_same(got, {**load_file(shards[0]), **load_file(shards[1])})


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="'w' is also stored in"):
        direct_load.read_tensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # one tensor under two names


def test_tied_weights_read_as_safetensors_stores_them(tmp_path):
    """save_model keeps one name of a tied pair; the reader gives what load_file gives, and
    loading it back (as safetensors' load_model does) restores the tie."""
    torch.manual_seed(0)
    model, path = Tied(), tmp_path / "tied.safetensors"
    save_model(model, str(path))
    got = direct_load.read_tensors([path], "cpu", piece_bytes=PIECE)
    assert_same(got, load_file(path))
    fresh = Tied()
    missing, unexpected = fresh.load_state_dict(got, strict=False)
    assert not unexpected and len(missing) <= 1
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_a_short_file_fails_the_load_and_leaves_nothing_open(tmp_path):
    path = tmp_path / "short.safetensors"
    save_file(mixed_tensors(), path)
    size = path.stat().st_size
    records = direct_load.records_of([path])  # read before the file is cut, as a racing writer would
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    before = open_fds()
    with pytest.raises(CheckpointError, match="file ended at byte"):
        direct_load.read_tensors((), "cpu", threads=4, piece_bytes=PIECE, records=records)
    assert open_fds() == before
    assert loader_threads() == []


def test_a_missing_file_fails_with_its_path_and_leaves_nothing_open(tmp_path):
    path = tmp_path / "gone.safetensors"
    save_file(mixed_tensors(), path)
    records = direct_load.records_of([path])
    path.unlink()
    before = open_fds()
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        direct_load.read_tensors((), "cpu", threads=2, piece_bytes=PIECE, records=records)
    assert open_fds() == before
    assert loader_threads() == []


@pytest.fixture(scope="module")
def flux_bf16(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return synthetic.write_pipeline(
        tmp_path_factory.mktemp("flux") / "f", "FluxPipeline", synthetic.flux_components(), torch.bfloat16
    )


def from_pretrained(folder: Path, name: str, dtype: torch.dtype) -> nn.Module:
    cls = component_class(open_folder(folder), name)
    return cls.from_pretrained(folder / name, local_files_only=True, torch_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_components_equal_from_pretrained(flux_bf16, dtype):
    """The transformer and the VAE built on meta and read together hold exactly what
    from_pretrained gives (float32 asked of a bf16 checkpoint: cast as from_pretrained casts)."""
    folder = open_folder(flux_bf16)
    loaded = load_components(folder, ["transformer", "vae"], "cpu", dtype, threads=3)
    for name, module in loaded.items():
        reference = from_pretrained(flux_bf16, name, dtype)
        assert_same(module.state_dict(), reference.state_dict())
        assert not module.training and not any(p.requires_grad for p in module.parameters())
        assert dict(module.config) == dict(reference.config)


def test_sharded_component_equals_from_pretrained(tmp_path):
    torch.manual_seed(1)
    transformer = synthetic.flux_components()["transformer"]
    transformer.save_pretrained(tmp_path / "transformer", max_shard_size="20KB")
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 2
    folder = synthetic.write_tiny(tmp_path / "f", "flux")
    for f in (folder / "transformer").iterdir():
        f.unlink()
    for f in (tmp_path / "transformer").iterdir():
        (folder / "transformer" / f.name).write_bytes(f.read_bytes())
    loaded = load_components(open_folder(folder), ["transformer"], "cpu", torch.float32)
    assert_same(loaded["transformer"].state_dict(), transformer.state_dict())


def test_a_checkpoint_that_does_not_fit_goes_through_from_pretrained(tmp_path, capsys):
    """An extra tensor in the VAE's file: not loadable exactly on meta, so from_pretrained loads
    it (which ignores the extra name) and the log names the reason."""
    folder = synthetic.write_tiny(tmp_path / "f", "flux")
    file = folder / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    save_file({**tensors, "not_in_the_model": torch.zeros(3)}, file)
    loaded = load_components(open_folder(folder), ["vae"], "cpu", torch.float32)
    assert_same(loaded["vae"].state_dict(), tensors)
    logged = capsys.readouterr()
    assert "component loaded by from_pretrained, not directly" in logged.out + logged.err
