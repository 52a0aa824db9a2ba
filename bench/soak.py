"""Soak: a real mesh (`stagemesh up`, the tiny model) under mixed traffic and faults for a long time.

For `--minutes`, at once:
  - `--clients` clients call GenerateUnary in a loop (`--size`, `--steps`; `--think-ms` between
    calls; a refused call is retried after a short pause);
  - every `--sleep-every-s` seconds a Sleep of stage 0, 1 or both at level 1 or 2, held for
    `--sleep-hold-s`, then WakeUp and ResumeGeneration (an AR stage keeps the pipeline paused
    until ResumeGeneration);
  - every `--kill-every-s` seconds a SIGKILL to a worker process (stage 0 and 1 in turn), found
    as the stage service's child through /proc;
and the chaos, at random points (periods jittered by 0.5-1.5x) from an RNG seeded with `--seed`:
  - `--chaos-clients` clients call GenerateUnary or streaming Generate (`--stream-fraction`) at
    random sizes up to `--max-size` and steps up to `--max-steps` (batches of different shapes
    queue behind each other), each with a random deadline of 1-30 s or, for
    `--short-deadline-fraction` of them, 5-500 ms; `--cancel-fraction` of the streams are
    cancelled by the client after a random number of progress events;
  - every `--control-every-s` seconds a Sleep (stage 0, 1 or both, level 1 or 2), WakeUp,
    PauseGeneration or ResumeGeneration, with a 5-500 ms deadline (`--short-deadline-fraction`)
    or cancelled 0-500 ms into the call (`--cancel-fraction`);
  - every `--stop-every-s` seconds a SIGSTOP of a worker or a service process (stage service,
    gateway, cache), continued after `--stop-min-s` to `--stop-max-s` seconds;
  - every `--kill-service-every-s` seconds a SIGKILL of a service (`up` restarts it; at most 3
    kills of one service per 300 s, below `up`'s restart limit).
Then a recovery phase of at most `--recovery-s`: SIGCONT anything still stopped, WakeUp every
stage, ResumeGeneration, until ListStages says every stage is SERVING and awake and a Generate
succeeds. Reports requests, errors by status code, the outcome of every kind of action, kills,
stops and restarts (the mesh log), RSS of every mesh process and /dev/shm use at the start (after
a warm-up) and at the end with a sample (and the stage states) every minute, how long recovery
took; then stops the mesh and counts what it left behind (/dev/shm segments, processes). The JSON
also lists incidents (faults, control calls, unexpected status codes, with their time) and the
slowest served calls; the mesh log is kept (`--log`). Exit code 1 when recovery failed or
something leaked.

    python -m bench.soak [--minutes 30] [--seed 0] [--output bench/results/soak.json]
    python -m bench.soak --minutes 3 --stop-every-s 10 --kill-service-every-s 25 --control-every-s 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import heapq
import random
import signal
import tempfile
import time
from pathlib import Path

import grpc

from bench import common
from bench.meshes import cmdline, start_mesh, stop_mesh
from bench.soak_checks import describe, list_stages, log_counts, memory_snapshot, recover, rss_growth
from bench.soak_faults import CALL_TIMEOUT_S, ChaosControl, ChaosGenerate, Processes, ProcessFaults, Tally
from bench.soak_report import failures, report
from stagemesh.core import rpc
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2
from tests.support.meshproc import Mesh, alive, descendants, segments_of, shm_entries, write_config

DEFAULT_LOG = Path(tempfile.gettempdir()) / "stagemesh-soak-mesh.log"
RETRY_PAUSE_S = 0.05
SAMPLE_EVERY_S = 60.0
SLOWEST_KEPT = 10
MESH_MAX_SIZE, MESH_MAX_STEPS = 512, 50  # stage 1's limits in tests.support.meshproc.write_config


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
        self.rng = random.Random(args.seed)  # the periodic Sleep cycle's; the chaos tasks have their own
        self.started_perf = 0.0
        # For explaining outliers afterwards: what went wrong when, and when the slowest calls ran.
        self.tally = Tally()
        self.procs = Processes(mesh.process.pid)
        self.slowest: list[tuple[float, float]] = []  # (ms, start offset s), a min-heap of the top ones
        self.recovery: dict = {}

    def note(self, **incident) -> None:
        self.tally.note(**incident)

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

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

    async def _control_call(self, name: str, call, **detail) -> object | None:
        """One call of the periodic Sleep cycle, counted and noted with its time (a wedge is read
        from the sequence of calls and faults)."""
        started = time.perf_counter()
        try:
            reply = await call
        except grpc.aio.AioRpcError as err:
            self.control[f"{name} {err.code().name}"] += 1
            ms = round((time.perf_counter() - started) * 1e3, 1)
            self.note(cycle=name, outcome=err.code().name, ms=ms, details=err.details(), **detail)
            return None
        ms = (time.perf_counter() - started) * 1e3
        self.control_ms[name].append(ms)
        status = getattr(reply, "status", None)
        outcome = control_pb2.ControlStatus.Name(status) if status is not None else "OK"
        self.control[f"{name} {outcome}"] += 1
        self.note(cycle=name, outcome=outcome, ms=round(ms, 1), **detail)
        for ack in getattr(reply, "acks", ()):
            if ack.status != control_pb2.ACK_STATUS_SUCCESS:
                self.note(cycle=name, stage_id=ack.stage_id, rank=ack.rank, error=ack.error)
        return reply

    async def sleeper(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        a = self.args
        while await self._pause(a.sleep_every_s):
            ids = self.rng.choice([[0], [1], [0, 1]])
            level = self.rng.choice([1, 2])
            await self._control_call(
                f"sleep L{level}",
                stub.Sleep(gateway_pb2.SleepRequest(stage_ids=ids, level=level), timeout=CALL_TIMEOUT_S),
                stage_ids=ids,
            )
            await asyncio.sleep(a.sleep_hold_s)  # clients meet FAILED_PRECONDITION meanwhile
            await self._control_call(
                "wake", stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=ids), timeout=CALL_TIMEOUT_S), stage_ids=ids
            )
            await self._control_call(
                "resume", stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=CALL_TIMEOUT_S)
            )

    async def killer(self) -> None:
        stage = 0
        while await self._pause(self.args.kill_every_s):
            procs = await asyncio.to_thread(self.procs.find)
            worker = procs.get(f"stage-{stage}/worker-0")
            if worker is None or not self.procs.target("worker", worker).signal(signal.SIGKILL):
                self.kills[f"stage-{stage} worker not found"] += 1
            else:
                self.procs.stopped.pop(worker, None)
                self.kills[f"stage-{stage} worker"] += 1
                self.note(kill=f"stage-{stage}/worker-0", pid=worker)
            stage = 1 - stage

    async def sampler(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        while await self._pause(SAMPLE_EVERY_S):
            sample = await asyncio.to_thread(memory_snapshot, self.mesh)
            self.procs.seen.update(sample["pids"].values())
            sample["stages"] = await list_stages(stub)
            self.samples.append(sample)
            done = sum(self.statuses.values())
            print(
                f"[{len(self.samples):3d} min] requests {done}, statuses {dict(self.statuses)}, "
                f"kills {sum(self.kills.values())}, RSS {sample['rss_total_bytes'] / 1e6:.0f} MB, "
                f"stages {describe(sample['stages'])}",
                flush=True,
            )

    async def _pause(self, seconds: float) -> bool:
        """Wait `seconds` (less at the end); True while the soak should go on."""
        await asyncio.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))
        return self.running()

    def _tasks(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> list:
        a = self.args
        chaos = ChaosGenerate(a, self.mesh.address, self.tally, self.running)
        faults = ProcessFaults(a, self.procs, self.tally, self._pause)
        tasks = [self.client(i) for i in range(a.clients)] + [self.sampler(stub)]
        tasks += [chaos.client(i) for i in range(a.chaos_clients)]
        periodic = [
            (a.sleep_every_s, lambda: self.sleeper(stub)),
            (a.kill_every_s, self.killer),
            (a.control_every_s, lambda: ChaosControl(a, self.tally, self._pause).loop(stub)),
            (a.stop_every_s, lambda: faults.stopper(self.seconds_left)),
            (a.kill_service_every_s, faults.service_killer),
        ]
        return tasks + [start() for period, start in periodic if period > 0]

    async def run(self) -> None:
        self.tally.started, self.started_perf = time.monotonic(), time.perf_counter()
        self.deadline = self.tally.started + self.args.minutes * 60
        async with grpc.aio.insecure_channel(self.mesh.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            await asyncio.gather(*self._tasks(stub))
        self.note(recovery="started")
        self.recovery = await recover(self.mesh, self.procs, self.args.recovery_s, warm_up_params(self.args))
        self.note(recovery="succeeded" if self.recovery["succeeded"] else "failed", seconds=self.recovery["seconds"])


# the script ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--minutes", type=float, default=30.0, help="how long (default: 30)")
    add("--clients", type=int, default=3, help="concurrent GenerateUnary clients (default: 3)")
    add("--think-ms", type=float, default=50.0, help="pause after each served call (default: 50)")
    add("--size", type=int, default=64, help="width and height (default: 64)")
    add("--steps", type=int, default=2, help="num_inference_steps (default: 2)")
    add("--sleep-every-s", type=float, default=20.0, help="Sleep/WakeUp period, 0: none (default: 20)")
    add("--sleep-hold-s", type=float, default=1.0, help="time asleep each cycle (default: 1)")
    add("--kill-every-s", type=float, default=45.0, help="worker SIGKILL period, 0: none (default: 45)")
    add("--chaos-clients", type=int, default=2, help="clients of random Generate calls (default: 2)")
    add("--stream-fraction", type=float, default=0.5, help="their share of streaming Generate (default: 0.5)")
    add("--max-size", type=int, default=256, help=f"their largest side, <= {MESH_MAX_SIZE} (default: 256)")
    add("--max-steps", type=int, default=8, help=f"their most steps, <= {MESH_MAX_STEPS} (default: 8)")
    add(
        "--short-deadline-fraction", type=float, default=0.2, help="chaos calls with a 5-500 ms deadline (default: 0.2)"
    )
    add("--cancel-fraction", type=float, default=0.2, help="chaos streams and control calls cancelled (default: 0.2)")
    add("--control-every-s", type=float, default=15.0, help="random control call period, 0: none (default: 15)")
    add("--stop-every-s", type=float, default=60.0, help="SIGSTOP/SIGCONT period, 0: none (default: 60)")
    add("--stop-min-s", type=float, default=1.0, help="shortest time stopped (default: 1)")
    add("--stop-max-s", type=float, default=15.0, help="longest time stopped (default: 15)")
    add("--kill-service-every-s", type=float, default=180.0, help="service SIGKILL period, 0: none (default: 180)")
    add("--recovery-s", type=float, default=120.0, help="most time the recovery phase may take (default: 120)")
    add("--seed", type=int, default=0, help="seed of the control mix and the chaos (default: 0)")
    add("--log", default=str(DEFAULT_LOG), help=f"the mesh's log, kept (default: {DEFAULT_LOG})")
    common.add_model_dir(parser, "default: the embedded model's cache folder")
    common.add_output(parser, "soak")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.chaos_clients < 0:
        parser.error("--minutes must be > 0, --clients >= 1 and --chaos-clients >= 0")
    if not (16 <= args.max_size <= MESH_MAX_SIZE and 1 <= args.max_steps <= MESH_MAX_STEPS):
        parser.error(f"--max-size must be 16 to {MESH_MAX_SIZE} and --max-steps 1 to {MESH_MAX_STEPS}")
    fractions = (args.stream_fraction, args.short_deadline_fraction, args.cancel_fraction)
    if not all(0 <= f <= 1 for f in fractions) or args.short_deadline_fraction + args.cancel_fraction > 1:
        parser.error("fractions must be 0 to 1, --short-deadline-fraction + --cancel-fraction at most 1")
    if not 0 < args.stop_min_s <= args.stop_max_s or args.recovery_s <= 0:
        parser.error("need 0 < --stop-min-s <= --stop-max-s and --recovery-s > 0")
    return args


def warm_up_params(args: argparse.Namespace) -> generation_pb2.GenerationParams:
    return generation_pb2.GenerationParams(
        prompt="warm-up", width=args.size, height=args.size, num_inference_steps=args.steps
    )


def warm_up(mesh: Mesh, args: argparse.Namespace, requests: int = 20) -> None:
    """A few requests first, so the start figures are of a mesh that has served, not of one that just loaded."""
    request = gateway_pb2.GenerateUnaryRequest(params=warm_up_params(args))
    with mesh.channel() as channel:
        for _ in range(requests):
            mesh.gateway(channel).GenerateUnary(request, timeout=CALL_TIMEOUT_S)


def soak(args: argparse.Namespace, mesh: Mesh) -> dict:
    run = Soak(args, mesh)
    warm_up(mesh, args)
    start = memory_snapshot(mesh)
    started = time.monotonic()
    asyncio.run(run.run())
    duration_s = time.monotonic() - started - run.recovery["seconds"]
    run.procs.seen.update(descendants(mesh.process.pid))
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
        "actions": {action: dict(outcomes) for action, outcomes in sorted(run.tally.outcomes.items())},
        "recovery": run.recovery,
        "incidents": run.tally.incidents,
        "incidents_dropped": run.tally.incidents_dropped,
        "slowest_served": [{"ms": ms, "started_s": t} for ms, t in sorted(run.slowest, reverse=True)],
        "memory": {"start": start, "end": end, "samples": run.samples, "rss_growth": rss_growth(start, end)},
        "pids_seen": sorted(run.procs.seen | set(start["pids"].values()) | mesh.child_pids()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.prepare_mesh_run(args)
    with tempfile.TemporaryDirectory(prefix="stagemesh-soak-") as tmp:
        root = Path(tmp)
        shm_before = shm_entries()
        mesh = start_mesh(write_config(root / "mesh.toml", Path(args.model_dir)), Path(args.log))
        print(f"mesh up at {mesh.address}; soaking for {args.minutes:g} min (seed {args.seed})", flush=True)
        try:
            results = soak(args, mesh)
        finally:
            code = stop_mesh(mesh)
        pids = set(results["pids_seen"]) | mesh.child_pids()
        results["log"] = log_counts(mesh)
        results["stop"] = {
            "exit_code": code,
            "segments_left": sorted(segments_of(shm_entries() - shm_before, pids)),
            "processes_left": sorted(p for p in pids if alive(p) and "stagemesh" in " ".join(cmdline(p))),
        }
    results["failures"] = failures(results)
    report(results)
    print(f"wrote {common.write_json(args.output, 'soak', results)}")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    common.run_mesh_script(main)
