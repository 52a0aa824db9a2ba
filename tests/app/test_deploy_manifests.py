"""deploy/kubernetes renders (both overlays: example, and tls on top of it), validates against the
Kubernetes 1.30 API, and runs the services as they are: every container's arguments and STAGEMESH_*
environment parse with the service's own flags, probes and metrics annotations name the ports those
flags bind, and the cache and an AR stage started with the manifests' own arguments and environment
reach SERVING. The Dockerfile is checked for shape (it is not built)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.cli import _parser
from stagemesh.core import readyfile, tls
from tests.core.test_security import make_certificates
from tests.support.meshproc import START_TIMEOUT_S, spawn_service

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = {name: KUBERNETES / "overlays" / name for name in ("example", "tls")}
TLS_MOUNT = "/etc/stagemesh/tls"
KUBERNETES_VERSION = "1.30"
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "DaemonSet"}
DOCKERFILE_KEYWORDS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


# A renderer for the kustomization fields these manifests use (resources, namespace, images,
# secretGenerator with files, JSON 6902 patches with a target); any other field fails the render,
# so it cannot be ignored silently.
KNOWN_FIELDS = {
    "apiVersion", "kind", "resources", "namespace", "images", "secretGenerator", "generatorOptions", "patches",
}  # fmt: skip


def render(folder: Path, read_file: Callable[[Path], bytes]) -> list[dict]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    assert not unknown, f"{folder}: the renderer does not know {unknown}"
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = folder / entry
        if path.is_dir():
            objects += render(path, read_file)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator in kustomization.get("secretGenerator", []):
        assert kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"), "name hashes not rendered"
        data = {}
        for spec in generator["files"]:
            key, _, name = spec.rpartition("=")
            data[key or Path(name).name] = base64.b64encode(read_file(folder / name)).decode()
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": generator["name"]}, "data": data}
        objects.append({**secret, "type": generator.get("type", "Opaque")})
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path", "target"} and set(patch["target"]) == {"kind", "name"}, patch
        (target,) = [
            o
            for o in objects
            if o["kind"] == patch["target"]["kind"] and o["metadata"]["name"] == patch["target"]["name"]
        ]
        for op in yaml.safe_load((folder / patch["path"]).read_text()):
            json_patch(target, op)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for container in all_containers(objects, init=True):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return objects


def json_patch(obj: dict, op: dict) -> None:
    """One RFC 6902 operation of the kinds the overlays use: add (`-` appends), replace."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
    for part in parents:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    if op["op"] == "add" and isinstance(obj, list):
        obj.insert(len(obj) if last == "-" else int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        key = int(last) if isinstance(obj, list) else last
        if op["op"] == "replace":
            assert key in obj if isinstance(obj, dict) else key < len(obj), f"replace of a missing {op['path']}"
        obj[key] = op["value"]
    else:
        raise AssertionError(f"the renderer does not know the operation {op['op']!r}")


def all_containers(objects: list[dict], init: bool = False) -> Iterator[dict]:
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            spec = obj["spec"]["template"]["spec"]
            yield from spec["containers"]
            if init:
                yield from spec.get("initContainers", [])


def placeholder(path: Path) -> bytes:
    """A file the overlay reads that an operator creates (the token): any content renders."""
    return path.read_bytes() if path.exists() else b"placeholder-token\n"


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request) -> list[dict]:
    return render(OVERLAYS[request.param], placeholder)


@pytest.fixture(scope="module")
def rendered_tls() -> list[dict]:
    return render(OVERLAYS["tls"], placeholder)


def workloads(rendered: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in rendered if obj["kind"] in WORKLOADS}


def container_env(obj: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet sets it (fieldRef: the namespace only)."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(var["value"]))
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", var
            env[var["name"]] = obj["metadata"]["namespace"]
    return env


def expanded_args(obj: dict, container: dict) -> list[str]:
    """The container's args as the kubelet passes them: $(VAR) replaced by the container's env."""
    env = container_env(obj, container)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert not [a for a in args if "$(" in a], f"unexpanded variables in {args}"
    return args


def service_env(obj: dict, container: dict) -> dict[str, str]:
    """The STAGEMESH_* part of the container's environment: what the service reads as flags."""
    return {k: v for k, v in container_env(obj, container).items() if k.startswith("STAGEMESH_")}


@contextlib.contextmanager
def only_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ without this machine's STAGEMESH_* variables, with `env`'s."""
    ours = {k: v for k, v in os.environ.items() if not k.startswith("STAGEMESH_")}
    with mock.patch.dict(os.environ, {**ours, **env}, clear=True):
        yield


def parsed(obj: dict, container: dict) -> argparse.Namespace:
    """What the service makes of the container's args and environment (SystemExit 2 on a flag or
    variable it does not accept)."""
    with only_environment(service_env(obj, container)):
        return _parser().parse_args(expanded_args(obj, container))


def flag(obj: dict, name: str) -> str:
    return getattr(parsed(obj, obj["spec"]["template"]["spec"]["containers"][0]), name)


def test_renders_and_validates_offline(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = sorted(
        (obj["kind"], obj["metadata"]["name"]) for obj in rendered if obj["metadata"]["name"] != "stagemesh-tls"
    )
    assert kinds == [
        ("DaemonSet", "stagemesh-cache"),
        ("Deployment", "gateway"),
        ("Deployment", "stage-0"),
        ("Deployment", "stage-1"),
        ("Namespace", "stagemesh-example"),
        ("Secret", "stagemesh-credentials"),
        ("Service", "gateway"),
        ("Service", "stage-0"),
        ("Service", "stage-1"),
        ("Service", "stagemesh-cache"),
    ]
    for obj in rendered:
        kubernetes_validate.validate(copy.deepcopy(obj), KUBERNETES_VERSION, strict=True)


PATH_OPTIONS = ("token_file", "root", "model_dir", "dlo_runtime_cache_dir", "tls_cert", "tls_key", "tls_ca")


def test_every_container_runs_flags_its_service_accepts(rendered):
    for obj in workloads(rendered).values():
        pod = obj["spec"]["template"]
        for container in pod["spec"]["containers"]:
            assert container["image"] == "stagemesh:latest"
            options = parsed(obj, container)  # exits (SystemExit 2) on a flag or variable the service lacks
            assert options.host == "0.0.0.0"
            # Probes ask the plaintext health port when there is one (the TLS port would refuse them).
            probed = options.health_port if options.health_port is not None else options.port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == probed, (obj["metadata"]["name"], probe)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            health = {"health": options.health_port} if options.health_port is not None else {}
            http = {"http": options.http_port} if getattr(options, "http_port", None) is not None else {}
            assert ports == {"grpc": options.port, "metrics": options.metrics_port, **health, **http}
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == str(options.metrics_port)
            # Every file or directory the arguments and variables name lies on a volume the container mounts.
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            with only_environment({}):
                defaults = _parser().parse_args([options.command])
            for name in PATH_OPTIONS:
                path = getattr(options, name, None)
                if path and path != getattr(defaults, name):
                    assert any(str(path).startswith(m + "/") for m in mounts), (name, path, mounts)


def test_the_mesh_is_wired_together(rendered):
    by_name = workloads(rendered)
    namespace = by_name["gateway"]["metadata"]["namespace"]
    services = {obj["metadata"]["name"]: obj for obj in rendered if obj["kind"] == "Service"}

    # The gateway reaches stage N through its headless Service's DNS name and port.
    targets = flag(by_name["gateway"], "stage")
    assert len(targets) == 2
    for stage_id, target in enumerate(targets):
        name = f"stage-{stage_id}"
        assert flag(by_name[name], "stage_id") == stage_id
        port = flag(by_name[name], "port")
        assert target == f"dns:///{name}.{namespace}.svc.cluster.local:{port}"
        assert services[name]["spec"]["clusterIP"] == "None"
        assert services[name]["spec"]["ports"][0]["port"] == port
    # The diffusion stage shares the cache service's root and calls its node's cache service.
    cache, stage = by_name["stagemesh-cache"], by_name["stage-1"]
    assert str(flag(stage, "dlo_runtime_cache_dir")) == str(flag(cache, "root"))
    cache_port = flag(cache, "port")
    assert flag(stage, "dlo_runtime_cache_service") == f"stagemesh-cache.{namespace}.svc.cluster.local:{cache_port}"
    assert services["stagemesh-cache"]["spec"]["internalTrafficPolicy"] == "Local"
    # Every pod runs as the user that owns the cache root, and its token Secret exists.
    secret_names = {obj["metadata"]["name"] for obj in rendered if obj["kind"] == "Secret"}
    for obj in by_name.values():
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["fsGroup"] == 10001
        for volume in spec["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secret_names
    for stage in ("stage-0", "stage-1"):
        container = by_name[stage]["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])


def test_the_gateway_service_serves_its_http_port(rendered):
    """The HTTP API's port: in the gateway's args, its container's ports and its Service; HTTPS
    (the gRPC port's certificate) exactly when the gateway serves TLS."""
    gateway = workloads(rendered)["gateway"]
    options = parsed(gateway, gateway["spec"]["template"]["spec"]["containers"][0])
    assert options.http_port == 8000  # docs/DEPLOY.md and the Dockerfile's EXPOSE name it
    (service,) = [o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == "gateway"]
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["targetPort"]) == (options.http_port, "http")
    assert http["appProtocol"] == ("https" if options.tls_cert else "http")
    assert any(k == "EXPOSE" and str(options.http_port) in rest.split() for k, rest in dockerfile())


def local_args(args: list[str], tmp_path: Path, model_dir: str) -> list[str]:
    """The manifests' arguments for a process on this machine: loopback, ports picked by the
    service (spawn_service appends --port 0), the CPU, and temp dirs for the paths."""
    token = tmp_path / "token"
    token.write_text("a-test-token\n")
    token.chmod(0o600)
    replaced = {
        "--host": "127.0.0.1",
        "--metrics-port": "0",
        "--device": "cpu",
        "--token-file": str(token),
        "--root": str(tmp_path / "rt"),
        "--model-dir": model_dir,
    }
    out = []
    for arg in args:
        name, _, value = arg.partition("=")
        if name == "--port":
            continue
        out.append(f"{name}={replaced[name]}" if name in replaced and value else arg)
    return out


def local_env(env: dict[str, str], tmp_path: Path) -> tuple[dict[str, str], str | None]:
    """The manifests' STAGEMESH_* variables for a process on this machine (certificates made for
    127.0.0.1 in place of the Secret's, a health port the service picks), and the CA that verifies
    the service when it serves TLS."""
    pki = make_certificates(tmp_path)
    replaced = {
        "STAGEMESH_TLS_CERT": str(pki["cert"]),
        "STAGEMESH_TLS_KEY": str(pki["key"]),
        "STAGEMESH_TLS_CA": str(pki["ca"]),
        "STAGEMESH_HEALTH_PORT": "0",
    }
    unknown = set(env) - set(replaced)
    assert not unknown, f"no local value for {unknown}"
    return {name: replaced[name] for name in env}, str(pki["ca"]) if "STAGEMESH_TLS_CERT" in env else None


def serving(address: str, timeout_s: float, ca: str | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    with tls.channel(address, ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


@pytest.mark.mesh
def test_cache_and_ar_stage_serve_with_the_manifests_arguments(rendered, tmp_path, tiny_model):
    """With the tls overlay, each serves TLS and answers the probes' question on its plaintext
    health port."""
    by_name = workloads(rendered)
    started = []
    try:
        for name in ("stagemesh-cache", "stage-0"):
            obj = by_name[name]
            container = obj["spec"]["template"]["spec"]["containers"][0]
            folder = tmp_path / name
            folder.mkdir()
            variables, ca = local_env(service_env(obj, container), folder)
            env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEMESH_")} | variables
            args = local_args(expanded_args(obj, container), folder, str(tiny_model))
            started.append((name, spawn_service(name, args, folder, env), ca))
        for name, service, ca in started:
            address = service.wait_bound()
            info = readyfile.read(service.ready_path) or {}
            checks = [(address, ca)]  # over TLS when it serves TLS
            if "health" in info:  # the probes' port: plaintext
                checks.append((info["health"], None))
            for where, with_ca in checks:
                reached = serving(where, START_TIMEOUT_S, with_ca)
                assert reached, f"{name} never reached SERVING at {where}; log:\n{service.logs()[-3000:]}"
    finally:
        for name, service, _ in started:
            assert service.stop() == 0, f"{name} did not stop cleanly; log:\n{service.logs()[-3000:]}"


def test_the_tls_overlay_secures_every_listener_and_channel(rendered_tls):
    secrets = {obj["metadata"]["name"]: obj for obj in rendered_tls if obj["kind"] == "Secret"}
    certificate = secrets["stagemesh-tls"]
    assert certificate["type"] == "kubernetes.io/tls" and set(certificate["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    for name, obj in workloads(rendered_tls).items():
        spec = obj["spec"]["template"]["spec"]
        container = spec["containers"][0]
        options = parsed(obj, container)
        assert (options.tls_cert, options.tls_key) == (f"{TLS_MOUNT}/tls.crt", f"{TLS_MOUNT}/tls.key"), name
        if name != "stagemesh-cache":  # the cache service calls no other service
            assert options.tls_ca == f"{TLS_MOUNT}/ca.crt", name
        assert options.health_port not in (None, options.port), name
        (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "stagemesh-tls"]
        assert {"name": volume["name"], "mountPath": TLS_MOUNT, "readOnly": True} in container["volumeMounts"]


def test_the_certificate_instructions_name_every_host_the_mesh_dials(rendered_tls):
    """docs/DEPLOY.md's certificate must be valid for each name a service dials (TLS verifies it)."""
    by_name = workloads(rendered_tls)
    namespace = by_name["gateway"]["metadata"]["namespace"]
    dialled = [target.removeprefix("dns:///").rsplit(":", 1)[0] for target in flag(by_name["gateway"], "stage")]
    dialled.append(str(flag(by_name["stage-1"], "dlo_runtime_cache_service")).rsplit(":", 1)[0])
    doc = (REPO / "docs" / "DEPLOY.md").read_text()
    (alt_names,) = re.findall(r"subjectAltName=([^\"\s]+)", doc)
    named = {entry.removeprefix("DNS:").replace("$NS", namespace) for entry in alt_names.split(",")}
    assert set(dialled) <= named, (dialled, named)


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions: (KEYWORD, the rest), continuation lines joined."""
    instructions = []
    for line in re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text()).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_shape():
    instructions = dockerfile()
    assert instructions[0][0] == "FROM" and "cuda" in instructions[0][1]
    unknown = {k for k, _ in instructions} - DOCKERFILE_KEYWORDS
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    users = [rest for k, rest in instructions if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ("ENTRYPOINT", '["stagemesh"]') in instructions
    # the stage extra, and the SDK that OTEL_TRACES_EXPORTER turns on (docs/OPERATIONS.md, "Tracing")
    assert any(k == "RUN" and 'install ".[stage,tracing]"' in rest for k, rest in instructions), "no stage extra"
    # The manifests run as the image's user: the cache root's owner must be that uid.
    assert users[-1].split(":")[0] == "10001"
