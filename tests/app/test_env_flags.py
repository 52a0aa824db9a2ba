"""STAGEMESH_* variables for the flags of the service commands (stagemesh/core/envflags.py): every
flag of `up`, `gateway`, `stage` and `cache` has one, found from the parsers themselves (a flag
added later is covered with no change here); a variable acts as its flag would; the command line
wins; refusals name the variable; real services start configured by variables alone; `up` keeps
the variables from the services it starts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from stagemesh import cli
from stagemesh.client.channel import ADDRESS_ENV, API_KEY_ENV, TOKEN_FILE_ENV
from stagemesh.config import SupervisionConfig
from stagemesh.core import auth, envflags, procutil, readyfile, serve, tls
from stagemesh.stage_service.engine.wave_rules import WAVE_TIMEOUT_ENV
from stagemesh.stage_service.executor.outputs import TIMEOUT_ENV
from stagemesh.supervisor import Child, Supervisor, service_argv
from stagemesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    generation_pb2,
    stage_pb2,
    stage_pb2_grpc,
)
from tests.support.meshproc import REPO, START_TIMEOUT_S

SERVICE_COMMANDS = ("up", "gateway", "stage", "cache")
# Values tried, in order, for a flag's sample: the first its own type accepts that differs from its default.
CANDIDATES = ("7", "2.5", "127.0.0.1:7", "/tmp/some-path", "x")
RPC_TIMEOUT_S = 60.0


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def every_variable() -> set[str]:
    return {name for command in SERVICE_COMMANDS for _, name in envflags.bindings(commands()[command])}


@pytest.fixture
def clean_env(monkeypatch):
    """No flag variable from the machine's environment leaks into a parse."""
    for name in every_variable():
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def parse(monkeypatch, argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        return cli._parser().parse_args(argv)


def parses(argv: list[str]) -> argparse.Namespace | None:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return cli._parser().parse_args(argv)
        except SystemExit:
            return None


def sample(command: str, action: argparse.Action) -> str:
    flag = envflags.long_flag(action)
    tried = [str(c) for c in reversed(action.choices)] if action.choices else list(CANDIDATES)
    for value in tried:
        parsed = parses([command, flag, value])
        if parsed is not None and getattr(parsed, action.dest) != action.default:
            return value
    raise AssertionError(f"no sample value for {command} {flag}: extend CANDIDATES")


def test_every_flag_of_every_service_command_has_a_variable_that_acts_as_the_flag(clean_env):
    checked = 0
    for command in SERVICE_COMMANDS:
        for action in commands()[command]._actions:
            flag = envflags.long_flag(action)
            if flag is None or isinstance(action, argparse._HelpAction):
                continue
            name = envflags.variable(action)
            if action.default is argparse.SUPPRESS:  # an alias: its main flag's variable covers it
                assert name is None, flag
                continue
            assert name == "STAGEMESH_" + flag[2:].upper().replace("-", "_"), (command, flag)
            if envflags.is_boolean(action):
                off = [f"--no-{flag[2:]}"] if isinstance(action, argparse.BooleanOptionalAction) else []
                pairs = [("1", [flag]), ("yes", [flag]), ("0", off), ("off", off)]
            else:
                value = sample(command, action)
                repeated = [flag, value, flag, value] if envflags.is_list(action) else [flag, value]
                pairs = [(f"{value} {value}" if envflags.is_list(action) else value, repeated)]
            for raw, argv in pairs:
                by_variable = getattr(parse(clean_env, [command], {name: raw}), action.dest)
                by_flag = getattr(parse(clean_env, [command, *argv], {}), action.dest)
                assert by_variable == by_flag, (command, name, raw, argv)
            checked += 1
    assert checked > 60  # every command's flags were seen (the stage alone has over forty)


def test_the_command_line_wins_and_an_empty_variable_is_unset(clean_env):
    env = {"STAGEMESH_STAGE": "127.0.0.1:1,127.0.0.1:2  dns:///stage-1.example:50062", "STAGEMESH_PORT": "5"}
    from_env = parse(clean_env, ["gateway"], env)
    assert from_env.stage == ["127.0.0.1:1,127.0.0.1:2", "dns:///stage-1.example:50062"] and from_env.port == 5
    flags = parse(clean_env, ["gateway", "--stage", "127.0.0.1:3", "--port=6"], env)
    assert flags.stage == ["127.0.0.1:3"] and flags.port == 6  # replaced, not appended to
    assert parse(clean_env, ["gateway"], {"STAGEMESH_PORT": ""}).port == 0
    dlo = {"STAGEMESH_ENABLE_DLO": "true", "STAGEMESH_DLO_USE_ALLGATHER": "1"}
    stage = parse(clean_env, ["stage", "--no-enable-dlo", "--dlo-no-use-allgather"], dlo)
    assert not stage.enable_dlo and not stage.dlo_use_allgather  # an alias counts as its flag
    # Above mesh.toml: `up --log-level` (and so its variable) overrides [mesh] log_level.
    assert parse(clean_env, ["up"], {"STAGEMESH_LOG_LEVEL": "debug"}).log_level == "debug"


def test_help_names_each_variable_and_client_commands_read_none(clean_env):
    for command in SERVICE_COMMANDS:
        text = " ".join(commands()[command].format_help().split())  # as wrapped for the terminal
        for _, name in envflags.bindings(commands()[command]):
            assert f"[env {name}]" in text, (command, name)
    generate = parse(clean_env, ["generate", "a prompt"], {"STAGEMESH_TIMEOUT": "5", "STAGEMESH_SIZE": "64"})
    assert (generate.timeout, generate.size) == (600.0, None)


def test_no_flag_variable_is_one_with_another_meaning():
    """Variables the code reads for other things must not double as a flag's. Three are shared on
    purpose, with one meaning: STAGEMESH_TLS_CA (the CA that verifies the services one calls),
    STAGEMESH_TOKEN_FILE (the file holding the bearer token) and STAGEMESH_MODEL_DIR."""
    others = {
        auth.TOKEN_ENV,
        ADDRESS_ENV,
        API_KEY_ENV,
        procutil.PARENT_PID_ENV,
        serve.FAILURE_FILE_ENV,
        TIMEOUT_ENV,
        WAVE_TIMEOUT_ENV,
    }
    assert not every_variable() & others
    assert {tls.CA_ENV, TOKEN_FILE_ENV, "STAGEMESH_MODEL_DIR"} <= every_variable()


# ---- real processes ---------------------------------------------------------------------------------


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *args],
        cwd=REPO,
        env={**clean_environ(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def clean_environ() -> dict[str, str]:
    names = every_variable()
    return {k: v for k, v in os.environ.items() if k not in names and k != auth.TOKEN_ENV}


@pytest.mark.parametrize(
    "args, env, said",
    [
        (
            ["gateway"],
            {"STAGEMESH_PORT": "abc"},
            "stagemesh gateway: error: environment variable STAGEMESH_PORT='abc' (for --port): "
            "invalid int value: 'abc'",
        ),
        (
            ["cache"],
            {"STAGEMESH_LOG_LEVEL": "loud"},
            "environment variable STAGEMESH_LOG_LEVEL='loud' (for --log-level): invalid choice: 'loud'",
        ),
        (
            ["stage"],
            {"STAGEMESH_ENABLE_DLO": "maybe"},
            "environment variable STAGEMESH_ENABLE_DLO='maybe' (for --enable-dlo): not a boolean; "
            "allowed: 1, true, yes, on, 0, false, no, off",
        ),
        (
            ["stage"],
            {"STAGEMESH_WORKERS": "0"},
            "workers = 0: must be a whole number of at least 1 (--workers was taken from STAGEMESH_WORKERS)",
        ),
        (
            ["gateway"],
            {"STAGEMESH_STAGE": "127.0.0.1:1", "STAGEMESH_STAGE_UNRESPONSIVE_S": "1"},
            "--stage-unresponsive-s: 1: allowed 2 or more (--stage-unresponsive-s was taken from "
            "STAGEMESH_STAGE_UNRESPONSIVE_S)",
        ),
    ],
)
def test_refusals_name_the_variable(args, env, said):
    done = run(args, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stdout + done.stderr


def wait_ready(process: subprocess.Popen, ready: Path, log: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while (info := readyfile.read(ready)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"not ready; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return info


@contextlib.contextmanager
def configured_by_variables(name: str, command: str, env: dict[str, str], folder: Path):
    """`stagemesh COMMAND` with no flag at all: everything from `env`. Yields its ready-file content."""
    ready, log = folder / f"{name}.ready", folder / f"{name}.log"
    env = {**env, "STAGEMESH_READY_FILE": str(ready), "STAGEMESH_HOST": "127.0.0.1", "STAGEMESH_PORT": "0"}
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh", command],
            cwd=REPO,
            env={**clean_environ(), **env, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield lambda: wait_ready(process, ready, log)
    finally:
        if process.poll() is None:
            process.terminate()
        assert process.wait(60) == 0, log.read_text()[-3000:]


def test_a_cache_service_configured_by_variables_alone(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-cache-token-" + "c" * 20)
    token.chmod(0o600)
    env = {
        "STAGEMESH_ROOT": str(tmp_path / "root"),
        "STAGEMESH_METRICS_PORT": "0",
        "STAGEMESH_TOKEN_FILE": str(token),
        "STAGEMESH_LOG_LEVEL": "warning",
    }
    with configured_by_variables("cache", "cache", env, tmp_path) as ready:
        info = ready()
        assert "metrics" in info  # STAGEMESH_METRICS_PORT=0: an endpoint on a free port
        with grpc.insecure_channel(info["address"]) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:  # the token file from STAGEMESH_TOKEN_FILE guards it
                stub.GetStats(cache_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = auth.bearer_metadata(token.read_text())
            stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S, metadata=metadata)
            assert stats.root == str(tmp_path / "root")


@pytest.mark.mesh
def test_a_stage_and_a_gateway_configured_by_variables_alone(mesh, tmp_path, tiny_model):
    stages = mesh.child_addresses()
    stage_env = {
        "STAGEMESH_KIND": "ar",
        "STAGEMESH_MODEL_DIR": str(tiny_model),
        "STAGEMESH_THREADS": "1",
        "STAGEMESH_MAX_PROMPT_BYTES": "100",
        "STAGEMESH_ENABLE_SLEEP": "off",
    }
    gateway_env = {"STAGEMESH_STAGE": f"{stages['stage-0']} {stages['stage-1']}", "STAGEMESH_MAX_REQUEST_BYTES": "1000"}
    with (
        configured_by_variables("stage", "stage", stage_env, tmp_path) as stage_ready,
        configured_by_variables("gateway", "gateway", gateway_env, tmp_path) as gateway_ready,
    ):
        with grpc.insecure_channel(stage_ready()["address"]) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (described := stub.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=RPC_TIMEOUT_S)).ready:
                assert time.monotonic() < deadline, "the stage never loaded its model"
                time.sleep(0.2)
        assert (described.kind, described.limits.max_prompt_bytes, described.supports_sleep) == ("ar", 100, False)
        with grpc.insecure_channel(gateway_ready()["address"]) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            listed = gateway.ListStages(gateway_pb2.ListStagesRequest(), timeout=RPC_TIMEOUT_S, wait_for_ready=True)
            assert [s.kind for s in listed.stages] == ["ar", "diffusion"]
            with pytest.raises(grpc.RpcError) as refused:  # STAGEMESH_MAX_REQUEST_BYTES took effect
                gateway.GenerateUnary(
                    gateway_pb2.GenerateUnaryRequest(params=generation_pb2.GenerationParams(prompt="p" * 2000)),
                    timeout=RPC_TIMEOUT_S,
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_up_keeps_the_service_variables_from_its_children(tmp_path, monkeypatch):
    """A variable meant for a service started alone must not reach every child `up` starts (mesh.toml
    configures those); STAGEMESH_MODEL_DIR keeps its meaning there (the embedded model's folder)."""
    unset = cli._service_variables()
    assert {"STAGEMESH_PORT", "STAGEMESH_TLS_CA", "STAGEMESH_STAGE", "STAGEMESH_METRICS_PORT"} <= unset
    assert "STAGEMESH_MODEL_DIR" not in unset and auth.TOKEN_ENV not in unset
    monkeypatch.setenv("STAGEMESH_METRICS_PORT", "0")
    monkeypatch.setenv("STAGEMESH_MODEL_DIR", str(tmp_path / "models"))
    supervisor = Supervisor(SupervisionConfig(ready_timeout_s=START_TIMEOUT_S), unset_env=unset)
    child = Child("cache", lambda port: service_argv("cache", "--port", str(port), "--root", str(tmp_path / "root")))
    try:
        asyncio.run(supervisor.start(child))
        assert child.process is not None
        environ = Path(f"/proc/{child.process.pid}/environ").read_bytes().split(b"\0")
        assert b"STAGEMESH_METRICS_PORT=0" not in environ
        assert f"STAGEMESH_MODEL_DIR={tmp_path / 'models'}".encode() in environ
    finally:
        supervisor.stop_all()
    assert child.process.returncode == 0
