"""The runtime-weight cache wired into DLO (docs/DLO.md): engines whose weights went through
the ordinary loader share one published copy; a later start maps it without loading.

Real worker processes (Executor) and real gloo TP ranks; the cache runs its local lock protocol
(no cache service configured), which is the same flock the service takes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stagemesh.core.params import Params
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.runners import DiffusionRunner, WorkItem, build_runner
from stagemesh.stage_service.models.runtime_weights import DitWeightCache, LayoutMismatch, final_tensors, swap_storage
from stagemesh.stage_service.models.weights import load_dit
from stagemesh.stage_service.settings import DloOptions, StageSettings
from stagemesh.weight_store import locks

TOLERANCE = 1e-6  # TP=2 vs TP=1 rounding, see tests/stage_service/test_tensor_parallel.py


def _opts(root: Path, **kw) -> dict:
    return {
        "enable_dlo": True,
        "dlo_use_allgather": False,
        "dlo_enable_runtime_cache": True,
        "dlo_checkpoint_mmap": False,
        "dlo_runtime_cache_dir": str(root),
        **kw,
    }


def _stage(stage_id: int, model: Path, dlo: dict) -> StageSettings:
    # batch_invariant off: the stage then samples one request at batch 1, as `want` does, so the
    # images can be compared bit for bit (invariance pads a batch to max_batch_size rows).
    return StageSettings(
        stage_id=stage_id,
        kind="diffusion",
        model_dir=str(model),
        threads=1,
        step_execution=True,
        batch_invariant=False,
        **dlo,
    )


def _items() -> list[WorkItem]:
    cond = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    return [WorkItem("r", Params("p", 64, 48, 3, 4.0, 11, "tensor"), {"hidden_states": cond})]


@pytest.fixture(scope="module")
def want(tiny_model) -> torch.Tensor:
    torch.set_num_threads(1)
    return build_runner("diffusion", tiny_model).run(_items())[0]["image"]


def _layout_entries(root: Path) -> list[Path]:
    """Entries holding weights (not the small checkpoint aliases)."""
    out = []
    for d in sorted((root / "v1").iterdir()):
        manifest = json.loads((d / "manifest.json").read_text())
        if "dit.x_embed.weight" in json.dumps(manifest):
            out.append(d)
    return out


def _in_entry(t: torch.Tensor, entry: Path) -> bool:
    """Whether `t`'s bytes lie in a mapping of a file of `entry` (this process)."""
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(str(entry)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


# ---- in one process ----------------------------------------------------------------------


def test_publish_then_skip_load_hit(tiny_model, want, tmp_path):
    torch.set_num_threads(1)
    started = time.perf_counter()
    first = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path)))
    miss_s = time.perf_counter() - started
    assert first.runtime_cache.reason == "published"
    [entry] = _layout_entries(tmp_path)
    assert _in_entry(first.dit.blocks[0].attn.q.weight, entry)  # streamed from the mapping
    assert _in_entry(first.dit.x_embed.weight, entry)
    assert first.offload.stats().host_mode == "staged"
    assert torch.equal(first.run(_items())[0]["image"], want)

    started = time.perf_counter()
    second = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path)))
    hit_s = time.perf_counter() - started
    assert second.runtime_cache.reason == "skip_load_hit"
    assert second.runtime_cache.key == first.runtime_cache.key
    assert _in_entry(second.dit.blocks[1].mlp[0].weight, entry)
    assert torch.equal(second.run(_items())[0]["image"], want)
    print(
        f"runtime cache start: miss (load + hash + publish) {miss_s * 1e3:.1f} ms, "
        f"skip-load hit {hit_s * 1e3:.1f} ms; logged load_s "
        f"{first.runtime_cache.load_s * 1e3:.1f} / {second.runtime_cache.load_s * 1e3:.1f} ms"
    )


def test_swap_keeps_the_parameter_objects(tiny_model, tmp_path):
    dit, decoder = load_dit(tiny_model)
    parts = {"dit.": dit, "decoder.": decoder}
    before = {n: id(p) for n, p in dit.named_parameters()}
    mapped = {n: t.clone() for n, t in final_tensors(parts).items()}
    swap_storage(parts, mapped)
    assert {n: id(p) for n, p in dit.named_parameters()} == before
    assert dit.x_embed.weight.data_ptr() == mapped["dit.x_embed.weight"].data_ptr()
    # A mismatch changes nothing.
    mapped.pop("dit.x_embed.bias")
    fresh, fresh_dec = load_dit(tiny_model)
    ptr = fresh.x_embed.weight.data_ptr()
    with pytest.raises(Exception, match="names differ"):
        swap_storage({"dit.": fresh, "decoder.": fresh_dec}, mapped)
    assert fresh.x_embed.weight.data_ptr() == ptr


def test_one_changed_byte_gives_a_new_key(tiny_model, tmp_path):
    cache = DitWeightCache(tiny_model, DloOptions(**_opts(tmp_path)), None)
    dit, decoder = load_dit(tiny_model)
    tensors = final_tensors({"dit.": dit, "decoder.": decoder})
    key = cache.layout_key_of(tensors)
    assert cache.layout_key_of(dict(tensors)) == key
    changed = dict(tensors)
    flat = changed["dit.blocks.0.attn.q.weight"].clone()
    flat.view(-1).view(torch.uint8)[5] ^= 1
    changed["dit.blocks.0.attn.q.weight"] = flat
    assert cache.layout_key_of(changed) != key


def test_cache_not_usable_keeps_private_tensors(tiny_model, want, tmp_path):
    root = tmp_path / "root"
    dit, decoder = load_dit(tiny_model)
    cache = DitWeightCache(tiny_model, DloOptions(**_opts(root)), None)
    key = cache.layout_key_of(final_tensors({"dit.": dit, "decoder.": decoder}))
    cache.cache.store.ensure_root()
    held = locks.publication_lock(root, key, 5.0)  # another publisher that never finishes
    try:
        runner = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(root, dlo_runtime_cache_lock_timeout=0.3)))
    finally:
        held.release()
    assert runner.runtime_cache.reason == "lock_timeout" and runner.runtime_cache.entry is None
    assert runner.offload.stats().host_mode == "packed"  # private copies, packed once
    assert torch.equal(runner.run(_items())[0]["image"], want)
    # A root that cannot exist (under a regular file): io_error, same fallback.
    (tmp_path / "file").write_text("x")
    broken = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path / "file" / "root")))
    assert broken.runtime_cache.reason == "io_error"
    assert torch.equal(broken.run(_items())[0]["image"], want)


# ---- stage processes ---------------------------------------------------------------------


def _maps(pid: int, entry: Path) -> bool:
    return str(entry) in Path(f"/proc/{pid}/maps").read_text()


def _image(ex: Executor) -> torch.Tensor:
    _, fut = ex.submit(0, _items())
    return fut.result(120)[0]["image"]


def test_two_stages_with_one_layout_share_one_entry(tiny_model, want, tmp_path):
    stages = [Executor(_stage(i, tiny_model, _opts(tmp_path))) for i in (1, 2)]
    try:
        # Started from this thread: a worker dies with the thread that spawned it (PDEATHSIG).
        for ex in stages:
            ex.start(120)
        [entry] = _layout_entries(tmp_path)
        for ex in stages:
            assert _maps(ex._workers[0].process.pid, entry)
            assert torch.equal(_image(ex), want)
    finally:
        for ex in stages:
            ex.shutdown()


def test_tp_ranks_get_distinct_entries(random_tiny_model, tmp_path):
    want = build_runner("diffusion", random_tiny_model).run(_items())[0]["image"]
    ex = Executor(_stage(1, random_tiny_model, _opts(tmp_path, tensor_parallel_size=2)))
    try:
        ex.start(120)
        entries = _layout_entries(tmp_path)
        assert len(entries) == 2
        pids = [ex._workers[r].process.pid for r in (0, 1)]
        # Each rank maps its own entry and not the other's.
        assert sorted(_maps(pid, e) for pid in pids for e in entries) == [False, False, True, True]
        assert (_image(ex) - want).abs().max().item() <= TOLERANCE
    finally:
        ex.shutdown()


# ---- FP8 streaming ---------------------------------------------------------------------------

FP8_OPTS = {"dlo_stream_dtype": "float8_e4m3fn"}
FP8_WEIGHT = "dit.blocks.0.attn.q.weight"


def _manifest_dtypes(entry: Path) -> dict[str, str]:
    tensors = json.loads((entry / "manifest.json").read_text())["tensors"]
    return {name: t["dtype"] for name, t in tensors.items()}


def test_fp8_entry_holds_the_streamed_form_and_never_serves_the_model_dtype(tiny_model, want, tmp_path):
    torch.set_num_threads(1)
    plain = DloOptions(enable_dlo=True, dlo_use_allgather=False, **FP8_OPTS)
    fp8_want = DiffusionRunner(tiny_model, "cpu", plain).run(_items())[0]["image"]
    assert not torch.equal(fp8_want, want)

    first = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, **FP8_OPTS)))
    assert first.runtime_cache.reason == "published"
    [entry] = _layout_entries(tmp_path)
    dtypes = _manifest_dtypes(entry)
    assert dtypes[FP8_WEIGHT] == "F8_E4M3" and dtypes[FP8_WEIGHT + ".fp8_scale"] == "BF16"
    assert dtypes["dit.blocks.0.attn.q.bias"] == "F32" and dtypes["dit.x_embed.weight"] == "F32"
    assert first.offload.stats().stream_dtype == "float8_e4m3fn"
    # The engine streams the FP8 form straight from the entry (staged on the CPU).
    assert all(_in_entry(src, entry) for src in (t for _, t in first.offload.store.sources[0]))
    assert torch.equal(first.run(_items())[0]["image"], fp8_want)

    second = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, **FP8_OPTS)))
    assert second.runtime_cache.reason == "skip_load_hit" and second.runtime_cache.key == first.runtime_cache.key
    assert torch.equal(second.run(_items())[0]["image"], fp8_want)

    # A request for the model's own dtype gets an entry of its own, with its own key.
    same_dtype = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path)))
    assert same_dtype.runtime_cache.reason == "published"
    assert same_dtype.runtime_cache.key != first.runtime_cache.key
    assert torch.equal(same_dtype.run(_items())[0]["image"], want)
    assert len(_layout_entries(tmp_path)) == 2
    # Resident blocks are not quantised: another layout again.
    resident = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, dlo_resident_layers=1, **FP8_OPTS)))
    assert resident.runtime_cache.key not in (first.runtime_cache.key, same_dtype.runtime_cache.key)
    assert resident.offload.stats().resident_blocks == 1


def test_an_fp8_entry_does_not_fit_a_model_dtype_request(tiny_model, tmp_path):
    """Even under the same key, the checks refuse the other form."""
    fp8_cache = DitWeightCache(tiny_model, DloOptions(**_opts(tmp_path, **FP8_OPTS)), None)
    dit, decoder = load_dit(tiny_model)
    parts = {"dit.": dit, "decoder.": decoder}
    streamed = fp8_cache.streamed_form(final_tensors(parts))
    assert streamed[FP8_WEIGHT].dtype == torch.float8_e4m3fn
    with pytest.raises(LayoutMismatch, match="names differ"):
        swap_storage(parts, streamed)
    without_scales = {k: v for k, v in streamed.items() if not k.endswith(".fp8_scale")}
    with pytest.raises(LayoutMismatch, match=FP8_WEIGHT):
        swap_storage(parts, without_scales)
    plain = final_tensors(parts)
    with pytest.raises(LayoutMismatch):
        swap_storage(parts, plain, fp8_cache.quantized_specs())
    assert dit.blocks[0].attn.q.weight.dtype == torch.float32  # nothing changed
    pairs = swap_storage(parts, streamed, fp8_cache.quantized_specs())
    assert pairs is not None and pairs[FP8_WEIGHT.removeprefix("dit.")][0] is streamed[FP8_WEIGHT]


def test_an_int8_entry_is_its_own_layout_and_serves_int8_only(tiny_model, tmp_path):
    """int8 streaming stores I8 weights with ".int8_scale" scales under a key of its own: an FP8
    entry never serves it, nor it an FP8 stage, and the checks refuse the other 8-bit form."""
    torch.set_num_threads(1)
    int8_opts = {"dlo_stream_dtype": "int8"}
    plain = DloOptions(enable_dlo=True, dlo_use_allgather=False, **int8_opts)
    int8_want = DiffusionRunner(tiny_model, "cpu", plain).run(_items())[0]["image"]
    first = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, **int8_opts)))
    assert first.runtime_cache.reason == "published" and first.offload.stats().stream_dtype == "int8"
    [entry] = _layout_entries(tmp_path)
    dtypes = _manifest_dtypes(entry)
    assert dtypes[FP8_WEIGHT] == "I8" and dtypes[FP8_WEIGHT + ".int8_scale"] == "BF16"
    assert torch.equal(first.run(_items())[0]["image"], int8_want)
    second = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, **int8_opts)))
    assert second.runtime_cache.reason == "skip_load_hit" and torch.equal(second.run(_items())[0]["image"], int8_want)
    fp8 = DiffusionRunner(tiny_model, "cpu", DloOptions(**_opts(tmp_path, **FP8_OPTS)))
    assert fp8.runtime_cache.reason == "published" and fp8.runtime_cache.key != first.runtime_cache.key
    # Under one key the checks still refuse the other 8-bit form.
    int8_cache = DitWeightCache(tiny_model, DloOptions(**_opts(tmp_path, **int8_opts)), None)
    dit, decoder = load_dit(tiny_model)
    parts = {"dit.": dit, "decoder.": decoder}
    fp8_form = DitWeightCache(tiny_model, DloOptions(**_opts(tmp_path, **FP8_OPTS)), None).streamed_form(
        final_tensors(parts)
    )
    with pytest.raises(LayoutMismatch):
        swap_storage(parts, fp8_form, int8_cache.quantized_specs(), torch.int8)
    int8_form = int8_cache.streamed_form(final_tensors(parts))
    pairs = swap_storage(parts, int8_form, int8_cache.quantized_specs(), torch.int8)
    assert pairs is not None and pairs[FP8_WEIGHT.removeprefix("dit.")][0].dtype == torch.int8
