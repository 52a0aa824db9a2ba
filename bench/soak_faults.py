"""The chaos half of bench/soak.py: Generate calls with random shapes and deadlines (some far too
short) or cancelled streams, control calls with short deadlines or cancelled mid-flight, and
SIGSTOP/SIGCONT and SIGKILL of worker and service processes, found through /proc.

Every choice comes from an RNG seeded with `--seed` and the task's name, so a run can be repeated
(the interleaving of the tasks with the mesh's own timing still varies).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.meshes import mesh_processes
from stagemesh.core import rpc
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2

CALL_TIMEOUT_S = 30.0
SHORT_DEADLINE_S = (0.005, 0.5)  # far too short for most calls, long enough for a few
CONTROL_CANCEL_AFTER_S = (0.0, 0.5)
PIXEL_MULTIPLE = 16
SERVICES = ("cache", "stage-0", "stage-1", "gateway")
MAX_INCIDENTS = 2000
# `stagemesh up` gives up on a child restarted 5 times within 300 s; stay below that.
SERVICE_KILLS_PER_WINDOW = 3
SERVICE_KILL_WINDOW_S = 300.0
EXPECTED_GENERATE_CODES = {"OK", "DEADLINE_EXCEEDED", "CANCELLED", "FAILED_PRECONDITION", "UNAVAILABLE"}


def task_rng(seed: int, name: str) -> random.Random:
    """One RNG per task: a task's choices do not depend on how the others interleave."""
    return random.Random(f"{seed}/{name}")


def jittered(rng: random.Random, period_s: float) -> float:
    return period_s * rng.uniform(0.5, 1.5)


class Tally:
    """Outcome counts per action and the time of every incident, shared by the soak's tasks."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.incidents: list[dict] = []
        self.incidents_dropped = 0

    def t_s(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def count(self, action: str, outcome: str) -> None:
        self.outcomes[action][outcome] += 1

    def note(self, **incident) -> None:
        if len(self.incidents) < MAX_INCIDENTS:
            self.incidents.append({"t_s": self.t_s(), **incident})
        else:
            self.incidents_dropped += 1


async def finish(call, cancel_after_s: float | None) -> tuple[str, object | None]:
    """Await a unary call, cancelling it after `cancel_after_s`; (status code name, reply or None)."""
    fired: list[bool] = []

    def cancel() -> None:
        fired.append(True)
        call.cancel()

    timer = asyncio.get_running_loop().call_later(cancel_after_s, cancel) if cancel_after_s is not None else None
    try:
        return "OK", await call
    except asyncio.CancelledError:
        if not fired:
            raise  # the soak itself is being cancelled
        return "CANCELLED", None
    except grpc.aio.AioRpcError as err:
        return err.code().name, None
    finally:
        if timer is not None:
            timer.cancel()


# processes, from /proc ----------------------------------------------------------------------
def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks: with the pid, it names one process even if the pid is reused."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Target:
    name: str  # "stage-1", "stage-0/worker-0", "gateway", ...
    pid: int
    started: int | None

    def signal(self, sig: signal.Signals) -> bool:
        """Send `sig` if this very process still lives; False once it is gone."""
        if start_time(self.pid) != self.started or self.started is None:
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


class Processes:
    """The mesh's processes: every pid ever seen, and the ones this soak has stopped."""

    def __init__(self, up_pid: int):
        self.up_pid = up_pid
        self.seen: set[int] = set()
        self.stopped: dict[int, Target] = {}

    def find(self) -> dict[str, int]:
        procs = mesh_processes(self.up_pid)
        self.seen.update(procs.values())
        return procs

    def target(self, name: str, pid: int) -> Target:
        return Target(name, pid, start_time(pid))

    def continue_all(self) -> list[str]:
        """SIGCONT what this soak stopped and any mesh process still stopped; the names continued."""
        continued = [t.name for t in self.stopped.values() if t.signal(signal.SIGCONT)]
        self.stopped.clear()
        for name, pid in self.find().items():
            if process_state(pid) == "T" and self.target(name, pid).signal(signal.SIGCONT):
                continued.append(name)
        return continued


# Generate traffic ---------------------------------------------------------------------------
class ChaosGenerate:
    """Generate and GenerateUnary with random sizes, steps and deadlines; some streams cancelled."""

    def __init__(self, args: argparse.Namespace, address: str, tally: Tally, running: Callable[[], bool]):
        self.args, self.address, self.tally, self.running = args, address, tally, running

    def params(self, rng: random.Random, seed: int) -> generation_pb2.GenerationParams:
        side = lambda: PIXEL_MULTIPLE * rng.randint(1, self.args.max_size // PIXEL_MULTIPLE)  # noqa: E731
        return generation_pb2.GenerationParams(
            prompt="chaos",
            width=side(),
            height=side(),
            num_inference_steps=rng.randint(1, self.args.max_steps),
            seed=seed,
        )

    def deadline(self, rng: random.Random) -> float:
        if rng.random() < self.args.short_deadline_fraction:
            return rng.uniform(*SHORT_DEADLINE_S)
        return rng.uniform(1.0, CALL_TIMEOUT_S)

    async def client(self, index: int) -> None:
        rng = task_rng(self.args.seed, f"generate-{index}")
        async with grpc.aio.insecure_channel(self.address, options=rpc.channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            n = 0
            while self.running():
                n += 1
                params, timeout = self.params(rng, seed=index * 10**6 + n), self.deadline(rng)
                if rng.random() >= self.args.stream_fraction:
                    action = "generate unary"
                    code, _ = await finish(
                        stub.GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=timeout), None
                    )
                else:
                    cancel_after = rng.randint(0, params.num_inference_steps + 1)
                    cancelled = rng.random() < self.args.cancel_fraction
                    action = "generate stream, cancelled" if cancelled else "generate stream"
                    code = await self._stream(stub, params, timeout, cancel_after if cancelled else None)
                self.tally.count(action, code)
                if code not in EXPECTED_GENERATE_CODES:
                    self.tally.note(call=action, code=code, size=[params.width, params.height])
                await asyncio.sleep(rng.uniform(0.0, 0.2))

    async def _stream(self, stub, params, timeout: float, cancel_after_events: int | None) -> str:
        """A streaming Generate, cancelled by the client after that many progress events (if given)."""
        call = stub.Generate(gateway_pb2.GenerateRequest(params=params), timeout=timeout)
        if cancel_after_events == 0:
            call.cancel()  # before the first event, maybe before the gateway has seen the call
            return (await call.code()).name
        events = 0
        try:
            async for event in call:
                if event.HasField("result"):
                    return "OK"
                events += 1
                if cancel_after_events is not None and events >= cancel_after_events:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as err:
            return err.code().name
        return (await call.code()).name


# control calls ------------------------------------------------------------------------------
class ChaosControl:
    """Sleep, WakeUp, PauseGeneration, ResumeGeneration at random, with random deadlines."""

    def __init__(self, args: argparse.Namespace, tally: Tally, pause: Callable):
        self.args, self.tally, self.pause = args, tally, pause
        self.rng = task_rng(args.seed, "control")

    def _call(self, stub: gateway_pb2_grpc.GatewayServiceStub, action: str, timeout: float):
        ids = self.rng.choice([[0], [1], [0, 1]])
        if action == "sleep":
            level = self.rng.choice([1, 2])
            return stub.Sleep(gateway_pb2.SleepRequest(stage_ids=ids, level=level), timeout=timeout), {
                "stage_ids": ids,
                "level": level,
            }
        if action == "wake":
            return stub.WakeUp(gateway_pb2.WakeUpRequest(stage_ids=ids), timeout=timeout), {"stage_ids": ids}
        if action == "pause":
            return stub.PauseGeneration(gateway_pb2.PauseGenerationRequest(), timeout=timeout), {}
        return stub.ResumeGeneration(gateway_pb2.ResumeGenerationRequest(), timeout=timeout), {}

    async def loop(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        a, rng = self.args, self.rng
        while await self.pause(jittered(rng, a.control_every_s)):
            action = rng.choice(["sleep", "wake", "pause", "resume"])
            mode = rng.random()
            timeout, cancel_after = CALL_TIMEOUT_S, None
            if mode < a.short_deadline_fraction:
                timeout = rng.uniform(*SHORT_DEADLINE_S)
            elif mode < a.short_deadline_fraction + a.cancel_fraction:
                cancel_after = rng.uniform(*CONTROL_CANCEL_AFTER_S)
            call, detail = self._call(stub, action, timeout)
            started = time.perf_counter()
            code, reply = await finish(call, cancel_after)
            outcome = control_outcome(code, reply)
            self.tally.count(action, outcome)
            self.tally.note(
                call=action,
                outcome=outcome,
                ms=round((time.perf_counter() - started) * 1e3, 1),
                deadline_s=round(timeout, 3),
                cancel_after_s=None if cancel_after is None else round(cancel_after, 3),
                **detail,
            )


def control_outcome(code: str, reply: object | None) -> str:
    """ "OK", "OK skipped", "ACK ERROR" (a worker failed) or the status code's name."""
    status = getattr(reply, "status", None) if code == "OK" else None
    if status == control_pb2.CONTROL_STATUS_SKIPPED:
        return "OK skipped"
    if status == control_pb2.CONTROL_STATUS_ERROR:
        return "ACK ERROR"
    return code


# process faults -----------------------------------------------------------------------------
class ProcessFaults:
    """SIGSTOP then SIGCONT of a worker or a service; SIGKILL of a service (`up` restarts it)."""

    def __init__(self, args: argparse.Namespace, procs: Processes, tally: Tally, pause: Callable):
        self.args, self.procs, self.tally, self.pause = args, procs, tally, pause
        self.service_kills: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    async def stopper(self, seconds_left: Callable[[], float]) -> None:
        a, rng = self.args, task_rng(self.args.seed, "stop")
        while await self.pause(jittered(rng, a.stop_every_s)):
            procs = await asyncio.to_thread(self.procs.find)
            workers = sorted(n for n in procs if "/worker-" in n)
            services = sorted(n for n in procs if n in SERVICES)
            pool = workers if workers and (not services or rng.random() < 0.5) else services
            if not pool:
                continue
            target = self.procs.target(name := rng.choice(pool), procs[name])
            kind = "stop worker" if "/worker-" in name else "stop service"
            if not target.signal(signal.SIGSTOP):
                self.tally.count(kind, "gone before SIGSTOP")
                continue
            self.procs.stopped[target.pid] = target
            hold = rng.uniform(a.stop_min_s, a.stop_max_s)
            cut_short = hold > seconds_left()  # the recovery phase will SIGCONT it
            self.tally.note(stop=name, pid=target.pid, hold_s=round(hold, 1))
            await asyncio.sleep(max(0.0, min(hold, seconds_left())))
            if cut_short and target.pid in self.procs.stopped:
                self.tally.count(kind, "left stopped for recovery")
                continue
            self.procs.stopped.pop(target.pid, None)
            outcome = "continued" if target.signal(signal.SIGCONT) else "gone before SIGCONT"
            self.tally.count(kind, outcome)
            self.tally.note(cont=name, pid=target.pid, outcome=outcome)

    def _within_budget(self, name: str, now: float) -> bool:
        kills = self.service_kills[name]
        while kills and now - kills[0] > SERVICE_KILL_WINDOW_S:
            kills.popleft()
        return len(kills) < SERVICE_KILLS_PER_WINDOW

    async def service_killer(self) -> None:
        rng = task_rng(self.args.seed, "kill-service")
        while await self.pause(jittered(rng, self.args.kill_service_every_s)):
            procs = await asyncio.to_thread(self.procs.find)
            now = time.monotonic()
            candidates = [n for n in SERVICES if n in procs and self._within_budget(n, now)]
            if not candidates:
                self.tally.count("kill service", "skipped: restart budget or none running")
                continue
            name = rng.choice(candidates)
            target = self.procs.target(name, procs[name])
            if not target.signal(signal.SIGKILL):
                self.tally.count("kill service", "gone before SIGKILL")
                continue
            self.procs.stopped.pop(target.pid, None)
            self.service_kills[name].append(now)
            self.tally.count("kill service", name)
            self.tally.note(kill=name, pid=target.pid)
