"""Control-plane token and TLS: a real `stagemesh up` with a [security] table (TLS on every
listener, a token file), plus the token checker, the option checks and shared-memory modes."""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stagemesh import cli, config, launcher
from stagemesh.core import auth, errors, rpc, tls
from stagemesh.stage_service.transport import ipc
from stagemesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    gateway_pb2,
    generation_pb2,
    stage_pb2,
    stage_pb2_grpc,
    tensor_pb2,
)
from tests.support.meshproc import Mesh, descendants, segments_of, shm_entries, start_mesh, write_config

TOKEN = "s3cret-" + "x" * 25
MISSING = (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
RUNTIME_CACHE = (
    "enable_dlo = true\ndlo_use_allgather = false\ndlo_enable_runtime_cache = true\ndlo_checkpoint_mmap = false\n"
)
SMALL = generation_pb2.GenerationParams(prompt="tls", width=64, height=48, num_inference_steps=1, seed=3)


# ---- certificates made at test time ------------------------------------------------------------
def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate it signed, valid for 127.0.0.1 and localhost."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("stagemesh test CA"))
        .issuer_name(_name("stagemesh test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["key"], key)
    return paths


# ---- one secured mesh for the module -----------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    paths = make_certificates(folder)
    paths["token"] = folder / "token"
    paths["token"].write_text(TOKEN + "\n")  # as `echo` writes it: the newline is not part of the token
    paths["token"].chmod(0o600)
    return paths


@pytest.fixture(scope="module")
def secure_mesh(tmp_path_factory, model_dir, pki) -> Mesh:
    root = tmp_path_factory.mktemp("secure-mesh")
    # Stage 1 publishes its weights through the cache service: a mutation its workers make over TLS.
    path = write_config(root / "mesh.toml", Path(model_dir), extra_diffusion=RUNTIME_CACHE)
    path.write_text(
        path.read_text()
        + f"""
[security]
tls_cert = "{pki["cert"]}"
tls_key = "{pki["key"]}"
tls_ca = "{pki["ca"]}"
token_file = "{pki["token"]}"
"""
    )
    shm_before = shm_entries()
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(auth.TOKEN_ENV, raising=False)  # the file, not the environment, configures the mesh
        running = start_mesh(path, root / "mesh.log")
    yield running
    assert running.stop() == 0, running.logs()[-3000:]
    assert not segments_of(shm_entries() - shm_before, running.child_pids())


def secure_channel(address: str, pki) -> grpc.Channel:
    return tls.channel(address, str(pki["ca"]), rpc.channel_options())


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.mark.mesh
def test_generate_over_tls_needs_no_token(secure_mesh, pki):
    with secure_channel(secure_mesh.address, pki) as channel:
        events = list(secure_mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=SMALL), timeout=60))
    result = events[-1].result
    assert (result.width, result.height, result.seed) == (64, 48, 3) and result.png.startswith(b"\x89PNG")


@pytest.mark.mesh
def test_plaintext_client_cannot_talk_to_a_tls_gateway(secure_mesh):
    with secure_mesh.channel() as channel:
        code, _ = code_of(lambda: secure_mesh.gateway(channel).ListStages(gateway_pb2.ListStagesRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.mesh
def test_gateway_control_calls_need_the_right_token(secure_mesh, pki):
    wrong_same_length = "S" + TOKEN[1:]
    sleep = gateway_pb2.SleepRequest(stage_ids=[1], level=1)
    with secure_channel(secure_mesh.address, pki) as channel:
        stub = secure_mesh.gateway(channel)
        assert code_of(lambda: stub.Sleep(sleep, timeout=30)) == MISSING
        for metadata in (
            auth.bearer_metadata(wrong_same_length),
            auth.bearer_metadata(TOKEN + "x"),
            (("authorization", f"Basic {TOKEN}"),),
        ):
            assert code_of(lambda metadata=metadata: stub.Sleep(sleep, timeout=30, metadata=metadata)) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid bearer token",
            )
        assert (
            code_of(lambda: stub.PauseGeneration(gateway_pb2.PauseGenerationRequest(), timeout=30))[0]
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert not stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=30).generation_paused  # nothing happened

        good = auth.bearer_metadata(TOKEN)
        assert stub.Sleep(sleep, timeout=60, metadata=good).acks[0].freed_bytes >= 0  # the stage got our token too
        assert stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=60, metadata=good).acks
        stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=30, metadata=good)
        result = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=60).result
    assert (result.width, result.height) == (64, 48)


@pytest.mark.mesh
def test_cli_control_commands_take_a_ca_and_a_token_file(secure_mesh, pki, monkeypatch, capsys):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    common = ["--address", secure_mesh.address, "--tls-ca", str(pki["ca"]), "--timeout", "30"]
    assert cli.main(["pause", *common]) == 1
    assert "UNAUTHENTICATED: missing bearer token" in capsys.readouterr().err
    assert cli.main(["pause", *common, "--token-file", str(pki["token"])]) == 0
    assert cli.main(["status", *common]) == 0
    assert "generation: paused" in capsys.readouterr().out
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    assert cli.main(["resume", *common]) == 0
    assert cli.main(["resume", *common[:2], "--tls-ca", str(pki["ca"].parent / "absent.pem")]) == 2
    assert "--tls-ca: cannot read" in capsys.readouterr().err


def open_services(channel: grpc.Channel) -> set[str]:
    """What a caller without the token still gets: health SERVING and the services reflection lists."""
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=30)
    return {s.name for reply in replies for s in reply.list_services_response.service}


def execute(stub: stage_pb2_grpc.StageServiceStub, inputs=None, **kwargs) -> dict[str, tensor_pb2.Tensor]:
    """One stage's Execute of SMALL with `inputs` (what the stage before produced), as the gateway
    sends it: the stage's outputs."""
    request = stage_pb2.ExecuteRequest(request_id="direct", params=SMALL, inputs=inputs or {})
    [outputs] = [r.outputs.outputs for r in stub.Execute(request, timeout=60, **kwargs) if r.HasField("outputs")]
    return dict(outputs)


@pytest.mark.mesh
@pytest.mark.parametrize("stage_id", [0, 1])
def test_every_stage_call_needs_the_token(secure_mesh, pki, stage_id):
    good = auth.bearer_metadata(TOKEN)
    addresses = secure_mesh.child_addresses()
    inputs = None
    if stage_id == 1:  # stage 1 draws from stage 0's outputs
        with secure_channel(addresses["stage-0"], pki) as channel:
            inputs = execute(stage_pb2_grpc.StageServiceStub(channel), metadata=good)
    with secure_channel(addresses[f"stage-{stage_id}"], pki) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        assert "stagemesh.v1.StageService" in open_services(channel)
        calls = {
            "Execute": lambda **kw: execute(stub, inputs, **kw),
            "DescribeStage": lambda **kw: stub.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=30, **kw),
            "SleepStage": lambda **kw: stub.SleepStage(stage_pb2.SleepStageRequest(level=1), timeout=30, **kw),
            "WakeUpStage": lambda **kw: stub.WakeUpStage(stage_pb2.WakeUpStageRequest(), timeout=30, **kw),
        }
        for name, call in calls.items():
            assert code_of(call) == MISSING, name
            wrong = code_of(lambda call=call: call(metadata=auth.bearer_metadata("nope")))
            assert wrong == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"), name
        described = stub.DescribeStage(stage_pb2.DescribeStageRequest(), timeout=30, metadata=good)
        outputs = execute(stub, inputs, metadata=good)
    assert (described.kind, described.ready, described.sleep_level) == (["ar", "diffusion"][stage_id], True, 0)
    assert ["hidden_states", "image"][stage_id] in outputs, outputs.keys()  # served
    with secure_channel(secure_mesh.address, pki) as channel:  # the gateway sends the token on all its calls
        reply = secure_mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=SMALL), timeout=60)
    assert reply.result.png.startswith(b"\x89PNG")


@pytest.mark.mesh
def test_every_cache_call_needs_the_token(secure_mesh, pki, tmp_path):
    good = auth.bearer_metadata(TOKEN)
    with secure_channel(secure_mesh.child_addresses()["cache"], pki) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        assert "stagemesh.v1.CacheService" in open_services(channel)
        evict = cache_pb2.EvictRequest(budget_bytes=1 << 40)
        refusals = {
            "ListEntries": code_of(lambda: stub.ListEntries(cache_pb2.ListEntriesRequest(), timeout=30)),
            "GetStats": code_of(lambda: stub.GetStats(cache_pb2.GetStatsRequest(), timeout=30)),
            "Evict": code_of(lambda: stub.Evict(evict, timeout=30)),
        }
        assert refusals == dict.fromkeys(refusals, MISSING)  # and no word of the cache root
        wrong = code_of(
            lambda: stub.GetStats(cache_pb2.GetStatsRequest(), timeout=30, metadata=auth.bearer_metadata("x"))
        )
        assert wrong == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        session = stub.PublishSession(iter([cache_pb2.PublishSessionRequest(key="a" * 64)]), timeout=30)
        assert code_of(lambda: next(session))[0] == grpc.StatusCode.UNAUTHENTICATED

        entries = stub.ListEntries(cache_pb2.ListEntriesRequest(), timeout=30, metadata=good).entries
        stats = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=30, metadata=good)
        assert stub.Evict(evict, timeout=30, metadata=good).evicted_keys == []
    assert stats.root == str(Path(secure_mesh.config_path).parent / "cache-root")
    assert stats.entry_count == len(entries)
    # The stage's worker published with the token over TLS, through the service, not the local fallback.
    assert any(e.valid and e.tensor_count > 1 for e in entries), entries
    assert "lock via cache service" in secure_mesh.logs()


@pytest.mark.mesh
def test_token_is_on_no_command_line_of_the_mesh(secure_mesh, pki):
    services = 0
    for pid in [secure_mesh.process.pid, *descendants(secure_mesh.process.pid)]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        assert TOKEN not in argv
        if "\0--token-file\0" in argv:
            services += 1
            assert f"--token-file\0{pki['token']}\0" in argv and f"--tls-cert\0{pki['cert']}\0" in argv
    assert services == 4  # cache, two stages, gateway


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="no grpcurl binary on PATH")
@pytest.mark.mesh
def test_banner_grpcurl_hints_work_as_printed(secure_mesh, pki):
    text = launcher.banner(secure_mesh.address, config.load(secure_mesh.config_path).security)
    commands = [line[line.index("grpcurl") :] for line in text.splitlines() if "grpcurl" in line]
    assert [c.rsplit("/", 1)[1] for c in commands] == ["GenerateUnary", "PauseGeneration"]
    outputs = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command.replace("grpcurl", shutil.which("grpcurl"), 1)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (command, done.stderr)
        outputs.append(done.stdout)
    assert '"png"' in outputs[0]
    with secure_channel(secure_mesh.address, pki) as channel:
        stub = secure_mesh.gateway(channel)
        assert stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=30).generation_paused  # the hint paused it
        stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=30, metadata=auth.bearer_metadata(TOKEN))


# ---- the checker and the option checks, without a mesh --------------------------------------------
@pytest.mark.parametrize(
    "metadata,reason",
    [
        ((), "missing bearer token"),
        ((("x-request-id", "r1"),), "missing bearer token"),
        ((("authorization", "Bearer short"),), "invalid bearer token"),
        ((("authorization", "Bearer " + "y" * len(TOKEN)),), "invalid bearer token"),  # right length, wrong value
        ((("authorization", "Bearer " + TOKEN[:-1] + "Y"),), "invalid bearer token"),  # last character differs
        ((("authorization", TOKEN),), "invalid bearer token"),  # no scheme
    ],
)
def test_check_bearer_refuses(metadata, reason):
    with pytest.raises(errors.Unauthenticated, match=reason):
        auth.check_bearer(metadata, TOKEN)
    assert rpc.status_for(errors.Unauthenticated(reason))[0] == grpc.StatusCode.UNAUTHENTICATED


def test_check_bearer_accepts_the_token_with_any_case_of_scheme():
    auth.check_bearer((("authorization", f"Bearer {TOKEN}"),), TOKEN)
    auth.check_bearer((("x", "y"), ("authorization", f"bearer {TOKEN}")), TOKEN)


class _Warnings:
    def __init__(self):
        self.events: list[str] = []

    def warning(self, event: str, **fields):
        self.events.append(event)


def test_token_file_is_read_stripped_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    warnings = _Warnings()
    monkeypatch.setattr(auth, "log", warnings)
    path = tmp_path / "token"
    path.write_text("abc\r\n")
    path.chmod(0o600)
    assert auth.load_token(str(path)) == "abc" and warnings.events == []
    path.chmod(0o640)
    assert auth.load_token(str(path)) == "abc"
    assert warnings.events == ["token file is readable by group or others; chmod 600 it"]
    path.write_text("\n")
    with pytest.raises(errors.InvalidArgument, match="--token-file: token file .* is empty"):
        auth.load_token(str(path))
    path.write_text("two\nlines\n")
    with pytest.raises(errors.InvalidArgument, match="printable ASCII on one line"):
        auth.load_token(str(path))
    with pytest.raises(errors.InvalidArgument, match="--token-file: cannot read"):
        auth.load_token(str(tmp_path / "absent"))
    assert auth.load_token(None) is None
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.load_token(None) == "from-env"


def test_tls_options_name_what_is_wrong(tmp_path, pki):
    with pytest.raises(errors.InvalidArgument, match="--tls-key: --tls-cert and --tls-key go together"):
        tls.server_credentials(str(pki["cert"]), None)
    with pytest.raises(errors.InvalidArgument, match="--tls-cert: cannot read"):
        tls.server_credentials(str(tmp_path / "absent.pem"), str(pki["key"]))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(errors.InvalidArgument, match="--tls-ca: .* is not a PEM file"):
        tls.channel_credentials(str(tmp_path / "junk.pem"))
    assert tls.server_credentials(None, None) is None
    assert isinstance(tls.server_credentials(str(pki["cert"]), str(pki["key"])), grpc.ServerCredentials)


@pytest.mark.parametrize(
    "table,needle",
    [
        ('tls_cert = "/c.pem"\ntls_ca = "/ca.pem"', "tls_cert and tls_key go together"),
        ('tls_cert = "/c.pem"\ntls_key = "/k.pem"', "tls_ca: needed with tls_cert"),
        ('token = "inline"', "unknown key.*'token'"),
        ("token_file = 5", "token_file: must be a file path"),
    ],
)
def test_security_table_errors_name_the_key(tmp_path, table, needle):
    path = tmp_path / "mesh.toml"
    path.write_text(f"[security]\n{table}\n")
    with pytest.raises(ValueError, match=needle):
        config.load(path)


def test_security_table_reaches_every_stage_and_the_banner(tmp_path, pki):
    path = tmp_path / "mesh.toml"
    path.write_text(
        f'[security]\ntls_cert = "{pki["cert"]}"\ntls_key = "{pki["key"]}"\n'
        f'tls_ca = "{pki["ca"]}"\ntoken_file = "{pki["token"]}"\n'
    )
    mesh = config.load(path)
    assert {(s.tls_cert, s.tls_ca, s.token_file) for s in mesh.stages} == {
        (str(pki["cert"]), str(pki["ca"]), str(pki["token"]))
    }
    text = launcher.banner("127.0.0.1:5000", mesh.security)
    assert text.splitlines()[0] == "stagemesh: gateway serving on 127.0.0.1:5000"
    assert f"grpcurl -cacert {pki['ca']} -d" in text and "-plaintext" not in text
    assert f'-H "authorization: Bearer $(cat {pki["token"]})"' in text and TOKEN not in text


def test_unreadable_security_file_refuses_up_before_any_child(tmp_path, pki, capsys):
    path = tmp_path / "mesh.toml"
    path.write_text(
        f'[security]\ntls_cert = "{pki["cert"]}"\ntls_key = "{tmp_path}/absent.key"\ntls_ca = "{pki["ca"]}"\n'
    )
    assert launcher.main(str(path), "error") == 2
    assert "[security] tls_key: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["gateway", "stage", "cache"])
def test_services_bind_loopback_by_default(command):
    args = cli._parser().parse_args([command])
    assert args.host == "127.0.0.1" and not args.tls_cert and not args.token_file  # plaintext, open, loopback
    assert config.load(None).host == "127.0.0.1"


# ---- shared memory -------------------------------------------------------------------------------
def test_shared_memory_segments_are_private_and_unguessable():
    big = torch.arange(ipc.SHM_THRESHOLD_BYTES // 4 + 1, dtype=torch.float32)
    packer = ipc.Packer(os.getpid(), rank=7, pool_slots=1)
    try:
        pooled, one_shot = packer.pack([big, big.clone()])  # the pool's one slot, then a one-shot segment
        assert pooled.pooled and not one_shot.pooled
        for packed in (pooled, one_shot):
            mode = os.stat(f"/dev/shm/{packed.shm_name}").st_mode
            assert stat.S_IMODE(mode) == 0o600, oct(mode)
            assert re.fullmatch(rf"{ipc.SHM_PREFIX}-{os.getpid()}-7-[0-9a-f]{{32}}", packed.shm_name)
        assert torch.equal(ipc.unpack(one_shot), big)  # the reader unlinks the one-shot segment
    finally:
        packer.close()
        ipc.sweep(os.getpid(), 7)
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"{ipc.SHM_PREFIX}-{os.getpid()}-7-")]
