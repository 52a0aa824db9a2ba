"""Running a real `stagemesh up` in tests: start, read the gateway address, stop, check leftovers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from stagemesh.core import readyfile, rpc
from stagemesh.v1 import gateway_pb2, gateway_pb2_grpc, generation_pb2

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def segments_of(entries: set[str], pids) -> set[str]:
    """/dev/shm entries named after one of `pids` (other test sessions may share the machine)."""
    return {e for e in entries if e.startswith("stagemesh-") and any(f"-{pid}-" in e for pid in pids)}


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A":  # LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class Mesh:
    process: subprocess.Popen
    address: str
    log_path: Path
    config_path: Path
    banner: str = ""  # what `up` printed once the mesh served

    @property
    def http_address(self) -> str:
        """host:port of the gateway's HTTP API, from the banner line `up` prints for it."""
        for line in self.banner.splitlines():
            if line.startswith("stagemesh: HTTP API"):
                return line.rsplit("://", 1)[1].removesuffix("/v1")
        raise LookupError(f"the banner names no HTTP API:\n{self.banner}")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=rpc.channel_options())

    def gateway(self, channel: grpc.Channel) -> gateway_pb2_grpc.GatewayServiceStub:
        return gateway_pb2_grpc.GatewayServiceStub(channel)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> set[int]:
        """Every service process `up` started (restarts included), from its log."""
        pids = set()
        for line in self.logs().splitlines():
            if '"event": "started"' in line and '"pid":' in line:
                pids.add(int(line.split('"pid":', 1)[1].split(",", 1)[0].strip().rstrip("}")))
        return pids

    def child_addresses(self) -> dict[str, str]:
        """{"cache": address, "stage-0": ..., "gateway": ...} from `up`'s "serving" lines (restarts
        reuse the port, so the last line wins)."""
        found = {}
        for line in self.logs().splitlines():
            if '"event": "serving"' in line and '"child":' in line:
                entry = json.loads(line)
                found[entry["child"]] = entry["address"]
        return found

    def metrics_addresses(self) -> dict[str, str]:
        """{"gateway": "127.0.0.1:PORT", "stage-0": ..., "cache": ...}: where each service with a
        metrics port serves /metrics, from its "metrics listening" log line (the last one wins)."""
        found = {}
        for line in self.logs().splitlines():
            if '"event": "metrics listening"' in line:
                entry = json.loads(line)
                found[entry["service"]] = entry["address"]
        return found

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def write_config(
    path: Path,
    model_dir: Path,
    extra_stage: str = "",
    cache_root: Path | None = None,
    extra_diffusion: str = "",
    extra_gateway: str = "",
    extra_cache: str = "",
) -> Path:
    """`extra_stage` lines go into every [[stages]] table, `extra_diffusion` only into stage 1's,
    `extra_gateway` and `extra_cache` into [gateway] and [cache]."""
    cache_root = cache_root or path.parent / "cache-root"
    path.write_text(f"""
[mesh]
log_level = "info"

[gateway]
port = 0
{extra_gateway}

[cache]
root = "{cache_root}"
{extra_cache}

[[stages]]
kind = "ar"
model_dir = "{model_dir}"
threads = 1
{extra_stage}

[[stages]]
kind = "diffusion"
model_dir = "{model_dir}"
threads = 1
max_size = 512
max_steps = 50
max_prompt_bytes = 256
{extra_stage}
{extra_diffusion}
""")
    return path


def start_mesh(
    config_path: Path,
    log_path: Path,
    up_args: tuple[str, ...] = (),
    timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> Mesh:
    """`up_args`: further flags of `stagemesh up` (e.g. "--model", PATH); `timeout_s`: how long
    the gateway may take to be announced (a benchmark's large model loads longer); `env`: the
    mesh's environment (default: this process's)."""
    env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh", "up", "--config", str(config_path), *up_args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
    )
    log_file.close()
    deadline = time.monotonic() + timeout_s
    address = None
    banner = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if "gateway serving on" in line:
            address = line.strip().rsplit(" ", 1)[1]
        if address is not None:
            banner.append(line)
            if "Ctrl-C stops the mesh" in line:  # the banner's last line
                break
    if address is None:
        process.kill()
        process.wait()
        raise RuntimeError(f"mesh did not start; log:\n{log_path.read_text()[-4000:]}")
    # Keep reading stdout so nothing the mesh prints later can fill the pipe and block it.
    threading.Thread(target=process.stdout.read, daemon=True).start()
    return Mesh(process, address, log_path, config_path, "".join(banner))


@dataclass
class Service:
    """One `stagemesh <service>` started alone, as on a machine of its own."""

    process: subprocess.Popen
    ready_path: Path
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_bound(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The address, once the port is bound: the ready file is the service's only signal of it."""
        deadline = time.monotonic() + timeout_s
        while (info := readyfile.read(self.ready_path)) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.log_path.stem} did not bind; log:\n{self.logs()[-4000:]}")
            time.sleep(0.05)
        return info["address"]

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def spawn_service(name: str, args: list[str], folder: Path, env: dict | None = None, port: int = 0) -> Service:
    """Start `stagemesh ARGS --port PORT --ready-file ...` without waiting (start several at once,
    then `wait_bound` each); its log goes to `folder/NAME.log` (appended to: a restart's follows)."""
    ready, log_path = folder / f"{name}.ready", folder / f"{name}.log"
    ready.unlink(missing_ok=True)
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh", *args, "--port", str(port), "--ready-file", str(ready)],
            cwd=REPO,
            env={**(env or os.environ), "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Service(process, ready, log_path)


@contextlib.contextmanager
def clean_mesh(config: Path, log_path: Path, env: dict[str, str] | None = None) -> Iterator[Mesh]:
    """A started mesh; after use, checked to stop with exit 0 and to leave no shared-memory segment."""
    shm_before = shm_entries()
    running = start_mesh(config, log_path, env=env)
    yield running
    assert running.stop() == 0, running.logs()[-3000:]
    assert not segments_of(shm_entries() - shm_before, running.child_pids())


def unary_png(mesh: Mesh, width: int, height: int, steps: int, seed: int, prompt: str, timeout: float = 60.0) -> bytes:
    """One GenerateUnary through the mesh's gateway: the image's PNG bytes."""
    params = generation_pb2.GenerationParams(
        prompt=prompt, width=width, height=height, num_inference_steps=steps, seed=seed
    )
    with mesh.channel() as channel:
        reply = mesh.gateway(channel).GenerateUnary(gateway_pb2.GenerateUnaryRequest(params=params), timeout=timeout)
    assert reply.result.png.startswith(b"\x89PNG")
    return reply.result.png


@contextlib.contextmanager
def parallel_meshes(
    starters: dict[str, Callable[[], Mesh]], while_starting: Callable[[], None] | None = None
) -> Iterator[dict[str, Mesh]]:
    """Start several meshes at once (each loads its models in its own processes; `while_starting`
    runs meanwhile on this thread), yield them by name, then stop them at once and check that each
    stopped cleanly and left no shared-memory segment."""
    started: dict[str, Mesh] = {}
    errors: list[BaseException] = []

    def start(name: str) -> None:
        try:
            started[name] = starters[name]()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test thread
            errors.append(exc)

    shm_before = shm_entries()
    threads = [threading.Thread(target=start, args=(name,)) for name in starters]
    for t in threads:
        t.start()
    try:
        if while_starting is not None:
            while_starting()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, once the meshes are stopped
        errors.append(exc)
    finally:
        for t in threads:
            t.join()
    if errors:
        for m in started.values():
            m.stop()
        raise errors[0]
    yield started
    codes: dict[str, int] = {}
    stoppers = [threading.Thread(target=lambda n=n, m=m: codes.__setitem__(n, m.stop())) for n, m in started.items()]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    for name, m in started.items():
        assert codes.get(name) == 0, m.logs()[-3000:]
        leaked = segments_of(shm_entries() - shm_before, m.child_pids())
        assert not leaked, f"{name}: shared-memory segments left behind: {leaked}"
