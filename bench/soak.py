"""Soak: a real mesh (`stagemesh up`, the tiny model) under mixed traffic for a long time.

For `--minutes`, at once:
  - `--clients` clients call GenerateUnary in a loop (`--size`, `--steps`; `--think-ms` between
    calls; a refused call is retried after a short pause);
  - every `--sleep-every-s` seconds a Sleep of stage 0, 1 or both at level 1 or 2, held for
    `--sleep-hold-s`, then WakeUp and ResumeGeneration (an AR stage keeps the pipeline paused
    until ResumeGeneration);
  - every `--kill-every-s` seconds a SIGKILL to a worker process (stage 0 and 1 in turn), found
    as the stage service's child through /proc.
Reports requests served, errors by status code, control outcomes, kills and restarts (workers
and services, from the mesh log), RSS of every mesh process and /dev/shm use at the start (after
a warm-up) and at the end, with a sample every minute; then stops the mesh and checks that it
left nothing behind. The JSON also lists incidents (kills, failed control calls and ACKs, with
their time) and the slowest served calls; the mesh log is kept (`--log`).

    python3 bench/soak.py [--minutes 30] [--output bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: `python3 bench/soak.py`
    sys.path.insert(0, str(REPO))

import grpc

from bench import common
from bench.load import _cmdline, mesh_processes, mesh_segments, process_resources
from bench.mesh_overhead import start_mesh, stop_mesh
from stagemesh.core import rpc
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.meshproc import Mesh, alive, descendants, segments_of, shm_entries, write_config

DEFAULT_OUTPUT = REPO / "bench" / "results" / "soak.json"
DEFAULT_LOG = Path(tempfile.gettempdir()) / "stagemesh-soak-mesh.log"
CALL_TIMEOUT_S = 30.0
RETRY_PAUSE_S = 0.05
SAMPLE_EVERY_S = 60.0
MAX_INCIDENTS = 500
SLOWEST_KEPT = 10


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
        "rss_bytes": rss,
        "rss_total_bytes": sum(rss.values()),
        "shm_segments": len(segments),
        "shm_bytes": shm_bytes,
    }


def log_counts(mesh: Mesh) -> dict:
    text = mesh.logs()
    return {
        "worker_restarts": text.count('"event": "worker restarted"'),
        "worker_deaths": text.count('"event": "worker died"'),
        "service_restarts": text.count('"event": "child exited; restarting"'),
        "tracebacks": text.count("Traceback"),
    }


# the traffic --------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, mesh: Mesh):
        self.args, self.mesh = args, mesh
        self.deadline = 0.0
        self.statuses: collections.Counter = collections.Counter()
        self.latencies_ms: list[float] = []
        self.control: collections.Counter = collections.Counter()
        self.control_ms: dict[str, list[float]] = collections.defaultdict(list)
        self.kills: collections.Counter = collections.Counter()
        self.samples: list[dict] = []
        self.rng = random.Random(args.seed)
        self.started = self.started_perf = 0.0
        # For explaining outliers afterwards: what went wrong when, and when the slowest calls ran.
        self.incidents: list[dict] = []
        self.slowest: list[tuple[float, float]] = []  # (ms, start offset s), a min-heap of the top ones

    def note(self, **incident) -> None:
        if len(self.incidents) < MAX_INCIDENTS:
            self.incidents.append({"t_s": round(time.monotonic() - self.started, 2), **incident})

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    async def client(self, index: int) -> None:
        a = self.args
        async with grpc.aio.insecure_channel(self.mesh.address, options=rpc.channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            n = 0
            while self.running():
                n += 1
                params = generation_pb2.GenerationParams(
                    prompt=f"soak {index}",
                    width=a.size,
                    height=a.size,
                    num_inference_steps=a.steps,
                    seed=index * 10**6 + n,
                )
                started = time.perf_counter()
                try:
                    await stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=CALL_TIMEOUT_S)
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                self.statuses[code] += 1
                if code == "OK":
                    ms = (time.perf_counter() - started) * 1e3
                    self.latencies_ms.append(ms)
                    heapq.heappush(self.slowest, (ms, round(started - self.started_perf, 2)))
                    if len(self.slowest) > SLOWEST_KEPT:
                        heapq.heappop(self.slowest)
                    await asyncio.sleep(a.think_ms / 1e3)
                else:
                    await asyncio.sleep(RETRY_PAUSE_S)

    async def _control_call(self, name: str, call) -> object | None:
        started = time.perf_counter()
        try:
            reply = await call
        except grpc.aio.AioRpcError as err:
            self.control[f"{name} {err.code().name}"] += 1
            self.note(call=name, code=err.code().name, details=err.details())
            return None
        self.control_ms[name].append((time.perf_counter() - started) * 1e3)
        for ack in getattr(reply, "acks", ()):
            if ack.status != control_pb2.ACK_STATUS_SUCCESS:
                self.note(call=name, stage_id=ack.stage_id, rank=ack.rank, error=ack.error)
        status = getattr(reply, "status", None)
        self.control[f"{name} {control_pb2.ControlStatus.Name(status) if status is not None else 'OK'}"] += 1
        return reply

    async def sleeper(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        a = self.args
        while await self._pause(a.sleep_every_s):
            ids = self.rng.choice([[0], [1], [0, 1]])
            level = self.rng.choice([1, 2])
            await self._control_call(
                f"sleep L{level}",
                stub.Sleep(gateway_pb2.SleepRequest(stage_ids=ids, level=level), timeout=CALL_TIMEOUT_S),
            )
            await asyncio.sleep(a.sleep_hold_s)  # clients meet FAILED_PRECONDITION meanwhile
            await self._control_call(
                "wake", stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=ids), timeout=CALL_TIMEOUT_S)
            )
            await self._control_call(
                "resume", stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=CALL_TIMEOUT_S)
            )

    async def killer(self) -> None:
        stage = 0
        while await self._pause(self.args.kill_every_s):
            procs = await asyncio.to_thread(mesh_processes, self.mesh.process.pid)
            worker = procs.get(f"stage-{stage}/worker-0")
            if worker is None:
                self.kills[f"stage-{stage} worker not found"] += 1
            else:
                os.kill(worker, signal.SIGKILL)
                self.kills[f"stage-{stage} worker"] += 1
                self.note(kill=f"stage-{stage}/worker-0", pid=worker)
            stage = 1 - stage

    async def sampler(self) -> None:
        while await self._pause(SAMPLE_EVERY_S):
            self.samples.append(await asyncio.to_thread(memory_snapshot, self.mesh))
            done = sum(self.statuses.values())
            print(
                f"[{len(self.samples):3d} min] requests {done}, statuses {dict(self.statuses)}, "
                f"kills {sum(self.kills.values())}, RSS {self.samples[-1]['rss_total_bytes'] / 1e6:.0f} MB",
                flush=True,
            )

    async def _pause(self, seconds: float) -> bool:
        """Wait `seconds` (less at the end); True while the soak should go on."""
        await asyncio.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))
        return self.running()

    async def run(self) -> None:
        self.started, self.started_perf = time.monotonic(), time.perf_counter()
        self.deadline = self.started + self.args.minutes * 60
        async with grpc.aio.insecure_channel(self.mesh.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            tasks = [self.client(i) for i in range(self.args.clients)] + [self.sampler()]
            if self.args.sleep_every_s > 0:
                tasks.append(self.sleeper(stub))
            if self.args.kill_every_s > 0:
                tasks.append(self.killer())
            await asyncio.gather(*tasks)
            # Leave the mesh awake and open, whatever the last control call did.
            await stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=[0, 1]), timeout=CALL_TIMEOUT_S)
            await stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=CALL_TIMEOUT_S)


# the script ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long (default: 30)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent Generate clients (default: 3)")
    parser.add_argument("--think-ms", type=float, default=50.0, help="pause after each served call (default: 50)")
    parser.add_argument("--size", type=int, default=64, help="width and height (default: 64)")
    parser.add_argument("--steps", type=int, default=2, help="num_inference_steps (default: 2)")
    parser.add_argument("--sleep-every-s", type=float, default=20.0, help="Sleep/WakeUp period, 0: none (default: 20)")
    parser.add_argument("--sleep-hold-s", type=float, default=1.0, help="time asleep each cycle (default: 1)")
    parser.add_argument("--kill-every-s", type=float, default=45.0, help="worker SIGKILL period, 0: none (default: 45)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the control mix (default: 0)")
    parser.add_argument("--model-dir", default=None, help="model folder (default: the embedded model's cache)")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"JSON result file (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--log", default=str(DEFAULT_LOG), help=f"the mesh's log, kept (default: {DEFAULT_LOG})")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1:
        parser.error("--minutes must be > 0 and --clients >= 1")
    return args


def warm_up(mesh: Mesh, args: argparse.Namespace, requests: int = 20) -> None:
    """A few requests first, so the start figures are of a mesh that has served, not of one that just loaded."""
    params = generation_pb2.GenerationParams(
        prompt="warm-up", width=args.size, height=args.size, num_inference_steps=args.steps
    )
    with mesh.channel() as channel:
        for _ in range(requests):
            mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=CALL_TIMEOUT_S)


def soak(args: argparse.Namespace, mesh: Mesh) -> dict:
    seen: set[int] = set()
    run = Soak(args, mesh)
    warm_up(mesh, args)
    start = memory_snapshot(mesh)
    started = time.monotonic()
    asyncio.run(run.run())
    duration_s = time.monotonic() - started
    seen.update(descendants(mesh.process.pid))
    end = memory_snapshot(mesh)
    served = run.statuses.get("OK", 0)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("output", "log")},
        "mesh_log": args.log,
        "duration_s": duration_s,
        "requests": {
            "total": sum(run.statuses.values()),
            "served": served,
            "by_status": dict(run.statuses),
            "qps_served": served / duration_s,
        },
        "latency_ms_served": common.summarize(run.latencies_ms) if run.latencies_ms else None,
        "control": dict(run.control),
        "control_latency_ms": {k: common.summarize(v) for k, v in run.control_ms.items()},
        "kills": dict(run.kills),
        "incidents": run.incidents,
        "slowest_served": [{"ms": ms, "started_s": t} for ms, t in sorted(run.slowest, reverse=True)],
        "memory": {"start": start, "end": end, "samples": run.samples},
        "pids_seen": sorted(seen | mesh.child_pids()),
    }


def report(r: dict) -> None:
    req, mem = r["requests"], r["memory"]
    print(
        f"\nsoak: {r['duration_s'] / 60:.1f} min, {req['total']} requests, {req['served']} served "
        f"({req['qps_served']:.1f}/s)"
    )
    common.print_table(["status", "count"], sorted(req["by_status"].items(), key=lambda kv: -kv[1]))
    print()
    common.print_table(["control call -> outcome", "count"], sorted(r["control"].items()))
    print()
    common.print_table(["event", "count"], [*sorted(r["kills"].items()), *sorted(r["log"].items())])
    print()
    names = sorted(set(mem["start"]["rss_bytes"]) | set(mem["end"]["rss_bytes"]))
    rows = [[n, mem["start"]["rss_bytes"].get(n, 0) / 1e6, mem["end"]["rss_bytes"].get(n, 0) / 1e6] for n in names]
    rows += [
        ["total RSS", mem["start"]["rss_total_bytes"] / 1e6, mem["end"]["rss_total_bytes"] / 1e6],
        ["/dev/shm (segments)", float(mem["start"]["shm_segments"]), float(mem["end"]["shm_segments"])],
        ["/dev/shm MB", mem["start"]["shm_bytes"] / 1e6, mem["end"]["shm_bytes"] / 1e6],
    ]
    common.print_table(["memory (MB)", "start", "end"], rows, floatfmt=".1f")
    slow = ", ".join(f"{x['ms']:.0f} ms at {x['started_s']:.0f} s" for x in r["slowest_served"][:3])
    print(f"\nslowest served: {slow}; incidents recorded: {len(r['incidents'])} (see the JSON)")
    s = r["stop"]
    print(
        f"\nstop: exit code {s['exit_code']}, segments left {len(s['segments_left'])}, "
        f"processes left {len(s['processes_left'])}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.prepare_mesh_run(args)
    with tempfile.TemporaryDirectory(prefix="stagemesh-soak-") as tmp:
        root = Path(tmp)
        shm_before = shm_entries()
        mesh = start_mesh(write_config(root / "mesh.toml", Path(args.model_dir)), Path(args.log))
        print(f"mesh up at {mesh.address}; soaking for {args.minutes:g} min", flush=True)
        try:
            results = soak(args, mesh)
        finally:
            code = stop_mesh(mesh)
        pids = set(results["pids_seen"]) | mesh.child_pids()
        results["log"] = log_counts(mesh)
        results["stop"] = {
            "exit_code": code,
            "segments_left": sorted(segments_of(shm_entries() - shm_before, pids)),
            "processes_left": sorted(p for p in pids if alive(p) and "stagemesh" in " ".join(_cmdline(p))),
        }
    report(results)
    print(f"wrote {common.write_json(args.output, 'soak', results)}")
    return 0


if __name__ == "__main__":
    common.run_mesh_script(main)
