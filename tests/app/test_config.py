"""mesh.toml parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagemesh import config
from stagemesh.stage_service.settings import StageSettings


def test_no_file_gives_the_embedded_two_stage_pipeline():
    mesh = config.load(None)
    assert [(s.stage_id, s.kind) for s in mesh.stages] == [(0, "ar"), (1, "diffusion")]
    assert mesh.gateway.port == config.DEFAULT_GATEWAY_PORT and mesh.host == "127.0.0.1"


def test_stage_tables_get_ids_in_order_and_the_mesh_host(tmp_path):
    path = tmp_path / "mesh.toml"
    path.write_text(
        '[mesh]\nhost = "127.0.0.2"\n[[stages]]\nkind = "ar"\n[[stages]]\nkind = "diffusion"\nworkers = 2\n'
    )
    mesh = config.load(path)
    assert [(s.stage_id, s.host, s.workers) for s in mesh.stages] == [(0, "127.0.0.2", 1), (1, "127.0.0.2", 2)]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[gateway]\nportt = 1\n", "portt"),
        ('[[stages]]\nkind = "diffusion"\nmax_sise = 4\n', "max_sise"),
        ("[nonsense]\n", "nonsense"),
        ('[[stages]]\nkind = "ar"\n', "last stage must be of kind 'diffusion'"),
        ("[gateway]\nmax_images_per_request = 0\n", "max_images_per_request = 0: allowed a whole number, 1 or more"),
        ("[gateway]\nmax_images_per_request = 2.5\n", "max_images_per_request = 2.5"),
    ],
)
def test_config_errors_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "mesh.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        config.load(path)


def test_gateway_max_images_per_request(tmp_path):
    assert config.load(None).gateway.max_images_per_request == 8
    path = tmp_path / "mesh.toml"
    path.write_text("[gateway]\nmax_images_per_request = 3\n")
    assert config.load(path).gateway.max_images_per_request == 3


def test_the_gateway_http_port_and_api_key_file_reach_its_command_line(tmp_path):
    from stagemesh import launcher

    path = tmp_path / "mesh.toml"
    path.write_text('[gateway]\nhttp_port = 0\napi_key_file = "key"\n')
    mesh = config.load(path)
    assert mesh.gateway.http_port == 0
    assert mesh.gateway.api_key_file == str(Path.cwd() / "key")  # absolute, as the [security] paths
    _, _, gateway = launcher._children(mesh, ["127.0.0.1:1", "127.0.0.1:2"], [])
    argv = gateway.argv(50051)
    assert argv[argv.index("--http-port") + 1] == "0"
    assert argv[argv.index("--api-key-file") + 1] == mesh.gateway.api_key_file
    # A restart binds the HTTP port the gateway bound first, as it does the gRPC port.
    gateway.ready = {"address": "127.0.0.1:50051", "http": "127.0.0.1:8123"}
    argv = gateway.argv(50051)
    assert argv[argv.index("--http-port") + 1] == "8123"
    assert "--http-port" not in launcher._children(config.load(None), ["a", "b"], [])[2].argv(1)


@pytest.mark.parametrize("text", ["http_port = 70000", "http_port = -1", 'http_port = "80"', "api_key_file = 3"])
def test_bad_gateway_http_options_are_refused_naming_the_key(tmp_path, text):
    path = tmp_path / "mesh.toml"
    path.write_text(f"[gateway]\n{text}\n")
    with pytest.raises(ValueError, match=r"\[gateway\] (http_port|api_key_file)"):
        config.load(path)


@pytest.mark.parametrize(
    "set_size,runner_limits,expected",
    [
        (None, {"native_size": 64, "pixel_multiple": 16}, 64),  # the trained embedded model
        (None, {"pixel_multiple": 16}, 256),  # random weights: no size of its own
        (None, {"native_size": 1328, "pixel_multiple": 16}, 1024),  # capped at the 1024 bound
        (None, {"native_size": 1328, "pixel_multiple": 16, "max_size": 2048}, 1328),  # a diffusers folder's
        (None, {"native_size": 200, "pixel_multiple": 16}, 192),  # down to the pixel multiple
        (128, {"native_size": 64, "pixel_multiple": 16}, 128),  # set: wins over the model's
    ],
)
def test_default_size_is_the_models_own_unless_set(set_size, runner_limits, expected):
    settings = StageSettings(stage_id=1, kind="diffusion", default_size=set_size)
    assert settings.limits(runner_limits).default_size == expected


@pytest.mark.parametrize(
    "max_size,runner_limits,expected",
    [
        (None, {}, 1024),  # the embedded model names no bound
        (None, {"max_size": 2048}, 2048),  # a diffusers folder's: Qwen-Image's 1328 and 1664 fit
        (512, {"max_size": 2048}, 512),  # set: wins over the model's
    ],
)
def test_max_size_is_the_models_bound_unless_set(max_size, runner_limits, expected):
    limits = StageSettings(stage_id=1, kind="encoder", max_size=max_size).limits(runner_limits)
    assert limits.max_pixels_side == expected


def test_a_default_size_above_a_set_max_size_is_refused_naming_both():
    with pytest.raises(ValueError, match="default_size = 2048 is above max_size = 1024"):
        StageSettings(stage_id=1, kind="diffusion", default_size=2048, max_size=1024)


def test_the_trained_model_reports_its_size_and_random_weights_none(tiny_model, random_tiny_model):
    from stagemesh.stage_service.models.runners import build_runner

    assert build_runner("diffusion", tiny_model, "cpu").limits()["native_size"] == 64
    assert "native_size" not in build_runner("diffusion", random_tiny_model, "cpu").limits()
