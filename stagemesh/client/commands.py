"""Client commands: `stagemesh generate` (with a progress bar) and `stagemesh status`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import cast

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stagemesh.core import auth, rpc, tls
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2

ADDRESS_ENV = "STAGEMESH_ADDRESS"
DEFAULT_ADDRESS = "127.0.0.1:50051"
_STATE_NAMES = {v.number: v.name.removeprefix("STAGE_STATE_").lower() for v in gateway_pb2.StageState.DESCRIPTOR.values}


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS)


def _channel(args) -> grpc.Channel:
    """TLS verified by --tls-ca (or $STAGEMESH_TLS_CA) when given, else plaintext."""
    return tls.channel(args.address, args.tls_ca or tls.env_ca(), rpc.channel_options())


def describe_error(exc: grpc.RpcError) -> str:
    """One readable line per problem, field violations included."""
    lines = [f"{exc.code().name}: {exc.details()}"]
    # A sync call's RpcError is also its grpc.Call (code, details, trailing metadata).
    status = rpc_status.from_call(cast(grpc.Call, exc))
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            lines = [f"{exc.code().name}:"] + [f"  {v.field}: {v.description}" for v in bad.field_violations]
    return "\n".join(lines)


def _progress_bar(step: int, total: int, width: int = 30) -> str:
    filled = width * step // max(total, 1)
    return f"\r  denoising [{'#' * filled}{'.' * (width - filled)}] {step}/{total}"


def _output_problem(path: Path) -> str | None:
    """Why the PNG could not be written there, asked before generating rather than after."""
    folder = path.parent
    if not folder.is_dir():
        return f"-o {path}: the folder {folder} does not exist"
    if path.is_dir():
        return f"-o {path}: is a folder; give a file name"
    if not os.access(folder, os.W_OK):
        return f"-o {path}: the folder {folder} is not writable"
    return None


def generate(args) -> int:
    problem = _output_problem(Path(args.output))
    if problem:
        print(f"stagemesh generate: {problem}", file=sys.stderr)
        return 2
    params = generation_pb2.GenerationParams(prompt=args.prompt, output_format=generation_pb2.OUTPUT_FORMAT_PNG)
    for field, value in (
        ("width", args.width if args.width is not None else args.size),
        ("height", args.height if args.height is not None else args.size),
        ("num_inference_steps", args.steps),
    ):
        if value is not None:
            setattr(params, field, value)
    if args.guidance is not None:
        params.guidance_scale = args.guidance
    if args.seed is not None:
        params.seed = args.seed
    with _channel(args) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            for event in stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=args.timeout):
                which = event.WhichOneof("event")
                if which == "stage_started":
                    print(
                        f"stage {event.stage_started.stage_id} ({event.stage_started.kind}) started",
                        file=sys.stderr,
                        flush=True,
                    )
                elif which == "denoising_step":
                    s = event.denoising_step
                    print(
                        _progress_bar(s.step, s.total),
                        end="\n" if s.step == s.total else "",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    result = event.result
        except grpc.RpcError as exc:
            print(describe_error(exc), file=sys.stderr)
            return 1
    Path(args.output).write_bytes(result.png)
    print(f"wrote {args.output} ({result.width}x{result.height}, seed {result.seed}, request {result.request_id})")
    return 0


def status(args) -> int:
    with _channel(args) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            reply = stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(describe_error(exc), file=sys.stderr)
            return 1
    print(f"{'stage':>5}  {'kind':<10} {'state':<12} {'replicas':>8}  {'device':<8} {'device memory':>14}")
    for s in reply.stages:
        print(
            f"{s.stage_id:>5}  {s.kind:<10} {_STATE_NAMES.get(s.state, '?'):<12} {s.replicas:>8}  "
            f"{s.device or '-':<8} {s.device_memory_bytes / 2**20:>11.1f} MiB"
            + (f"  (sleep level {s.sleep_level})" if s.sleep_level else "")
        )
    print(f"generation: {'paused' if reply.generation_paused else 'open'}")
    return 0


_ACK_STATUS = {v.number: v.name.removeprefix("ACK_STATUS_") for v in control_pb2.AckStatus.DESCRIPTOR.values}
_CONTROL_STATUS = {
    v.number: v.name.removeprefix("CONTROL_STATUS_") for v in control_pb2.ControlStatus.DESCRIPTOR.values
}


def _control_call(args, method: str, request) -> int:
    metadata = auth.bearer_metadata(auth.load_token(args.token_file))
    with _channel(args) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            if getattr(args, "all", False):  # sleep/wakeup --all: every stage the gateway lists
                listing = stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=args.timeout)
                request.stage_ids.extend(s.stage_id for s in listing.stages)
            reply = getattr(stub, method)(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as exc:
            print(describe_error(exc), file=sys.stderr)
            return 1
    if hasattr(reply, "status"):
        reason = f" ({reply.reason})" if getattr(reply, "reason", "") else ""
        print(f"{_CONTROL_STATUS.get(reply.status, '?')}{reason}")
        for ack in reply.acks:
            line = (
                f"  stage {ack.stage_id} rank {ack.rank}: {_ACK_STATUS.get(ack.status, '?')} level {ack.level} "
                f"{ack.freed_bytes / 2**20:.1f} MiB in {ack.latency_ms:.1f} ms"
            )
            print(line + (f" ({ack.error})" if ack.error else ""))
        return 0 if reply.status != control_pb2.CONTROL_STATUS_ERROR else 1
    print("ok")
    return 0


def sleep(args) -> int:
    request = gateway_pb2.SleepRequest(stage_ids=args.stage)
    if args.level is not None:
        request.level = args.level
    return _control_call(args, "Sleep", request)


def wakeup(args) -> int:
    return _control_call(args, "WakeUp", gateway_pb2.WakeUpRequest(stage_ids=args.stage))


def pause(args) -> int:
    return _control_call(args, "PauseGeneration", gateway_pb2.PauseGenerationRequest())


def resume(args) -> int:
    return _control_call(args, "ResumeGeneration", gateway_pb2.ResumeGenerationRequest())
