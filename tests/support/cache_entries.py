"""Runtime-cache entries on disk as a publisher leaves them, for the store and service tests."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from stagemesh.weight_store import store as store_mod
from stagemesh.weight_store.store import CacheStore, Manifest, file_record

KEY_A = "a" * 64
KEY_B = "0123456789abcdef" * 4
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_entry(directory: Path, key: str, shards: dict[str, dict[str, torch.Tensor]]) -> Manifest:
    """A published entry as a publisher would leave it: shards, then a manifest describing them."""
    directory.mkdir(parents=True)
    tensors = {}
    for file_name, shard in shards.items():
        save_file(shard, str(directory / file_name))
        for name, t in shard.items():
            tensors[name] = store_mod.TensorRecord(
                shape=tuple(t.shape), dtype=_DTYPE_NAMES[t.dtype], nbytes=t.numel() * t.element_size(), file=file_name
            )
    files = {name: file_record(directory / name) for name in shards}
    manifest = Manifest(key=key, files=files, tensors=tensors, created_unix=time.time())
    (directory / store_mod.MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def two_shards() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model-00001-of-00002.safetensors": {
            "blocks.0.weight": torch.randn(16, 8, generator=gen),
            "blocks.0.bias": torch.randn(16, generator=gen).to(torch.bfloat16),
        },
        "model-00002-of-00002.safetensors": {"blocks.1.weight": torch.randn(4, 4, generator=gen)},
    }


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def populated_root(root: Path) -> dict:
    """A root with one valid entry, one without a manifest and two stale temp dirs."""
    store = CacheStore(root)
    manifest = write_entry(store.entry_dir(KEY_A), KEY_A, two_shards())
    broken = store.entry_dir(KEY_B)
    broken.mkdir(parents=True)
    save_file({"x": torch.zeros(3)}, str(broken / "model.safetensors"))
    store.new_temp_dir_path(KEY_A).mkdir(parents=True)
    store.new_temp_dir_path(KEY_B).mkdir(parents=True)
    (store.temp_root / "not-a-dir").write_text("")
    for directory in (root, store.layout_dir, store.temp_root):
        directory.chmod(0o700)  # a cache root others can change is refused
    return {"root": root, "store": store, "manifest": manifest}
