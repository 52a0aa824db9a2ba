"""LoRA adapters on the diffusers runners in process (tiny random-weight FLUX folder, CPU): under
DLO the adapters' low-rank weights are no part of any streamed block and the image equals the
resident model's; with 8-bit streaming the adapter still applies; the device bound moves the
least recently used adapter out; files and names that cannot be adapters are refused, naming why;
the batch key keeps adapter sets apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stagemesh.core.errors import InvalidArgument
from stagemesh.core.params import AdapterChoice, Limits, Params, resolve
from stagemesh.stage_service.models.contract import WorkItem, check_batch
from tests.support.pictures import assert_same_picture

pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")

CASE = ("a red fox", 32, 32, 2, 3.5, 1, "tensor")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from stagemesh.stage_service.models.adapters.synthetic import write_random_lora
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny

    root = tmp_path_factory.mktemp("adapters")
    flux = write_tiny(root / "flux", "flux")
    sd3 = write_tiny(root / "sd3", "sd3")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(flux / "transformer")
    loras = root / "loras"
    write_random_lora(loras / "ink.safetensors", transformer, rank=4, seed=1)
    write_random_lora(loras / "film" / "pytorch_lora_weights.safetensors", transformer, rank=8, seed=2)
    (loras / "notes.txt").write_text("not an adapter")
    (loras / "empty").mkdir()
    other = root / "other"
    write_random_lora(other / "sd3.safetensors", diffusers.SD3Transformer2DModel.from_pretrained(sd3 / "transformer"))
    return {"flux": flux, "loras": loras, "other": other}


@pytest.fixture(scope="module")
def encoder(folders):
    from stagemesh.stage_service.models.runners import build_runner

    return build_runner("encoder", folders["flux"])


def _registry(runner, folders, **kwargs):
    from stagemesh.stage_service.models.adapters import AdapterRegistry

    registry = AdapterRegistry(runner.pipe, runner.transformer, "cpu", lora_dir=str(folders["loras"]), **kwargs)
    registry.load_dir()
    return registry


def _image(encoder, runner, registry, *adapters: tuple[str, float]) -> torch.Tensor:
    params = Params(*CASE, adapters=tuple(AdapterChoice(n, s) for n, s in adapters))
    item = WorkItem("r", params)
    [item.inputs] = encoder.run([item])
    registry.apply(params.adapters)
    [out] = runner.run([item])
    return out["image"]


def test_under_dlo_adapters_stay_out_of_the_streamed_blocks_and_give_the_resident_image(folders, encoder):
    from stagemesh.stage_service.models.runners import build_runner
    from stagemesh.stage_service.settings import DloOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resident = build_runner("diffusion", folders["flux"])
        dlo = build_runner("diffusion", folders["flux"], dlo=DloOptions(enable_dlo=True, dlo_use_allgather=False))
        on_resident, on_dlo = _registry(resident, folders), _registry(dlo, folders)
        streamed = {id(e.current()) for layout in dlo.offload.layouts for e in layout.entries}
        lora = [p for name, p in dlo.transformer.named_parameters() if ".lora_" in name]
        assert lora and not any(id(p) in streamed for p in lora)
        for adapters in ((), (("ink", 0.8),), (("ink", 0.5), ("film", 1.5)), ()):
            want = _image(encoder, resident, on_resident, *adapters)
            assert_same_picture(_image(encoder, dlo, on_dlo, *adapters), want, adapters)
    finally:
        torch.set_num_threads(threads)


def test_with_8_bit_streaming_the_adapter_still_applies(folders, encoder):
    from stagemesh.stage_service.models.runners import build_runner
    from stagemesh.stage_service.settings import DloOptions

    resident = build_runner("diffusion", folders["flux"])
    opts = DloOptions(enable_dlo=True, dlo_use_allgather=False, dlo_stream_dtype="int8")
    quantized = build_runner("diffusion", folders["flux"], dlo=opts)
    on_resident, on_quantized = _registry(resident, folders), _registry(quantized, folders)
    want = _image(encoder, resident, on_resident, ("film", 1.5))
    got = _image(encoder, quantized, on_quantized, ("film", 1.5))
    base = _image(encoder, quantized, on_quantized)
    # The base weights are rounded to 8 bits (close, not equal); the adapter moves the image by
    # far more than that rounding does.
    assert (got - want).abs().max() < 0.01 < (got - base).abs().max()


def test_the_device_bound_moves_the_least_recently_used_adapter_to_the_host(folders):
    from stagemesh.stage_service.models.runners import build_runner

    runner = build_runner("diffusion", folders["flux"])
    registry = _registry(runner, folders, max_device_adapters=1)

    def placed() -> dict[str, bool]:
        return {i.name: i.on_device for i in registry.infos()}

    assert sorted(placed()) == ["film", "ink"] and sum(placed().values()) == 1
    registry.apply((AdapterChoice("ink", 1.0),))
    assert placed() == {"ink": True, "film": False}
    registry.apply((AdapterChoice("film", 1.0),))
    assert placed() == {"ink": False, "film": True}
    # A request naming more adapters than the bound gets them all for its batch.
    registry.apply((AdapterChoice("ink", 1.0), AdapterChoice("film", 1.0)))
    assert placed() == {"ink": True, "film": True}
    registry.apply(())
    registry.apply((AdapterChoice("ink", 1.0),))
    assert placed() == {"ink": True, "film": False}
    sizes = {i.name: i.bytes for i in registry.infos()}
    assert sizes["film"] == 2 * sizes["ink"] > 0  # rank 8 vs rank 4 on the same layers


def test_files_that_are_not_this_models_adapters_are_refused_naming_why(folders):
    from stagemesh.stage_service.models.adapters import AdapterFileError, discover, resolve_source
    from stagemesh.stage_service.models.adapters.files import AdapterWeights, check_layers
    from stagemesh.stage_service.models.runners import build_runner

    assert sorted(discover(folders["loras"])) == ["film", "ink"]
    runner = build_runner("diffusion", folders["flux"])
    registry = _registry(runner, folders)
    registry.lora_dir = str(folders["other"])
    with pytest.raises(AdapterFileError, match=r"adapts layer 'nope\.to_q', which the transformer lacks"):
        check_layers(
            runner.transformer, AdapterWeights({"transformer.nope.to_q.lora_A.weight": torch.zeros(1)}, None, None)
        )
    # The tiny SD3 has two joint blocks, the tiny FLUX one: the first missing layer in the file is named.
    with pytest.raises(AdapterFileError, match=r"adapts layer 'transformer_blocks\.1\.attn\.add_k_proj', which the"):
        registry.load("sd3", "sd3.safetensors")
    assert "sd3" not in registry.names() and "sd3" not in (runner.transformer.peft_config or {})
    with pytest.raises(AdapterFileError, match="not the transformer's"):
        check_layers(runner.transformer, AdapterWeights({"text_encoder.x.lora_A.weight": torch.zeros(1)}, None, None))
    with pytest.raises(AdapterFileError, match="outside"):
        resolve_source(folders["loras"], "../other/sd3.safetensors")
    with pytest.raises(AdapterFileError, match="no lora_dir"):
        resolve_source("", "ink.safetensors")
    registry.lora_dir = str(folders["loras"])
    with pytest.raises(AdapterFileError, match="loaded already"):
        registry.load("ink", "ink.safetensors")


def test_adapter_sets_are_part_of_the_batch_key():
    plain = Params(*CASE)
    ink = Params(*CASE, adapters=(AdapterChoice("ink", 1.0),))
    stronger = Params(*CASE, adapters=(AdapterChoice("ink", 1.5),))
    assert len({plain.batch_key(), ink.batch_key(), stronger.batch_key()}) == 3
    with pytest.raises(ValueError, match="adapters"):
        check_batch([WorkItem("a", ink), WorkItem("b", stronger)])


def test_request_adapters_are_validated_naming_the_field():
    def refused(adapters, supports=True) -> dict[str, str]:
        limits = Limits(supports_adapters=supports)
        with pytest.raises(InvalidArgument) as exc:
            resolve(prompt="x", width=None, height=None, num_inference_steps=None, guidance_scale=None,
                    seed=1, output_format="png", limits=limits, adapters=adapters)  # fmt: skip
        return {v.field: v.description for v in exc.value.violations}

    assert "-8 to 8" in refused((AdapterChoice("ink", 8.5),))["params.adapters[0].scale"]
    assert "at most 4" in refused(tuple(AdapterChoice(f"a{i}") for i in range(5)))["params.adapters"]
    assert "twice" in refused((AdapterChoice("ink"), AdapterChoice("ink")))["params.adapters[1].name"]
    assert "not an adapter name" in refused((AdapterChoice("../x"),))["params.adapters[0].name"]
    assert "no LoRA adapters" in refused((AdapterChoice("ink"),), supports=False)["params.adapters"]


def test_sleep_level_1_keeps_adapters_on_the_host_and_level_2_reads_them_again(folders, encoder):
    from stagemesh.stage_service.models.runners import build_runner

    runner = build_runner("diffusion", folders["flux"])
    registry = _registry(runner, folders, max_device_adapters=1)
    registry.apply((AdapterChoice("film", 1.0),))
    want = _image(encoder, runner, registry, ("film", 1.0))
    before = {i.name: i for i in registry.infos()}

    level_1 = registry.for_sleep(1)
    level_1.release_device()
    assert not any(i.on_device for i in registry.infos())
    level_1.restore_device()
    assert {i.name: i for i in registry.infos()} == before

    level_2 = registry.for_sleep(2)
    assert level_2.release_device() == sum(i.bytes for i in before.values())
    assert registry.names() == [] and not [n for n, _ in runner.transformer.named_parameters() if ".lora_" in n]
    level_2.restore_device()
    assert {i.name: i for i in registry.infos()} == before  # the same places, read again from the files
    assert torch.equal(_image(encoder, runner, registry, ("film", 1.0)), want)


def test_an_sd3_adapter_gives_diffusers_own_image(tmp_path):
    """SD3's loader returns no network alphas (FLUX's does): the other branch of the file reading."""
    from stagemesh.stage_service.models.adapters import AdapterRegistry
    from stagemesh.stage_service.models.adapters.synthetic import write_random_lora
    from stagemesh.stage_service.models.diffusers_adapter.synthetic import write_tiny
    from stagemesh.stage_service.models.runners import build_runner

    folder = write_tiny(tmp_path / "sd3", "sd3")
    lora = write_random_lora(
        tmp_path / "loras" / "ink.safetensors",
        diffusers.SD3Transformer2DModel.from_pretrained(folder / "transformer"),
        rank=4,
        seed=5,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
        pipe.load_lora_weights(str(lora), adapter_name="ink")
        pipe.set_adapters(["ink"], [0.7])
        want = pipe(prompt="a red fox", width=32, height=32, num_inference_steps=2, guidance_scale=3.5,
                    output_type="pt", generator=torch.Generator().manual_seed(1)).images[0]  # fmt: skip
        encoder, runner = build_runner("encoder", folder), build_runner("diffusion", folder)
        registry = AdapterRegistry(runner.pipe, runner.transformer, "cpu", lora_dir=str(tmp_path / "loras"))
        registry.load_dir()
        got = _image(encoder, runner, registry, ("ink", 0.7))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want.permute(1, 2, 0).float())


def test_a_kohya_format_file_is_converted_as_load_lora_weights_converts_it(folders, encoder, tmp_path):
    """A community format (kohya's names for FLUX: fused qkv, lora_down / lora_up, alpha): read
    through the pipeline's own lora_state_dict, the image equals diffusers' load_lora_weights'."""
    from safetensors.torch import save_file

    from stagemesh.stage_service.models.adapters import AdapterRegistry
    from stagemesh.stage_service.models.runners import build_runner

    dim, rank = 32, 4  # the tiny FLUX: 2 heads of 16
    g = torch.Generator().manual_seed(7)
    kohya = {}
    for part, out in (("img_attn_qkv", 3 * dim), ("img_attn_proj", dim), ("txt_attn_qkv", 3 * dim)):
        key = f"lora_unet_double_blocks_0_{part}"
        kohya[f"{key}.lora_down.weight"] = torch.randn(rank, dim, generator=g) * 0.3
        kohya[f"{key}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.3
        kohya[f"{key}.alpha"] = torch.tensor(2.0)
    lora_dir = tmp_path / "kohya"
    lora_dir.mkdir()
    save_file(kohya, str(lora_dir / "sketch.safetensors"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = diffusers.FluxPipeline.from_pretrained(folders["flux"], local_files_only=True)
        pipe.load_lora_weights(str(lora_dir / "sketch.safetensors"), adapter_name="sketch")
        pipe.set_adapters(["sketch"], [1.2])
        want = pipe(prompt="a red fox", width=32, height=32, num_inference_steps=2, guidance_scale=3.5,
                    output_type="pt", generator=torch.Generator().manual_seed(1)).images[0]  # fmt: skip
        runner = build_runner("diffusion", folders["flux"])
        registry = AdapterRegistry(runner.pipe, runner.transformer, "cpu", lora_dir=str(lora_dir))
        [info] = registry.load_dir()
        assert (info.name, info.layers) == ("sketch", 7)  # qkv split into to_q, to_k, to_v, twice
        got = _image(encoder, runner, registry, ("sketch", 1.2))
    finally:
        torch.set_num_threads(threads)
    assert_same_picture(got, want.permute(1, 2, 0).float())


def test_a_load_reads_on_a_thread_and_attaches_when_the_main_loop_takes_it(folders):
    """The worker's main loop only starts a load: the file is read on a thread (here held until
    released, as a slow disk would), and the adapter joins the transformer when the loop takes the
    message the thread posts, between two batches."""
    import queue
    import threading

    from stagemesh.stage_service.models.runners import build_runner
    from stagemesh.stage_service.transport import protocol
    from stagemesh.stage_service.worker.adapter_loads import ATTACH_OP, BackgroundLoads

    runner = build_runner("diffusion", folders["flux"])
    registry = _registry(runner, folders)
    registry.unload("ink")
    release = threading.Event()
    reading = registry.prepare

    def slow_prepare(name, path):
        release.wait(timeout=60)
        return reading(name, path)

    registry.prepare = slow_prepare
    posted: queue.Queue = queue.Queue()
    loads = BackgroundLoads(registry, posted.put)
    loads.start(protocol.Control("rpc-1", "adapter_load", {"name": "ink", "path": "ink.safetensors"}))
    # The loop is free: batches run meanwhile, and nothing has changed under them.
    assert posted.empty() and "ink" not in registry.names()
    release.set()
    message = posted.get(timeout=60)
    assert (message.rpc_id, message.op, message.args) == ("rpc-1", ATTACH_OP, {"rpc_id": "rpc-1"})
    assert "ink" not in registry.names()  # read, not yet added
    [info] = loads.attach("rpc-1")
    assert info.name == "ink" and "ink" in registry.names()

    loads.start(protocol.Control("rpc-2", "adapter_load", {"name": "bad", "path": "../x.safetensors"}))
    posted.get(timeout=60)
    with pytest.raises(ValueError, match="outside"):
        loads.attach("rpc-2")  # what the thread met is the call's answer
