"""Traces across a real mesh (`stagemesh up`): every service exports over OTLP to a collector in
this test (tests/support/otlp_collector.py), and each request is one connected trace, from the
gateway's call (gRPC or HTTP) through each stage's queue, batch and worker, continuing the
caller's `traceparent`. A refused call's span says why. With tracing off a mesh exports nothing
and never imports the OpenTelemetry SDK."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from stagemesh.core import errors, tracing
from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import REPO, Mesh, clean_mesh, descendants, write_config
from tests.support.otlp_collector import KIND_CLIENT, KIND_SERVER, Collector, Span

RPC_TIMEOUT_S = 60.0
# Spans go out in batches this many milliseconds apart (the SDK's default is 5 s).
TRACE_ENV = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "50"}
GATEWAY = "stagemesh-gateway"
EXECUTE = "stagemesh.v1.StageService/Execute"
# What each stage records of one request, under its Execute server span (stage_service/engine/spans.py).
STAGE_STEPS = ("decode inputs", "queue wait", "batch", "output delivery", "encode outputs")


def _without_otel(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if not k.startswith("OTEL_")}


@pytest.fixture(scope="module")
def collector():
    running = Collector()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_model, collector) -> Mesh:
    root = tmp_path_factory.mktemp("traced")
    config = write_config(root / "mesh.toml", tiny_model, extra_gateway="http_port = 0")
    env = {**_without_otel(dict(os.environ)), **TRACE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint}
    with clean_mesh(config, root / "mesh.log", env=env) as mesh:
        yield mesh


def _caller() -> tuple[str, str, str]:
    """A caller's own trace: (trace id, span id, its traceparent)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _params(**kw) -> generation_pb2.GenerationParams:
    base = {"prompt": "a lighthouse at dusk", "width": 64, "height": 48, "num_inference_steps": 2, "seed": 7}
    return generation_pb2.GenerationParams(**{**base, **kw})


def _trace(collector: Collector, trace_id: str, root_name: str, images: int = 1) -> list[Span]:
    """The spans of a request of `images` images once all have come (the gateway's server span,
    which ends last, and each stage's steps for each image)."""
    wanted = [(GATEWAY, root_name), *((GATEWAY, name) for name in ("encode image", "relay stage 0 -> stage 1"))]
    wanted += [(f"stagemesh-stage-{i}", name) for i in (0, 1) for name in (*STAGE_STEPS, "worker compute")]

    def complete(spans: list[Span]) -> bool:
        names = [(s.service, s.name) for s in spans if s.trace_id == trace_id]
        return names.count(wanted[0]) == 1 and all(names.count(w) >= images for w in wanted[1:])

    collector.wait_for(complete)
    return collector.trace(trace_id)


def _only(spans: list[Span], **match) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name) for s in spans])
    return found[0]


def _children(spans: list[Span], parent: Span) -> dict[str, list[Span]]:
    out: dict[str, list[Span]] = {}
    for s in spans:
        if s.parent_id == parent.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def _check_request_trace(mesh: Mesh, spans: list[Span], root_name: str, caller_span: str, images: int = 1) -> Span:
    """One connected trace: the gateway's server span under the caller's span, every other span
    under a span of the trace; for each image and stage, the gateway's call, the stage's call
    under it, and the stage's steps and the worker's compute under those. Returns the root."""
    root = _only(spans, name=root_name, kind=KIND_SERVER, service=GATEWAY)
    assert root.parent_id == caller_span
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    assert all(s.parent_id in ids for s in spans if s is not root), "every span hangs off the trace"
    assert not [s for s in spans if s.failed], [(s.name, s.status_message) for s in spans if s.failed]
    service_pids = mesh.child_pids()
    for stage in (0, 1):
        calls = [s for s in spans if s.kind == KIND_CLIENT and s.attributes["stagemesh.stage.id"] == stage]
        assert sorted(c.attributes["stagemesh.image.index"] for c in calls) == list(range(images))
        for call in calls:
            assert call.parent_id == root.span_id and call.name == EXECUTE and call.service == GATEWAY
            served = _children(spans, call)[EXECUTE]
            assert [s.service for s in served] == [f"stagemesh-stage-{stage}"] and served[0].kind == KIND_SERVER
            server = served[0]
            steps = _children(spans, server)
            assert sorted(steps) == sorted(STAGE_STEPS), sorted(steps)
            (queued,), (batch,), (delivery,) = steps["queue wait"], steps["batch"], steps["output delivery"]
            (compute,) = _children(spans, batch)["worker compute"]
            # In order: queued, handed to a worker, computed there, the outputs delivered.
            assert server.start_ns <= queued.start_ns <= queued.end_ns <= batch.start_ns
            assert batch.start_ns <= compute.start_ns <= compute.end_ns <= batch.end_ns
            assert delivery.start_ns == compute.end_ns and delivery.end_ns <= server.end_ns
            assert batch.attributes["stagemesh.batch.size"] >= 1
            # The compute ran in the stage's worker process: below the mesh, not one of its services.
            worker = compute.attributes["stagemesh.worker.pid"]
            assert worker in descendants(mesh.process.pid) and worker not in service_pids
    relays = [s for s in spans if s.name == "relay stage 0 -> stage 1"]
    assert len(relays) == images
    for relay in relays:
        assert relay.parent_id == root.span_id and relay.attributes["stagemesh.relay.bytes"] > 0
        assert relay.attributes["stagemesh.relay.tensors"] == ["hidden_states"]
    return root


@pytest.mark.mesh
def test_a_grpc_request_is_one_trace_continuing_the_callers(traced, collector):
    trace_id, caller_span, traceparent = _caller()
    with traced.channel() as channel:
        reply = traced.gateway(channel).GenerateUnary(
            gateway_pb2.GenerateUnaryRequest(params=_params(), request_id="traced-grpc"),
            timeout=RPC_TIMEOUT_S,
            metadata=(("traceparent", traceparent),),
        )
    assert reply.result.png.startswith(b"\x89PNG")
    unary = "stagemesh.v1.GatewayService/GenerateUnary"
    spans = _trace(collector, trace_id, unary)
    root = _check_request_trace(traced, spans, unary, caller_span)
    assert root.attributes["stagemesh.request_id"] == "traced-grpc"
    assert root.attributes["rpc.grpc.status_code"] == 0
    # Every service's log lines of the request carry the trace, and the span of its call.
    lines = [json.loads(line) for line in traced.logs().splitlines() if '"traced-grpc"' in line]
    done = {line["service"]: line for line in lines if line.get("event") == "rpc done"}
    assert set(done) == {"gateway", "stage-0", "stage-1"}
    assert all(line["trace_id"] == trace_id for line in done.values())
    assert done["gateway"]["span_id"] == root.span_id
    stage_server = _only(spans, service="stagemesh-stage-1", kind=KIND_SERVER)
    assert done["stage-1"]["span_id"] == stage_server.span_id


@pytest.mark.mesh
def test_the_images_of_a_request_share_a_batch_linked_to_each_other(traced, collector):
    trace_id, caller_span, traceparent = _caller()
    with traced.channel() as channel:
        events = list(
            traced.gateway(channel).Generate(
                gateway_pb2.GenerateRequest(params=_params(num_images=2)),
                timeout=RPC_TIMEOUT_S,
                metadata=(("traceparent", traceparent),),
            )
        )
    assert sum(e.HasField("result") for e in events) == 2
    generate = "stagemesh.v1.GatewayService/Generate"
    spans = _trace(collector, trace_id, generate, images=2)
    _check_request_trace(traced, spans, generate, caller_span, images=2)
    by_id = {s.span_id: s for s in spans}
    for batch in (s for s in spans if s.name == "batch"):
        # Linked to the Execute spans of the other requests it ran with.
        linked = [by_id[link] for link in batch.links]
        assert len(linked) == batch.attributes["stagemesh.batch.size"] - 1
        assert all(s.name == EXECUTE and s.service == batch.service for s in linked)
        assert batch.parent_id not in batch.links


@pytest.mark.mesh
def test_an_http_request_continues_the_callers_traceparent(traced, collector):
    trace_id, caller_span, traceparent = _caller()
    body = {"prompt": "a lighthouse", "size": "64x48", "num_inference_steps": 2, "response_format": "b64_json"}
    reply = httpx.post(
        f"http://{traced.http_address}/v1/images/generations",
        json=body,
        headers={"traceparent": traceparent},
        timeout=RPC_TIMEOUT_S,
    )
    assert reply.status_code == 200, reply.text
    spans = _trace(collector, trace_id, "POST /v1/images/generations")
    root = _check_request_trace(traced, spans, "POST /v1/images/generations", caller_span)
    assert root.attributes["http.route"] == "/v1/images/generations"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["stagemesh.request_id"] == reply.headers["x-request-id"]


def _refusal(collector: Collector, trace_id: str, name: str) -> Span:
    collector.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == name for s in spans))
    spans = collector.trace(trace_id)
    assert [s.name for s in spans] == [name], "refused before any stage was called"
    return spans[0]


@pytest.mark.mesh
def test_a_refused_request_has_a_span_saying_why(traced, collector):
    unary = "stagemesh.v1.GatewayService/GenerateUnary"
    with traced.channel() as channel:
        gateway = traced.gateway(channel)
        trace_id, _, traceparent = _caller()
        with pytest.raises(grpc.RpcError) as bad:
            gateway.GenerateUnary(
                gateway_pb2.GenerateUnaryRequest(params=_params(width=0)),
                timeout=RPC_TIMEOUT_S,
                metadata=(("traceparent", traceparent),),
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        span = _refusal(collector, trace_id, unary)
        assert span.failed and span.status_message.startswith("INVALID_ARGUMENT: ") and "width" in span.status_message
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert span.attributes["error.type"] == "INVALID_ARGUMENT"

        gateway.PauseGeneration(gateway_pb2.PauseGenerationRequest(), timeout=RPC_TIMEOUT_S)
        try:
            trace_id, _, traceparent = _caller()
            with pytest.raises(grpc.RpcError) as paused:
                gateway.GenerateUnary(
                    gateway_pb2.GenerateUnaryRequest(params=_params()),
                    timeout=RPC_TIMEOUT_S,
                    metadata=(("traceparent", traceparent),),
                )
            assert paused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            span = _refusal(collector, trace_id, unary)
            assert span.failed and span.status_message == f"FAILED_PRECONDITION: {paused.value.details()}"
            assert "paused" in span.status_message

            trace_id, _, traceparent = _caller()
            reply = httpx.post(
                f"http://{traced.http_address}/v1/images/generations",
                json={"prompt": "a lighthouse", "size": "64x48"},
                headers={"traceparent": traceparent},
                timeout=RPC_TIMEOUT_S,
            )
            assert reply.status_code == 409
            span = _refusal(collector, trace_id, "POST /v1/images/generations")
            assert span.failed and span.status_message == f"FAILED_PRECONDITION: {reply.json()['error']['message']}"
            assert span.attributes["http.response.status_code"] == 409
        finally:
            gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)


@pytest.mark.mesh
def test_control_calls_are_traced_and_polls_are_not(traced, collector):
    """A ListStages and a Sleep carry their trace to the stages (DescribeStage, SleepStage under
    them); the gateway's DescribeStage polls while stages load and probes' /health start none."""
    assert not [s for s in collector.spans() if s.name.endswith("/DescribeStage") and not s.parent_id]
    assert httpx.get(f"http://{traced.http_address}/health", timeout=RPC_TIMEOUT_S).status_code == 200
    calls = {}
    with traced.channel() as channel:
        gateway = traced.gateway(channel)
        for name, call, request, stage_method in (
            ("ListStages", gateway.ListStages, gateway_pb2.ListStagesRequest(), "DescribeStage"),
            ("Sleep", gateway.Sleep, gateway_pb2.SleepRequest(stage_ids=[1], level=1), "SleepStage"),
            ("WakeUp", gateway.WakeUp, gateway_pb2.WakeUpRequest(stage_ids=[1]), "WakeUpStage"),
        ):
            trace_id, caller_span, traceparent = _caller()
            call(request, timeout=RPC_TIMEOUT_S, metadata=(("traceparent", traceparent),))
            calls[name] = (trace_id, caller_span, stage_method)
        gateway.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=RPC_TIMEOUT_S)
    for name, (trace_id, caller_span, stage_method) in calls.items():
        stages = ["stagemesh-stage-0", "stagemesh-stage-1"] if name == "ListStages" else ["stagemesh-stage-1"]
        method, top = f"stagemesh.v1.StageService/{stage_method}", f"stagemesh.v1.GatewayService/{name}"
        count = len(stages)

        def arrived(spans, trace_id=trace_id, method=method, top=top, count=count) -> bool:
            names = [s.name for s in spans if s.trace_id == trace_id]
            return names.count(method) == count and top in names

        spans = [s for s in collector.wait_for(arrived) if s.trace_id == trace_id]
        root = _only(spans, name=top)
        assert root.parent_id == caller_span and not root.failed
        assert sorted(s.service for s in spans if s.name == method) == stages, name
        # WakeUp also asks the stages whether they sleep (DescribeStage): all under the call.
        below = [s for s in spans if s is not root]
        assert all(s.parent_id == root.span_id and s.kind == KIND_SERVER for s in below), name
        assert all(s.name.startswith("stagemesh.v1.StageService/") for s in below), name
    assert not [s for s in collector.spans() if s.attributes.get("url.path") == "/health"]


@pytest.mark.mesh
def test_with_tracing_off_nothing_is_exported_and_the_sdk_is_never_imported(tmp_path, tiny_model):
    """OTEL_TRACES_EXPORTER=none with a collector's endpoint set: no span reaches it, and no process
    of the mesh (workers included) imports opentelemetry.sdk, as every import the processes make,
    listed by PYTHONPROFILEIMPORTTIME, shows."""
    off = Collector()
    try:
        config = write_config(tmp_path / "mesh.toml", tiny_model, extra_gateway="http_port = 0")
        env = {
            **_without_otel(dict(os.environ)),
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": off.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "PYTHONPROFILEIMPORTTIME": "1",
        }
        with clean_mesh(config, tmp_path / "mesh.log", env=env) as mesh:
            _, _, traceparent = _caller()
            with mesh.channel() as channel:
                reply = mesh.gateway(channel).GenerateUnary(
                    gateway_pb2.GenerateUnaryRequest(params=_params()),
                    timeout=RPC_TIMEOUT_S,
                    metadata=(("traceparent", traceparent),),
                )
            assert reply.result.png.startswith(b"\x89PNG")
            body = {"prompt": "a lighthouse", "size": "64x48", "num_inference_steps": 2}
            assert httpx.post(f"http://{mesh.http_address}/v1/images/generations", json=body, timeout=60).is_success
            time.sleep(1.0)  # twenty export batches' time
            log = mesh.logs()
        assert off.spans() == []
        imports = [line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:")]
        assert "stagemesh.core.tracing" in imports and "torch" in imports  # the services and the workers
        assert not [name for name in imports if name.startswith("opentelemetry.sdk")]
        assert '"trace_id"' not in log
    finally:
        off.stop()


@pytest.mark.parametrize(
    "value, want",
    [("", []), ("none", []), ("otlp", ["otlp"]), (" OTLP , console ", ["otlp", "console"]), ("otlp,none", ["otlp"])],
)
def test_the_switch_is_otel_traces_exporter(value, want):
    assert tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": value}) == want
    assert tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": value, "OTEL_SDK_DISABLED": "true"}) == []


def test_an_unknown_exporter_refuses_the_start_naming_the_variable(tmp_path):
    with pytest.raises(errors.InvalidArgument, match=r"\$OTEL_TRACES_EXPORTER: 'zipkin' is not an exporter"):
        tracing.exporters_wanted({"OTEL_TRACES_EXPORTER": "zipkin"})
    env = {**_without_otel(dict(os.environ)), "OTEL_TRACES_EXPORTER": "zipkin"}
    started = subprocess.run(
        [sys.executable, "-m", "stagemesh", "gateway", "--stage", "127.0.0.1:1", "--port", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2, started.stderr
    assert "OTEL_TRACES_EXPORTER: 'zipkin' is not an exporter; allowed: otlp, console, none" in started.stderr
