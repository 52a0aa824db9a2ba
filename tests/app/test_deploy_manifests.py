"""deploy/kubernetes renders, validates against the Kubernetes 1.30 API, and runs the services as
they are: every container's arguments parse with the service's own flags, probes and metrics
annotations name the ports those flags bind, and the cache and an AR stage started with the
manifests' own arguments reach SERVING. The Dockerfile is checked for shape (it is not built)."""

from __future__ import annotations

import base64
import copy
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.cli import _parser
from tests.support.meshproc import START_TIMEOUT_S, spawn_service

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAY = KUBERNETES / "overlays" / "example"
KUBERNETES_VERSION = "1.30"
CLUSTER_SCOPED = {"Namespace"}
WORKLOADS = {"Deployment", "DaemonSet"}
DOCKERFILE_KEYWORDS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


# A renderer for the kustomization fields these manifests use (resources, namespace, images,
# secretGenerator with files); any other field fails the render, so it cannot be ignored silently.
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "secretGenerator", "generatorOptions"}


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


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render(OVERLAY, placeholder)


def workloads(rendered: list[dict]) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in rendered if obj["kind"] in WORKLOADS}


def expanded_args(obj: dict, container: dict) -> list[str]:
    """The container's args as the kubelet passes them: $(VAR) replaced by the container's env."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", var
            env[var["name"]] = obj["metadata"]["namespace"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert not [a for a in args if "$(" in a], f"unexpanded variables in {args}"
    return args


def flag(args: list[str], name: str) -> str:
    return getattr(_parser().parse_args(args), name)


def test_renders_and_validates_offline(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = sorted((obj["kind"], obj["metadata"]["name"]) for obj in rendered)
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


def test_every_container_runs_flags_its_service_accepts(rendered):
    for obj in workloads(rendered).values():
        pod = obj["spec"]["template"]
        for container in pod["spec"]["containers"]:
            assert container["image"] == "stagemesh:latest"
            args = expanded_args(obj, container)
            parsed = _parser().parse_args(args)  # exits (SystemExit 2) on a flag the service lacks
            assert parsed.host == "0.0.0.0"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == parsed.port, (obj["metadata"]["name"], probe)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports == {"grpc": parsed.port, "metrics": parsed.metrics_port}
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == str(parsed.metrics_port)
            # Every file or directory the arguments name lies on a volume the container mounts.
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            for name in ("--token-file", "--root", "--model-dir", "--dlo-runtime-cache-dir"):
                for arg in args:
                    if arg.startswith(name + "="):
                        path = arg.partition("=")[2]
                        assert any(path.startswith(m + "/") for m in mounts), (arg, mounts)


def test_the_mesh_is_wired_together(rendered):
    by_name = workloads(rendered)
    namespace = by_name["gateway"]["metadata"]["namespace"]
    services = {obj["metadata"]["name"]: obj for obj in rendered if obj["kind"] == "Service"}

    def args_of(name: str) -> list[str]:
        obj = by_name[name]
        return expanded_args(obj, obj["spec"]["template"]["spec"]["containers"][0])

    # The gateway reaches stage N through its headless Service's DNS name and port.
    targets = flag(args_of("gateway"), "stage")
    assert len(targets) == 2
    for stage_id, target in enumerate(targets):
        name = f"stage-{stage_id}"
        assert flag(args_of(name), "stage_id") == stage_id
        port = flag(args_of(name), "port")
        assert target == f"dns:///{name}.{namespace}.svc.cluster.local:{port}"
        assert services[name]["spec"]["clusterIP"] == "None"
        assert services[name]["spec"]["ports"][0]["port"] == port
    # The diffusion stage shares the cache service's root and calls its node's cache service.
    cache_args, stage_args = args_of("stagemesh-cache"), args_of("stage-1")
    assert str(flag(stage_args, "dlo_runtime_cache_dir")) == str(flag(cache_args, "root"))
    cache_port = flag(cache_args, "port")
    assert flag(stage_args, "dlo_runtime_cache_service") == (
        f"stagemesh-cache.{namespace}.svc.cluster.local:{cache_port}"
    )
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


def serving(address: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
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
    by_name = workloads(rendered)
    started = []
    try:
        for name in ("stagemesh-cache", "stage-0"):
            obj = by_name[name]
            args = expanded_args(obj, obj["spec"]["template"]["spec"]["containers"][0])
            folder = tmp_path / name
            folder.mkdir()
            env = {k: v for k, v in os.environ.items() if k != "STAGEMESH_TOKEN"}
            started.append((name, spawn_service(name, local_args(args, folder, str(tiny_model)), folder, env)))
        for name, service in started:
            address = service.wait_bound()
            assert serving(address, START_TIMEOUT_S), f"{name} never reached SERVING; log:\n{service.logs()[-3000:]}"
    finally:
        for name, service in started:
            assert service.stop() == 0, f"{name} did not stop cleanly; log:\n{service.logs()[-3000:]}"


def test_dockerfile_shape():
    instructions = []
    for line in re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text()).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    assert instructions[0][0] == "FROM" and "cuda" in instructions[0][1]
    unknown = {k for k, _ in instructions} - DOCKERFILE_KEYWORDS
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    users = [rest for k, rest in instructions if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert ("ENTRYPOINT", '["stagemesh"]') in instructions
    assert any(k == "RUN" and 'install ".[stage]"' in rest for k, rest in instructions), "no stage extra"
    # The manifests run as the image's user: the cache root's owner must be that uid.
    assert users[-1].split(":")[0] == "10001"
