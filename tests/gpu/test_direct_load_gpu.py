"""The direct loader's CUDA path (page-locked bounce buffers, one stream per thread): the tensors
on the device equal safetensors' own load, and the diffusers components equal from_pretrained's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagemesh.stage_service.models import direct_load
from stagemesh.stage_service.models.diffusers_adapter import open_folder, synthetic
from stagemesh.stage_service.models.diffusers_adapter.direct import load_components
from stagemesh.stage_service.models.diffusers_adapter.loading import component_class

pytestmark = pytest.mark.gpu


def test_device_tensors_equal_safetensors_own_load(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(300, 1000, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, 5, generator=g),
        "i64": torch.arange(9),
        "scalar": torch.tensor(1.5),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    # Small pieces: each thread cycles through both of its bounce buffers many times.
    got = direct_load.read_tensors([path], "cuda:0", threads=3, piece_bytes=4096)
    want = load_file(path)
    for name, tensor in want.items():
        assert got[name].device.type == "cuda"
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].cpu(), tensor), name


def test_components_on_the_device_equal_from_pretrained(tmp_path):
    torch.manual_seed(0)
    folder = synthetic.write_pipeline(tmp_path / "f", "FluxPipeline", synthetic.flux_components(), torch.bfloat16)
    loaded = load_components(open_folder(folder), ["transformer", "vae"], "cuda:0", torch.bfloat16)
    for name, module in loaded.items():
        cls = component_class(open_folder(folder), name)
        reference = cls.from_pretrained(folder / name, torch_dtype=torch.bfloat16).state_dict()
        for key, tensor in module.state_dict().items():
            assert tensor.device.type == "cuda"
            assert torch.equal(tensor.cpu(), reference[key]), (name, key)
