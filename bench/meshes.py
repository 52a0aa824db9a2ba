"""A real mesh for the benchmarks: `stagemesh up` started and stopped, its processes found through
its log and /proc, and the runner and options of a benchmark that measures on a fresh mesh."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from bench import common
from tests.support.meshproc import START_TIMEOUT_S, Mesh, segments_of, shm_entries, write_config

T = TypeVar("T")


# starting and stopping ----------------------------------------------------------------------
def start_mesh(config_path: Path, log_path: Path) -> Mesh:
    """`python -m stagemesh up --config ...` (as tests.support.meshproc.start_mesh does), but killed if
    anything, an interrupt included, stops us before the banner names the gateway's address."""
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh", "up", "--config", str(config_path)],
            cwd=common.REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            if "gateway serving on" in line:
                return Mesh(process, line.strip().rsplit(" ", 1)[1], log_path, config_path)
        raise RuntimeError(f"the mesh did not start; log tail:\n{log_path.read_text(errors='replace')[-4000:]}")
    except BaseException:
        stop_mesh(Mesh(process, "", log_path, config_path))  # SIGTERM lets `up` stop the children it started
        raise


def stop_mesh(mesh: Mesh) -> int | None:
    """SIGTERM, wait; SIGKILL if it will not go. Returns the exit code."""
    try:
        return mesh.stop(timeout=60.0)
    except Exception as exc:  # noqa: BLE001 - timeout or anything else: make sure it is gone
        print(f"mesh did not stop cleanly ({exc!r}); killing it", file=sys.stderr)
        mesh.process.kill()
        return mesh.process.wait()


def measured_on_mesh(config_path: Path, log_path: Path, measure: Callable[[Mesh], T]) -> tuple[T, int | None]:
    """Start a mesh, run `measure` on it (printing the mesh's log tail if it fails), stop it:
    what `measure` returned and the exit code of `stagemesh up` (warned about unless 0)."""
    started = time.monotonic()
    mesh = start_mesh(config_path, log_path)
    print(f"mesh up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        return measure(mesh), _stopped(mesh)
    except Exception:
        print(f"mesh log tail:\n{mesh.logs()[-3000:]}", file=sys.stderr)
        _stopped(mesh)
        raise


def _stopped(mesh: Mesh) -> int | None:
    code = stop_mesh(mesh)
    if code != 0:
        print(f"warning: `stagemesh up` exited with code {code}", file=sys.stderr)
    return code


# the mesh's processes, from the `up` log ------------------------------------------------------
def _up_log_events(log_text: str, event: str):
    """The `up` log's JSON lines with this event name (the children's own lines are skipped by the caller)."""
    for line in log_text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event and entry.get("child"):
            yield entry


def stage_addresses(log_text: str) -> dict[int, str]:
    """Stage addresses from the `up` log: JSON lines {"event": "serving", "child": "stage-N", "address": ...}.
    A restarted child logs again on the same port, so the last line wins."""
    return {
        int(e["child"].removeprefix("stage-")): e["address"]
        for e in _up_log_events(log_text, "serving")
        if e["child"].startswith("stage-") and e.get("address")
    }


def child_pids(log_text: str) -> dict[str, int]:
    """{"gateway": pid, "stage-0": pid, ...} from the `up` log's "started" lines (the last one wins)."""
    return {e["child"]: int(e["pid"]) for e in _up_log_events(log_text, "started") if e.get("pid")}


# the mesh's processes, from /proc -----------------------------------------------------------
def cmdline(pid: int) -> list[str]:
    """A process's argv ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def mesh_processes(up_pid: int) -> dict[str, int]:
    """{"cache": pid, "stage-0": pid, "stage-0/worker": pid, ..., "gateway": pid} below `up`."""
    found = {}
    for pid in _children(up_pid):
        argv = cmdline(pid)
        if argv[1:3] != ["-m", "stagemesh"] or len(argv) < 4:
            continue
        name = argv[3] if argv[3] != "stage" else f"stage-{argv[argv.index('--stage-id') + 1]}"
        found[name] = pid
        workers = [c for c in _children(pid) if any("multiprocessing.spawn" in a for a in cmdline(c))]
        for rank, worker in enumerate(sorted(workers)):
            found[f"{name}/worker-{rank}"] = worker
    return found


def process_resources(pid: int) -> dict[str, int] | None:
    """Open fds, threads and resident bytes of a live process (None once it is gone)."""
    try:
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        return {
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
        }
    except OSError:
        return None


def process_cpu_s(pid: int | None) -> float | None:
    """user + system CPU seconds of a process, all its threads (None if it cannot be read)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mesh_segments(pids: Iterable[int]) -> list[str]:
    """/dev/shm segments owned by these processes."""
    return sorted(segments_of(shm_entries(), pids))


# a benchmark of one hop on a fresh mesh -----------------------------------------------------
def overhead_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times a tiny request two ways on one mesh (bench/mesh_overhead.py,
    bench/http_overhead.py): `doc` its docstring, `name` its result file's."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured iterations per path (default: 300)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured iterations per path first (default: 20)")
    parser.add_argument("--size", type=int, default=16, help="width and height in pixels (default: 16, the smallest)")
    parser.add_argument("--steps", type=int, default=1, help="num_inference_steps (default: 1)")
    parser.add_argument("--seed", type=int, default=1234, help="fixed seed (default: 1234)")
    common.add_model_dir(parser, "both stages'; default: the embedded model's cache folder, generated on first use")
    common.add_output(parser, name)
    return parser


def parse_overhead_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        parser.error("--requests must be >= 1 and --warmup >= 0")
    return args


def run_on_mesh(
    args: argparse.Namespace,
    name: str,
    measure_on: Callable[[argparse.Namespace, Mesh], dict],
    report_of: Callable[[dict], None],
    extra_gateway: str = "",
) -> int:
    """Start a mesh of the embedded model (`args.model_dir`), `measure_on(args, mesh)`, stop it,
    then `report_of` the results and write them to `args.output` as benchmark `name`."""
    common.prepare_mesh_run(args)
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-") as tmp:
        root = Path(tmp)
        config = write_config(root / "mesh.toml", Path(args.model_dir), extra_gateway=extra_gateway)
        print(f"starting the mesh (model dir {args.model_dir}) ...", flush=True)
        results, code = measured_on_mesh(config, root / "mesh.log", lambda mesh: measure_on(args, mesh))
    results["mesh"]["exit_code"] = code
    report_of(results)
    path = common.write_json(args.output, name, results)
    print(f"wrote {path}")
    return 0
