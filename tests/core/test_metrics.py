"""Prometheus metrics: one real mesh (`stagemesh up`) with a metrics port on every service and
DLO on stage 1, scraped over HTTP, and the Grafana dashboard (deploy/grafana) checked against what
it serves; a standalone cache service with --metrics-port; the pieces that need no process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stagemesh import config as mesh_config
from stagemesh.cli import _parser
from stagemesh.core import auth, metrics, readyfile
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.settings import StageSettings
from stagemesh.v1 import cache_pb2, cache_pb2_grpc, gateway_pb2, generation_pb2
from tests.support.meshproc import (
    REPO,
    Mesh,
    segments_of,
    shm_entries,
    start_mesh,
    write_config,
)

RPC_TIMEOUT_S = 60.0
# Counts land when gRPC has finished the call on the server, a moment after the client saw its end.
SETTLE_S = 10.0
GATEWAY = "stagemesh.v1.GatewayService"
STAGE = "stagemesh.v1.StageService"
TOKEN = "metrics-test-token"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def settled(address: str, done, timeout: float = SETTLE_S) -> Samples:
    """Scrape until `done(samples)` holds (a count the server records after the reply left)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(address)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def requests(samples: Samples, service: str, method: str, code: str) -> float:
    return value(samples, "stagemesh_requests_total", service=service, method=method, code=code)


def _params(**kw) -> generation_pb2.GenerationParams:
    base = {"prompt": "a lighthouse at dusk", "width": 64, "height": 48, "num_inference_steps": 2, "seed": 7}
    return generation_pb2.GenerationParams(**{**base, **kw})


SLOW = {"width": 512, "height": 512, "num_inference_steps": 50}  # seconds on a CPU: cancelled long before


@pytest.fixture(scope="module")
def metered(tmp_path_factory, model_dir) -> tuple[Mesh, dict[str, str]]:
    ensure_model_dir(Path(model_dir), PipelineConfig.tiny())  # once, before both stages load it
    root = tmp_path_factory.mktemp("metered")
    config = write_config(
        root / "mesh.toml",
        Path(model_dir),
        extra_stage="metrics_port = 0",
        extra_diffusion="enable_dlo = true",
        extra_gateway="metrics_port = 0",
        extra_cache="metrics_port = 0",
    )
    shm_before = shm_entries()
    mesh = start_mesh(config, root / "mesh.log")
    try:
        # Each service logs its metrics address before its ready file: all are known by now.
        yield mesh, mesh.metrics_addresses()
    finally:
        assert mesh.stop() == 0, mesh.logs()[-3000:]
        leaked = segments_of(shm_entries() - shm_before, mesh.child_pids())
        assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.mark.mesh
def test_every_service_serves_its_metrics(metered):
    _, addresses = metered
    assert set(addresses) == {"gateway", "stage-0", "stage-1", "cache"}
    assert len({a.rsplit(":", 1)[1] for a in addresses.values()}) == 4
    for service, address in addresses.items():
        samples = scrape(address)
        # The supervisor's health checks are RPCs like any other.
        assert requests(samples, service, "grpc.health.v1.Health/Check", "OK") >= 1, service
        assert value(samples, "process_resident_memory_bytes") > 0, service
    stage = scrape(addresses["stage-1"])
    for name, want in (
        ("stagemesh_stage_ready", 1),
        ("stagemesh_stage_workers_up", 1),
        ("stagemesh_stage_sleep_level", 0),
        ("stagemesh_stage_queue_depth", 0),
        ("stagemesh_stage_waiting_requests", 0),
    ):
        assert value(stage, name, service="stage-1") == want, name
    assert ("stagemesh_stage_device_memory_bytes", (("service", "stage-1"),)) in stage
    gateway = scrape(addresses["gateway"])
    assert value(gateway, "stagemesh_gateway_admission_open", service="gateway") == 1
    assert value(gateway, "stagemesh_gateway_generation_paused", service="gateway") == 0
    cache = scrape(addresses["cache"])
    assert value(cache, "stagemesh_cache_entries", service="cache") == 0
    assert ("stagemesh_cache_evictions_total", (("service", "cache"),)) in cache


@pytest.mark.mesh
def test_generate_counts_ok_latency_and_offload_bytes(metered):
    mesh, addresses = metered
    generate = f"{GATEWAY}/Generate"
    gateway_before, stage_before = scrape(addresses["gateway"]), scrape(addresses["stage-1"])
    ar_before = scrape(addresses["stage-0"])
    with mesh.channel() as channel:
        events = list(
            mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=_params()), timeout=RPC_TIMEOUT_S)
        )
    assert events[-1].HasField("result")
    ok_before = requests(gateway_before, "gateway", generate, "OK")
    gateway = settled(addresses["gateway"], lambda s: requests(s, "gateway", generate, "OK") > ok_before)
    assert requests(gateway, "gateway", generate, "OK") == ok_before + 1
    count = "stagemesh_request_latency_seconds_count"
    assert (
        value(gateway, count, service="gateway", method=generate)
        == value(gateway_before, count, service="gateway", method=generate) + 1
    )
    assert value(gateway, "stagemesh_request_latency_seconds_sum", service="gateway", method=generate) > value(
        gateway_before, "stagemesh_request_latency_seconds_sum", service="gateway", method=generate
    )
    assert value(gateway, "stagemesh_requests_in_flight", service="gateway", method=generate) == 0

    execute = f"{STAGE}/Execute"
    stage = settled(
        addresses["stage-1"],
        lambda s: requests(s, "stage-1", execute, "OK") > requests(stage_before, "stage-1", execute, "OK"),
    )
    assert requests(stage, "stage-1", execute, "OK") == requests(stage_before, "stage-1", execute, "OK") + 1
    streamed = "stagemesh_stage_offload_streamed_bytes_total"
    # Every denoising step streams every DiT block from host memory again.
    assert value(stage, streamed, service="stage-1") > value(stage_before, streamed, service="stage-1")
    assert value(stage, "stagemesh_stage_queue_depth", service="stage-1") == 0
    ar = scrape(addresses["stage-0"])
    assert value(ar, streamed, service="stage-0") == 0  # no DLO there
    # Each stage ran the request's forward pass and timed it (its output has come back).
    compute = "stagemesh_stage_compute_seconds_total"
    assert value(stage, compute, service="stage-1") > value(stage_before, compute, service="stage-1")
    assert value(ar, compute, service="stage-0") > value(ar_before, compute, service="stage-0")


@pytest.mark.mesh
def test_refused_calls_are_counted_with_their_code(metered):
    mesh, addresses = metered
    unary = f"{GATEWAY}/GenerateUnary"
    before = scrape(addresses["gateway"])
    with mesh.channel() as channel:
        with pytest.raises(grpc.RpcError) as bad:
            mesh.gateway(channel).GenerateUnary(
                gateway_pb2.GenerateUnaryRequest(params=_params(width=0)), timeout=RPC_TIMEOUT_S
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        missing = channel.unary_unary(f"/{GATEWAY}/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as unknown:
            missing(b"", timeout=RPC_TIMEOUT_S)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    was = requests(before, "gateway", unary, "INVALID_ARGUMENT")
    after = settled(addresses["gateway"], lambda s: requests(s, "gateway", unary, "INVALID_ARGUMENT") > was)
    assert requests(after, "gateway", unary, "INVALID_ARGUMENT") == was + 1
    assert requests(after, "gateway", unary, "OK") == requests(before, "gateway", unary, "OK")
    assert (
        requests(after, "gateway", metrics.UNKNOWN_METHOD, "UNIMPLEMENTED")
        == requests(before, "gateway", metrics.UNKNOWN_METHOD, "UNIMPLEMENTED") + 1
    )


@pytest.mark.mesh
def test_cancelled_and_deadline_exceeded_calls_are_counted(metered):
    """Codes no servicer sets: gRPC itself ends these calls."""
    mesh, addresses = metered
    generate, unary = f"{GATEWAY}/Generate", f"{GATEWAY}/GenerateUnary"
    before = scrape(addresses["gateway"])
    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        call = stub.Generate(gateway_pb2.GenerateRequest(params=_params(**SLOW)), timeout=RPC_TIMEOUT_S)
        assert next(call).HasField("stage_started")  # running now
        call.cancel()
        with pytest.raises(grpc.RpcError) as late:
            stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=_params(**SLOW)), timeout=0.5)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cancelled = requests(before, "gateway", generate, "CANCELLED")
    expired = requests(before, "gateway", unary, "DEADLINE_EXCEEDED")
    after = settled(
        addresses["gateway"],
        lambda s: (
            requests(s, "gateway", generate, "CANCELLED") > cancelled
            and requests(s, "gateway", unary, "DEADLINE_EXCEEDED") > expired
        ),
    )
    assert requests(after, "gateway", generate, "CANCELLED") == cancelled + 1
    assert requests(after, "gateway", unary, "DEADLINE_EXCEEDED") == expired + 1
    for method in (generate, unary):
        assert value(after, "stagemesh_requests_in_flight", service="gateway", method=method) == 0
    # The stages gave the cancelled work up: nothing stays queued.
    for stage in ("stage-0", "stage-1"):
        samples = settled(
            addresses[stage], lambda s, st=stage: value(s, "stagemesh_stage_queue_depth", service=st) == 0
        )
        assert value(samples, "stagemesh_stage_queue_depth", service=stage) == 0


@pytest.mark.mesh
def test_sleep_and_wake_show_in_stage_and_gateway_state(metered):
    mesh, addresses = metered

    def state() -> tuple[float, float, float]:
        stage, gateway = scrape(addresses["stage-1"]), scrape(addresses["gateway"])
        return (
            value(stage, "stagemesh_stage_sleep_level", service="stage-1"),
            value(gateway, "stagemesh_gateway_stage_sleep_level", service="gateway", stage_id="1"),
            value(gateway, "stagemesh_gateway_generation_paused", service="gateway"),
        )

    with mesh.channel() as channel:
        stub = mesh.gateway(channel)
        stub.Sleep(gateway_pb2.SleepRequest(stage_ids=[1], level=1), timeout=RPC_TIMEOUT_S)
        assert state() == (1, 1, 1)
        assert value(scrape(addresses["gateway"]), "stagemesh_gateway_admission_open", service="gateway") == 0
        stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[1]), timeout=RPC_TIMEOUT_S)
        assert state() == (0, 0, 1)  # a pipeline with an AR stage stays paused until resumed
        stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
        assert state() == (0, 0, 0)
    sleep = f"{STAGE}/SleepStage"
    stage = settled(addresses["stage-1"], lambda s: requests(s, "stage-1", sleep, "OK") >= 1)
    assert requests(stage, "stage-1", sleep, "OK") == 1
    assert requests(stage, "stage-1", f"{STAGE}/WakeUpStage", "OK") == 1


DASHBOARD = REPO / "deploy" / "grafana" / "stagemesh.json"
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"job", "instance"}
PROMQL_FUNCTIONS = {"sum", "rate", "histogram_quantile"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _exported(addresses: dict[str, str]) -> dict[str, set[str]]:
    """Every sample name the services serve (counters as `_total`, histograms as `_bucket` ...)
    -> the labels it carries."""
    out: dict[str, set[str]] = {}
    for address in addresses.values():
        for name, labels in scrape(address):
            out.setdefault(name, set()).update(k for k, _ in labels)
    return out


def _promql_parts(expr: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(metric -> label names its selectors match on, grouping labels, functions) of a PromQL
    expression, read the simple way the dashboard's expressions allow."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # quoted values are no names
    expr = re.sub(r"\$\w+", "", expr)  # Grafana's variables ($__rate_interval, $job)
    metrics: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", expr):
        metrics.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}", "", expr)
    grouping = {label.strip() for labels in _GROUPING.findall(expr) for label in labels.split(",") if label.strip()}
    expr = re.sub(r"\[[^\]]*\]", "", _GROUPING.sub("", expr))
    functions = set(re.findall(r"([a-zA-Z_:][\w:]*)\s*\(", expr))
    for name in re.findall(r"([a-zA-Z_:][\w:]*)(?!\s*[\w:(])", expr):
        metrics.setdefault(name, set())
    return metrics, grouping, functions


def _dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend) of every panel's targets and every variable's query."""
    queries = [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # Grafana's label_values(METRIC, LABEL) asks what `sum by (LABEL) (METRIC)` would.
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()
            queries.append((f"${variable['name']}", f"sum by ({label}) ({metric})", ""))
    return queries


def test_the_dashboard_is_a_grafana_dashboard_of_prometheus_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "stagemesh"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        place = panel["gridPos"]
        assert place["x"] + place["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]
        assert all('job=~"$job"' in t["expr"] for t in panel["targets"]), panel["title"]


@pytest.mark.mesh
def test_the_dashboard_reads_only_metrics_and_labels_the_services_serve(metered):
    """Every metric a dashboard query names is served by some service of a real mesh, with every
    label the query matches, groups or shows in a legend; every function is one PromQL has."""
    _, addresses = metered
    exported = _exported(addresses)
    dashboard = json.loads(DASHBOARD.read_text())
    covered: set[str] = set()
    for title, expr, legend in _dashboard_queries(dashboard):
        metrics_of, grouping, functions = _promql_parts(expr)
        assert metrics_of, (title, expr)
        assert functions <= PROMQL_FUNCTIONS, (title, functions - PROMQL_FUNCTIONS)
        labels = set(TARGET_LABELS)
        for name, matched in metrics_of.items():
            assert name in exported, f"{title}: {name} is served by no service"
            assert matched <= exported[name] | TARGET_LABELS, (title, name, matched - exported[name])
            labels |= exported[name]
            covered.add(name)
        assert grouping <= labels, (title, grouping - labels)
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert shown <= labels, (title, shown - labels)
    # What the dashboard is for: queues, batches, compute, sleep, the cache, errors by code.
    for name in (
        "stagemesh_stage_queue_depth",
        "stagemesh_stage_batched_requests_total",
        "stagemesh_stage_compute_seconds_total",
        "stagemesh_stage_sleep_level",
        "stagemesh_cache_entries",
        "stagemesh_requests_total",
    ):
        assert name in covered, name


def _start_cache(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / "cache.ready"
    with open(tmp_path / "cache.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagemesh",
                "cache",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--root",
                str(tmp_path / "root"),
                "--ready-file",
                str(ready),
            ],
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **{auth.TOKEN_ENV: TOKEN}),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while (info := readyfile.read(ready)) is None:  # the ready file is the service's only signal
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cache.log").read_text()
        time.sleep(0.05)
    return proc, info


def test_standalone_cache_service_metrics_flag_and_ready_file(tmp_path):
    """Also: a call the auth interceptor refuses is counted (metrics come first)."""
    proc, info = _start_cache(tmp_path)
    try:
        address = info["metrics"]
        assert address.startswith("127.0.0.1:") and address != info["address"]
        with grpc.insecure_channel(info["address"]) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            stub.ListEntries(
                cache_pb2.ListEntriesRequest(), timeout=RPC_TIMEOUT_S, metadata=auth.bearer_metadata(TOKEN)
            )
            with pytest.raises(grpc.RpcError) as anonymous:
                stub.Evict(cache_pb2.EvictRequest(budget_bytes=0), timeout=RPC_TIMEOUT_S)
            assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as bad:
                stub.Evict(
                    cache_pb2.EvictRequest(budget_bytes=-1), timeout=RPC_TIMEOUT_S, metadata=auth.bearer_metadata(TOKEN)
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        evict = "stagemesh.v1.CacheService/Evict"
        samples = settled(
            address,
            lambda s: (
                requests(s, "cache", evict, "INVALID_ARGUMENT") == 1
                and requests(s, "cache", evict, "UNAUTHENTICATED") == 1
            ),
        )
        assert requests(samples, "cache", evict, "INVALID_ARGUMENT") == 1
        assert requests(samples, "cache", evict, "UNAUTHENTICATED") == 1
        assert requests(samples, "cache", "stagemesh.v1.CacheService/ListEntries", "OK") == 1
        assert value(samples, "stagemesh_cache_entries", service="cache") == 0
        assert value(samples, "stagemesh_cache_evictions_total", service="cache") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    with pytest.raises(urllib.error.URLError):  # the endpoint went with the service
        scrape(address)


@pytest.mark.parametrize(
    "set_code, ended, remaining, want",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN, 5.0, "INVALID_ARGUMENT"),  # abort()
        (None, grpc.StatusCode.OK, None, "OK"),
        (None, grpc.StatusCode.UNKNOWN, None, "UNKNOWN"),  # an exception no servicer mapped
        (None, None, 0.0, "DEADLINE_EXCEEDED"),  # gRPC cancelled the handler at its deadline
        (None, None, 3.0, "CANCELLED"),  # ... or because the client went away
        (None, None, None, "CANCELLED"),
    ],
)
def test_final_code(set_code, ended, remaining, want):
    assert metrics.final_code(set_code, ended, remaining).name == want


def test_metrics_are_off_unless_a_port_is_given():
    off = metrics.ServiceMetrics("gateway", "127.0.0.1", None)
    assert not off.enabled and off.interceptors() == [] and off.start() == ""
    args = _parser().parse_args(["gateway", "--stage", "127.0.0.1:1"])
    assert args.metrics_port is None and mesh_config.MeshConfig().gateway.metrics_port is None
    assert StageSettings().metrics_port is None


@pytest.mark.parametrize(
    "argv",
    [["gateway", "--metrics-port", "70000"], ["cache", "--metrics-port", "x"], ["stage", "--metrics-port", "-1"]],
)
def test_bad_metrics_port_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert "--metrics-port" in capsys.readouterr().err


def test_bad_metrics_port_key_is_refused_naming_it(tmp_path):
    path = tmp_path / "mesh.toml"
    path.write_text("[cache]\nmetrics_port = 65536\n")
    with pytest.raises(ValueError, match=r"\[cache\] metrics_port = 65536: allowed 0"):
        mesh_config.load(path)
    with pytest.raises(ValueError, match="metrics_port = 70000"):
        StageSettings(metrics_port=70000)
