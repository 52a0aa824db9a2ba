"""Life cycle of `stagemesh up` with real processes: supervisor killed, a stage killed, a worker
killed mid-request, a clean stop (of the mesh that survived those kills), a refused config. These
tests run their own meshes, never the shared session one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from stagemesh.v1 import gateway_pb2, generation_pb2
from tests.support.meshproc import (
    REPO,
    Mesh,
    alive,
    descendants,
    listening_ports,
    segments_of,
    shm_entries,
    start_mesh,
    write_config,
)

pytestmark = pytest.mark.mesh

SMALL = generation_pb2.GenerationParams(prompt="small", width=64, height=48, num_inference_steps=1, seed=1)
LONG = generation_pb2.GenerationParams(prompt="long", width=512, height=512, num_inference_steps=50, seed=2)
RECOVERY_S = 60.0
_ADDRESS = re.compile(r'"address": "[^"]*:(\d+)"')


# ---- helpers over /proc --------------------------------------------------------------------------
def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def service_pid(mesh: Mesh, command: str, stage_id: int | None = None) -> int:
    """The pid of the mesh's `stagemesh <command>` child (for a stage, the one with that --stage-id)."""
    found = []
    for pid in descendants(mesh.process.pid):
        argv = cmdline(pid)
        if parent_of(pid) != mesh.process.pid or argv[1:4] != ["-m", "stagemesh", command] or not alive(pid):
            continue
        if stage_id is None or argv[argv.index("--stage-id") + 1] == str(stage_id):
            found.append(pid)
    assert len(found) == 1, (command, stage_id, found)
    return found[0]


def worker_pids(service: int) -> list[int]:
    return [
        p
        for p in descendants(service)
        if parent_of(p) == service and alive(p) and any("multiprocessing.spawn" in a for a in cmdline(p))
    ]


def ports_in_log(text: str) -> set[int]:
    return {
        int(m.group(1))
        for line in text.splitlines()
        if '"listening"' in line or '"serving"' in line
        for m in _ADDRESS.finditer(line)
    }


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll an external process's state with a bounded deadline; return the first truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


def generate(mesh: Mesh, params=SMALL, timeout: float = 30.0) -> generation_pb2.GenerationResult:
    with mesh.channel() as channel:
        return (
            mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=timeout).result
        )


def generate_until_ok(mesh: Mesh, timeout: float = RECOVERY_S) -> list[grpc.RpcError]:
    """Retry a small Generate until it succeeds; every failure on the way must be UNAVAILABLE."""
    failures: list[grpc.RpcError] = []

    def attempt():
        try:
            return generate(mesh, timeout=10.0)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
            failures.append(err)
            return None

    result = wait_until(attempt, timeout, "a Generate succeeds again", interval=0.2)
    assert (result.width, result.height) == (64, 48)
    return failures


def start(tmp_path: Path, model_dir: str, name: str = "mesh") -> Mesh:
    config = write_config(tmp_path / f"{name}.toml", Path(model_dir), cache_root=tmp_path / f"{name}-cache")
    return start_mesh(config, tmp_path / f"{name}.log")


def worker_pids_of(pids: list[int]) -> list[int]:
    return [p for p in pids if any("multiprocessing.spawn" in a for a in cmdline(p))]


# ---- (b) supervisor SIGKILLed --------------------------------------------------------------------
def test_children_die_with_a_killed_supervisor(tmp_path, model_dir):
    mesh = start(tmp_path, model_dir)
    try:
        pids = descendants(mesh.process.pid)
        ports = ports_in_log(mesh.logs())
        assert len(worker_pids_of(pids)) == 2 and len(ports) == 4
    finally:
        mesh.process.kill()
        mesh.process.wait(10)
    wait_until(lambda: not [p for p in pids if alive(p)], 15, "the children of a SIGKILLed supervisor exit")
    wait_until(lambda: not ports & listening_ports(), 5, "ports closed")


# ---- (c), (d), (a): stage killed, worker killed, then a clean stop of the same mesh ------------
@dataclass
class KillMesh:
    mesh: Mesh
    shm_before: set[str]
    seen: set[int]  # every pid the mesh has had, killed ones included


@pytest.fixture(scope="module")
def kill_mesh(tmp_path_factory, model_dir):
    """A mesh whose processes the tests below kill; the last test stops it with SIGTERM."""
    root = tmp_path_factory.mktemp("kill-mesh")
    shm_before = shm_entries()
    mesh = start(root, model_dir)
    yield KillMesh(mesh, shm_before, set())
    if mesh.process.poll() is None:  # the stop test was not run (deselected) or failed early
        mesh.stop()


def test_killed_stage_is_unavailable_then_restarted_behind_the_same_gateway(kill_mesh):
    mesh, seen = kill_mesh.mesh, kill_mesh.seen
    generate_until_ok(mesh)
    gateway = service_pid(mesh, "gateway")
    stage1 = service_pid(mesh, "stage", 1)
    [worker] = worker_pids(stage1)
    seen.update([stage1, worker])

    os.kill(stage1, signal.SIGKILL)
    failures = generate_until_ok(mesh)

    for err in failures:
        assert "stage 1" in err.details(), err.details()
    new_stage1 = service_pid(mesh, "stage", 1)
    assert new_stage1 != stage1  # the success came from the restarted stage
    assert service_pid(mesh, "gateway") == gateway  # same gateway process, same address
    assert not alive(stage1)
    wait_until(lambda: not alive(worker), 10, "the dead stage's worker follows it (PDEATHSIG)")
    restarted = [
        line for line in mesh.logs().splitlines() if '"child exited; restarting"' in line and '"stage-1"' in line
    ]
    assert len(restarted) == 1, restarted


def test_killed_worker_fails_its_request_fast_then_is_restarted(kill_mesh):
    mesh, seen = kill_mesh.mesh, kill_mesh.seen
    generate_until_ok(mesh)
    stage1 = service_pid(mesh, "stage", 1)
    [worker] = worker_pids(stage1)
    seen.add(worker)

    with mesh.channel() as channel:
        call = mesh.gateway(channel).Generate(gateway_pb2.GenerateRequest(params=LONG), timeout=60)
        events = iter(call)
        while not next(events).HasField("denoising_step"):
            pass
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for event in events:
                assert not event.HasField("result"), "a request whose worker was killed returned a result"
        failed_after = time.monotonic() - killed

    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (info.value.code(), info.value.details())
    assert "stage 1" in info.value.details(), info.value.details()
    assert failed_after < 5.0, failed_after
    generate_until_ok(mesh)
    [new_worker] = worker_pids(stage1)
    assert new_worker != worker
    assert service_pid(mesh, "stage", 1) == stage1  # the stage service itself lived on
    assert "Traceback" not in mesh.logs()


def test_sigterm_stops_every_process_port_and_segment(kill_mesh):
    """Runs after the kill tests above (when selected with them): a mesh that has restarted a stage
    and a worker still stops completely."""
    mesh, seen = kill_mesh.mesh, kill_mesh.seen
    generate_until_ok(mesh)
    # A 512x512 image (3 MB of float32) travels through shared memory between worker and stage.
    big = generate(mesh, generation_pb2.GenerationParams(prompt="x", width=512, height=512, num_inference_steps=1))
    assert (big.width, big.height) == (512, 512)
    pids = [mesh.process.pid, *(p for p in descendants(mesh.process.pid) if alive(p))]
    commands = sorted(cmdline(p)[3] for p in pids if cmdline(p)[1:3] == ["-m", "stagemesh"])
    workers = worker_pids_of(pids)
    ports = ports_in_log(mesh.logs())
    gateway_port = int(mesh.address.rsplit(":", 1)[1])
    seen.update(pids)
    assert commands == ["cache", "gateway", "stage", "stage", "up"]
    assert len(workers) == 2  # one worker per stage
    assert len(ports) == 4 and gateway_port in ports, ports  # cache, two stages, gateway (restarts reuse ports)
    assert ports <= listening_ports()

    assert mesh.stop() == 0, mesh.logs()[-3000:]

    wait_until(lambda: not [p for p in seen if alive(p)], 5, "every process the mesh had exits")
    assert not ports & listening_ports(), "ports still listening after stop"
    assert not segments_of(shm_entries() - kill_mesh.shm_before, sorted(seen)), "shared-memory segments left behind"
    assert "Traceback" not in mesh.logs()
    stopped = [
        json.loads(line) for line in mesh.logs().splitlines() if '"event": "stopped"' in line and '"child"' in line
    ]
    # In reverse start order, each by its own SIGTERM handling (exit 0), none needing a SIGKILL.
    assert [(e["child"], e["exit_code"]) for e in stopped] == [
        ("gateway", 0),
        ("stage-1", 0),
        ("stage-0", 0),
        ("cache", 0),
    ], stopped


# ---- (e) refused config --------------------------------------------------------------------------
@pytest.mark.parametrize("table,line", [("[gateway]", "bogus_gateway_key = 1"), ("[[stages]]", "bogus_stage_key = 1")])
def test_invalid_config_is_refused_naming_the_key(tmp_path, model_dir, table, line):
    config = write_config(tmp_path / "mesh.toml", Path(model_dir))
    text = config.read_text()
    config.write_text(text.replace(table + "\n", f"{table}\n{line}\n", 1))
    assert line in config.read_text()
    key = line.split()[0]
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh", "up", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode != 0
    assert key in err, err
    assert "Traceback" not in err, err  # one clear line, not a stack
    assert "gateway serving" not in out
    # Nothing was started: no process anywhere carries this supervisor's mark.
    marked = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _parent_mark(p) == process.pid]
    assert marked == [], marked


def _parent_mark(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"STAGEMESH_PARENT_PID="):
            return int(item.split(b"=", 1)[1])
    return None
