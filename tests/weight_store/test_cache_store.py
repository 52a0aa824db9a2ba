"""Runtime cache on disk: manifests (parse, validate against the files) and the store (list,
last use, eviction, temp dirs, the root), on real temp dirs."""

from __future__ import annotations

import json
import os

import pytest

from stagemesh.weight_store import store as store_mod
from stagemesh.weight_store.store import CacheStore, Manifest, ManifestError, default_root
from tests.support.cache_entries import KEY_A, KEY_B, dir_bytes, two_shards, write_entry

# --- manifest ---------------------------------------------------------------------------------


def test_manifest_round_trip(populated):
    manifest = populated["manifest"]
    text = manifest.to_json()
    again = Manifest.from_json(text)
    assert again == manifest
    doc = json.loads(text)
    assert doc["schema"] == 1 and doc["key"] == KEY_A
    assert doc["tensors"]["blocks.0.bias"] == {
        "shape": [16],
        "dtype": "BF16",
        "bytes": 32,
        "file": "model-00001-of-00002.safetensors",
    }
    assert set(doc["files"]) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema=2), "schema"),
        (lambda d: d.pop("key"), "key"),
        (lambda d: d.update(created_unix="yesterday"), "created_unix"),
        (lambda d: d["files"].update({"../escape.safetensors": {"size": 1, "sha256": "0" * 64}}), "file name"),
        (lambda d: next(iter(d["files"].values())).update(size=-1), "size"),
        (lambda d: next(iter(d["files"].values())).update(sha256="XYZ"), "sha256"),
        (lambda d: next(iter(d["tensors"].values())).update(shape=[2, "x"]), "shape"),
        (lambda d: next(iter(d["tensors"].values())).update(bytes=True), "bytes"),
    ],
)
def test_manifest_from_json_rejects_malformed(populated, mutate, message):
    doc = json.loads(populated["manifest"].to_json())
    mutate(doc)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(doc))


def test_manifest_from_json_rejects_non_json():
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.from_json("{")


def test_validate_files_accepts_published_entry(populated):
    entry = populated["store"].entry_dir(KEY_A)
    assert populated["manifest"].validate_files(entry) == []


def test_validate_files_detects_size_mismatch(populated):
    entry = populated["store"].entry_dir(KEY_A)
    with open(entry / "model-00002-of-00002.safetensors", "ab") as fh:
        fh.write(b"\0")
    problems = populated["manifest"].validate_files(entry)
    assert len(problems) == 1 and "model-00002-of-00002.safetensors: size" in problems[0]


def test_validate_files_detects_sha_mismatch_of_same_size(populated):
    shard = populated["store"].entry_dir(KEY_A) / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # flip the last tensor byte: same size, different content
    shard.write_bytes(bytes(data))
    problems = populated["manifest"].validate_files(shard.parent)
    assert len(problems) == 1 and "sha256" in problems[0]


def test_validate_files_reports_every_bad_shard_in_name_order(populated):
    # The shards are hashed side by side; the report must not depend on which finishes first.
    entry = populated["store"].entry_dir(KEY_A)
    for shard in sorted(entry.glob("model-*.safetensors")):
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    problems = populated["manifest"].validate_files(entry)
    assert [p.split(":")[0] for p in problems] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert all("sha256" in p for p in problems)


def test_validate_files_detects_missing_and_unlisted_shards(populated):
    entry = populated["store"].entry_dir(KEY_A)
    (entry / "model-00002-of-00002.safetensors").rename(entry / "stray.safetensors")
    problems = populated["manifest"].validate_files(entry)
    assert "model-00002-of-00002.safetensors: missing" in problems
    assert "stray.safetensors: shard not listed in the manifest" in problems


def test_validate_files_checks_tensor_records_against_shard_header(populated):
    manifest = populated["manifest"]
    tensors = dict(manifest.tensors)
    bias = tensors["blocks.0.bias"]
    tensors["blocks.0.bias"] = store_mod.TensorRecord(bias.shape, "F32", bias.nbytes, bias.file)
    tensors["ghost"] = store_mod.TensorRecord((1,), "F32", 4, "model-00002-of-00002.safetensors")
    tensors["orphan"] = store_mod.TensorRecord((1,), "F32", 4, "elsewhere.safetensors")
    lying = Manifest(KEY_A, manifest.files, tensors, manifest.created_unix)
    problems = lying.validate_files(populated["store"].entry_dir(KEY_A))
    assert any("orphan" in p and "not listed" in p for p in problems)
    # Header checks run once every file itself is proven intact.
    lying = Manifest(KEY_A, manifest.files, {k: v for k, v in tensors.items() if k != "orphan"}, 0.0)
    problems = lying.validate_files(populated["store"].entry_dir(KEY_A))
    assert len(problems) == 2
    assert any("blocks.0.bias" in p and "dtype 'BF16'" in p for p in problems)
    assert any("ghost" in p and "not in model-00002-of-00002.safetensors" in p for p in problems)


# --- store --------------------------------------------------------------------------------------


def test_list_entries_reports_valid_and_invalid_entries(populated):
    store = populated["store"]
    entries = store.list_entries()
    assert [e.key for e in entries] == sorted([KEY_A, KEY_B])
    by_key = {e.key: e for e in entries}
    good, bad = by_key[KEY_A], by_key[KEY_B]
    assert good.valid and good.file_count == 2 and good.tensor_count == 3
    assert good.size_bytes == dir_bytes(store.entry_dir(KEY_A))
    assert good.live_consumers == 0
    assert good.last_used_unix == pytest.approx(store.entry_dir(KEY_A).stat().st_mtime)
    assert not bad.valid and bad.tensor_count == 0 and bad.file_count == 1
    assert bad.size_bytes == dir_bytes(store.entry_dir(KEY_B))


def test_last_use_touch_file_moves_last_used(populated):
    store = populated["store"]
    entry = store.entry_dir(KEY_A)
    os.utime(entry, (1_000_000.0, 1_000_000.0))
    (entry / store_mod.LAST_USE_FILE).touch()
    os.utime(entry / store_mod.LAST_USE_FILE, (2_000_000.0, 2_000_000.0))
    os.utime(entry, (1_000_000.0, 1_000_000.0))
    (info,) = [e for e in store.list_entries() if e.key == KEY_A]
    assert info.last_used_unix == 2_000_000.0
    assert info.valid


@pytest.mark.parametrize("bad_key", ["A" * 64, "a" * 63, "g" * 64, "a" * 65])
def test_entry_with_malformed_key_is_invalid(tmp_path, bad_key):
    store = CacheStore(tmp_path)
    write_entry(store.entry_dir(bad_key), bad_key, two_shards())  # manifest agrees with the dir name
    (info,) = store.list_entries()
    assert info.key == bad_key and not info.valid and info.tensor_count == 3


def test_entry_whose_manifest_names_another_key_is_invalid(tmp_path):
    store = CacheStore(tmp_path)
    write_entry(store.entry_dir(KEY_A), KEY_B, two_shards())
    (info,) = store.list_entries()
    assert not info.valid


def test_entry_with_corrupt_manifest_is_invalid(populated):
    store = populated["store"]
    (store.entry_dir(KEY_A) / store_mod.MANIFEST_FILE).write_text('{"schema": 1}')
    stats = store.stats()
    assert stats.invalid_entry_count == 2 and stats.entry_count == 2


def test_stats_count_entries_bytes_and_stale_temp_dirs(populated):
    store = populated["store"]
    stats = store.stats()
    assert stats.root == str(populated["root"])
    assert stats.entry_count == 2
    assert stats.invalid_entry_count == 1
    assert stats.total_bytes == dir_bytes(store.entry_dir(KEY_A)) + dir_bytes(store.entry_dir(KEY_B))
    assert stats.stale_temp_dirs == 2


def test_temp_dir_path_layout(tmp_path):
    path = CacheStore(tmp_path).new_temp_dir_path(KEY_A)
    key, pid, suffix = path.name.split(".")
    assert path.parent == tmp_path / ".tmp" and key == KEY_A and pid == str(os.getpid()) and len(suffix) == 32
    assert not path.exists()


def test_missing_root_is_empty_and_not_created(tmp_path):
    root = tmp_path / "nowhere" / "cache"
    store = CacheStore(root)
    assert store.list_entries() == []
    stats = store.stats()
    assert (stats.entry_count, stats.total_bytes, stats.invalid_entry_count, stats.stale_temp_dirs) == (0, 0, 0, 0)
    assert not (tmp_path / "nowhere").exists()


def test_entry_vanishing_mid_scan_is_skipped(populated, monkeypatch):
    store = populated["store"]
    original = CacheStore._entry_info

    def evict_then_scan(self, path):
        if path.name == KEY_B:
            for child in path.iterdir():
                child.unlink()
            path.rmdir()  # evicted after the layout dir was listed
        return original(self, path)

    monkeypatch.setattr(CacheStore, "_entry_info", evict_then_scan)
    assert [e.key for e in store.list_entries()] == [KEY_A]


def test_ensure_root_creates_and_rejects(tmp_path):
    root = tmp_path / "a" / "b"
    CacheStore(root).ensure_root()
    assert root.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    from stagemesh.core import errors

    with pytest.raises(errors.FailedPrecondition, match="not a directory"):
        CacheStore(blocker).ensure_root()


def test_default_root_ignores_other_cache_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / ".cache" / "stagemesh" / "dlo-runtime-weights"
