"""What bench/soak.py measures of the mesh itself: memory and /dev/shm samples, the mesh log's
restart counts, and the recovery phase at the end (continue what is stopped, wake, resume, then
every stage must be serving and a Generate must succeed, within a time bound)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc

from bench.meshes import mesh_processes, mesh_segments, process_resources
from bench.soak_faults import CALL_TIMEOUT_S, Processes, control_outcome, finish
from stagemesh.core import rpc
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.meshproc import Mesh

RECOVERY_RETRY_S = 1.0
LIST_TIMEOUT_S = 5.0


# what the mesh holds ------------------------------------------------------------------------
def memory_snapshot(mesh: Mesh) -> dict:
    """RSS of every mesh process (`up` included) and the /dev/shm segments they own."""
    procs = {"up": mesh.process.pid, **mesh_processes(mesh.process.pid)}
    rss = {name: (process_resources(pid) or {}).get("rss_bytes", 0) for name, pid in procs.items()}
    segments = mesh_segments(procs.values())
    shm_bytes = 0
    for name in segments:
        try:
            shm_bytes += os.stat(f"/dev/shm/{name}").st_blocks * 512  # pages really in use
        except OSError:
            pass
    return {
        "t": time.time(),
        "pids": procs,
        "rss_bytes": rss,
        "rss_total_bytes": sum(rss.values()),
        "shm_segments": len(segments),
        "shm_bytes": shm_bytes,
    }


def rss_growth(first: dict, last: dict) -> dict[str, dict]:
    """Per process name: RSS at the first and last sample; a new pid means it was restarted between."""
    out = {}
    for name in sorted(set(first["rss_bytes"]) & set(last["rss_bytes"])):
        start, end = first["rss_bytes"][name], last["rss_bytes"][name]
        out[name] = {
            "start_mb": round(start / 1e6, 1),
            "end_mb": round(end / 1e6, 1),
            "growth_mb": round((end - start) / 1e6, 1),
            "restarted": first.get("pids", {}).get(name) != last.get("pids", {}).get(name),
        }
    return out


def log_counts(mesh: Mesh) -> dict:
    text = mesh.logs()
    return {
        "worker_restarts": text.count('"event": "worker restarted"'),
        "worker_deaths": text.count('"event": "worker died"'),
        "service_restarts": text.count('"event": "child exited; restarting"'),
        "service_restarts_failed": text.count('"event": "restart failed"'),
        "supervisor_gave_up": text.count('"event": "giving up"'),
        "tracebacks": text.count("Traceback"),
    }


# stage states -------------------------------------------------------------------------------
async def list_stages(stub: gateway_pb2_grpc.GatewayServiceStub, timeout: float = LIST_TIMEOUT_S) -> dict:
    """{"stages": [{"stage_id", "state", "sleep_level"}], "generation_paused"}, or {"error": code}."""
    code, reply = await finish(stub.ListStages(gateway_pb2.ListStagesRequest(), timeout=timeout), None)
    if reply is None:
        return {"error": code}
    stages = [
        {
            "stage_id": s.stage_id,
            "state": gateway_pb2.StageState.Name(s.state).removeprefix("STAGE_STATE_"),
            "sleep_level": s.sleep_level,
        }
        for s in reply.stages
    ]
    return {"stages": stages, "generation_paused": reply.generation_paused}


def every_stage_serving(listing: dict) -> bool:
    stages = listing.get("stages") or []
    return (
        bool(stages)
        and not listing["generation_paused"]
        and all(s["state"] == "SERVING" and s["sleep_level"] == 0 for s in stages)
    )


def describe(listing: dict) -> str:
    """ "0:SERVING 1:SLEEPING(L2) paused" for a progress line."""
    if "error" in listing:
        return f"ListStages {listing['error']}"
    states = " ".join(
        f"{s['stage_id']}:{s['state']}" + (f"(L{s['sleep_level']})" if s["sleep_level"] else "")
        for s in listing["stages"]
    )
    return states + (" paused" if listing["generation_paused"] else "")


# recovery -----------------------------------------------------------------------------------
async def recover(mesh: Mesh, procs: Processes, budget_s: float, params: generation_pb2.GenerationParams) -> dict:
    """SIGCONT anything stopped, then WakeUp + ResumeGeneration until every stage is serving and
    awake and a Generate succeeds, or `budget_s` runs out. Returns what was seen, and how long it took."""
    started = time.monotonic()
    deadline = started + budget_s
    continued = await asyncio.to_thread(procs.continue_all)
    attempts, last = 0, {}
    async with grpc.aio.insecure_channel(mesh.address, options=rpc.channel_options()) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        at_start = await list_stages(stub)
        while time.monotonic() < deadline:
            attempts += 1
            last = await _attempt(stub, deadline, params)
            if last["ok"]:
                break
            await asyncio.sleep(max(0.0, min(RECOVERY_RETRY_S, deadline - time.monotonic())))
    return {
        "succeeded": bool(last.get("ok")),
        "seconds": round(time.monotonic() - started, 1),
        "budget_s": budget_s,
        "attempts": attempts,
        "continued": continued,
        "stages_at_start": at_start,
        "last_attempt": last,
        "diagnosis": [] if last.get("ok") else diagnose(last),
    }


def diagnose(attempt: dict) -> list[str]:
    """What kept the last recovery attempt from succeeding, in words."""
    listing = attempt.get("list_stages") or {"error": "not reached"}
    if "error" in listing:
        return [
            f"ListStages {listing['error']}; WakeUp {attempt.get('wake')}, ResumeGeneration {attempt.get('resume')}"
        ]
    out = []
    for s in listing["stages"]:
        if s["sleep_level"] and attempt.get("wake") == "OK skipped":
            out.append(
                f"stage {s['stage_id']} reports sleep level {s['sleep_level']} but WakeUp skips it: "
                "the gateway does not count it as asleep"
            )
        elif s["state"] != "SERVING" or s["sleep_level"]:
            out.append(
                f"stage {s['stage_id']} {s['state']} (sleep level {s['sleep_level']}), WakeUp {attempt.get('wake')}"
            )
    if listing["generation_paused"]:
        out.append(f"generation still paused after ResumeGeneration ({attempt.get('resume')})")
    if "generate" in attempt and attempt["generate"] != "OK":
        out.append(f"every stage serving, but Generate {attempt['generate']}")
    return out


async def _attempt(stub: gateway_pb2_grpc.GatewayServiceStub, deadline: float, params) -> dict:
    def timeout() -> float:
        return max(0.1, min(CALL_TIMEOUT_S, deadline - time.monotonic()))

    out: dict = {"t_left_s": round(deadline - time.monotonic(), 1)}
    wake = stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=timeout())
    out["wake"] = control_outcome(*await finish(wake, None))
    resume = stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=timeout())
    out["resume"] = control_outcome(*await finish(resume, None))
    out["list_stages"] = await list_stages(stub, min(LIST_TIMEOUT_S, timeout()))
    out["ok"] = False
    if every_stage_serving(out["list_stages"]):
        generate = stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=timeout())
        out["generate"], _ = await finish(generate, None)
        out["ok"] = out["generate"] == "OK"
    return out
