"""Runtime-weight cache: two engines with private weights vs two engines sharing one copy.

In one run, for mode in (private, cache): start two independent Executors (one worker each, same
device, DLO no-AllGather, checkpoint mmap off so the ordinary loader runs and the weights are
eligible for the cache). In cache mode both share a fresh cache dir: engine 1 loads and publishes
(a miss), engine 2 should map the entry without loading (a skip-load hit). Measured per mode:
  - startup time of each engine (Executor.start, spawn to Ready), and the cache outcome;
  - combined throughput: a fixed number of requests submitted to both engines at once;
  - total host PSS (smaps_rollup Pss summed over both workers), read loaded and idle after the
    throughput run, and each worker's peak RSS (VmHWM).
Targets (issue 5): PSS cache/private <= 0.6, throughput cache/private >= 0.9.

Run on a GPU:   python -m bench.runtime_cache                 (FLUX-sized DiT, bf16)
Check on a CPU: python -m bench.runtime_cache --preset tiny --device cpu --size 64 --steps 2 --requests 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.common import add_model_dir, add_output, add_preset, print_table, usable_cpus, write_json
from stagemesh.core.params import Params
from stagemesh.stage_service.executor.multiproc import Executor
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.contract import WorkItem
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.settings import StageSettings

MODES = ("private", "cache")
ENGINES = 2
GIB = float(1 << 30)
PSS_TARGET = 0.6
QPS_TARGET = 0.9
PRESETS = {"flux-sized": PipelineConfig.flux_sized, "tiny": PipelineConfig.tiny}
# Log events of stage_service/offload/runtime_weights.py that say what the cache did.
CACHE_EVENTS = {
    "dlo runtime cache hit; checkpoint load skipped": "skip_load_hit",
    "dlo runtime cache mapped after a load": None,  # reason field: published / hit
    "dlo runtime cache not used; private weights kept": None,  # reason field: the fallback
    "dlo runtime cache not needed: the checkpoint is mapped directly": "checkpoint_mmap",
}


# ---- /proc readings ----------------------------------------------------------------------------
def _kib_fields(path: Path) -> dict[str, int]:
    """`Name:   123 kB` lines of a /proc file, in bytes."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0]) * 1024
    return out


def memory(pid: int) -> dict[str, int]:
    rollup = _kib_fields(Path(f"/proc/{pid}/smaps_rollup"))
    status = _kib_fields(Path(f"/proc/{pid}/status"))
    return {
        "pss": rollup["Pss"],
        "pss_anon": rollup.get("Pss_Anon", 0),
        "pss_file": rollup.get("Pss_File", 0),
        "pss_shmem": rollup.get("Pss_Shmem", 0),
        "rss": rollup.get("Rss", 0),
        "vm_hwm": status["VmHWM"],
    }


def maps_cache_entry(pid: int, cache_dir: Path) -> bool:
    """Whether the process maps a weight file of the cache (the entry is in use, not private)."""
    root = str(cache_dir.resolve())
    return any(
        root in line and line.rstrip().endswith(".safetensors")
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
    )


# ---- engines -----------------------------------------------------------------------------------
@contextlib.contextmanager
def worker_stderr(path: Path) -> Iterator[None]:
    """Point fd 2 at `path` while a worker spawns: the worker inherits it and keeps writing its
    (JSON) log lines there, which is where the cache outcome is reported."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log_file:
        os.dup2(log_file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def cache_outcome(log_path: Path) -> str | None:
    """The cache outcome a worker logged at start, or None if it logged none (private mode)."""
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        event = record.get("event") if isinstance(record, dict) else None
        if event in CACHE_EVENTS:
            return CACHE_EVENTS[event] or str(record.get("reason"))
    return None


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def dlo_options(mode: str, cache_dir: Path) -> dict[str, Any]:
    opts = {"enable_dlo": True, "dlo_use_allgather": False, "dlo_checkpoint_mmap": False}
    if mode == "cache":
        # No cache service: the stages take the same flock on the directory themselves.
        opts.update(dlo_enable_runtime_cache=True, dlo_runtime_cache_dir=str(cache_dir), dlo_runtime_cache_service="")
    return opts


def start_engine(
    index: int, mode: str, args, model_dir: Path, cache_dir: Path, log_dir: Path, engines: list[dict[str, Any]]
) -> dict[str, Any]:
    """Start one engine; it joins `engines` before it is started so cleanup always reaches it."""
    settings = StageSettings(
        stage_id=index,
        kind="diffusion",
        model_dir=str(model_dir),
        device=args.device,
        threads=args.threads,
        **dlo_options(mode, cache_dir),
    )
    executor = Executor(settings)
    log_path = log_dir / f"{mode}-engine{index}.log"
    engine = {"index": index, "executor": executor, "log": log_path}
    engines.append(engine)
    started = time.perf_counter()
    try:
        with worker_stderr(log_path):
            executor.start(timeout_s=args.timeout)
    except Exception:
        print(
            f"--- {mode} engine {index} failed to start; its log ends:\n{_tail(log_path)}", file=sys.stderr, flush=True
        )
        raise
    engine["startup_s"] = time.perf_counter() - started
    engine["pid"] = executor._workers[0].process.pid
    engine["outcome"] = cache_outcome(log_path) or ("private" if mode == "private" else "none")
    engine["maps_cache"] = maps_cache_entry(engine["pid"], cache_dir) if cache_dir.exists() else False
    ping = executor.control(0, "ping").result(timeout=60)[0]  # the answer of rank 0
    engine["host_mode"] = (ping.get("dlo") or {}).get("host_mode")
    engine["host_bytes"] = (ping.get("dlo") or {}).get("host_bytes")
    print(
        f"{mode}: engine {index} ready in {engine['startup_s']:.2f} s "
        f"(cache: {engine['outcome']}, maps entry: {engine['maps_cache']}, "
        f"host mode: {engine['host_mode']})",
        flush=True,
    )
    return engine


def stop_engines(engines: list[dict[str, Any]]) -> None:
    for engine in engines:
        try:
            engine["executor"].shutdown()
        except Exception as exc:  # noqa: BLE001 - the other engines must still stop
            print(f"shutdown of engine {engine['index']} failed: {exc}", file=sys.stderr)


# ---- load --------------------------------------------------------------------------------------
def _item(request_id: str, args, cond_dim: int, seed: int) -> WorkItem:
    cond = torch.randn(12, cond_dim, generator=torch.Generator().manual_seed(seed))
    params = Params("p", args.size, args.size, args.steps, 4.0, seed, "tensor")
    return WorkItem(request_id, params, {"hidden_states": cond})


def _finish(executor: Executor, future, request_id: str, size: int, timeout_s: float) -> None:
    done = future.result(timeout=timeout_s)
    if isinstance(done, list):  # synchronous output path
        image = done[0]["image"]
    else:
        (output_id,) = executor.outputs.split(done.async_output_id, [request_id])
        image = executor.outputs.wait_output_ready(output_id, timeout_s)["image"]
    if tuple(image.shape) != (size, size, 3):
        raise RuntimeError(f"{request_id}: image of shape {tuple(image.shape)}")


def run_requests(executors: list[Executor], count: int, args, cond_dim: int) -> float:
    """Submit `count` single-request batches round-robin to all engines at once (so every
    engine always has work queued) and wait for every image; returns seconds elapsed."""
    started = time.perf_counter()
    pending = []
    for i in range(count):
        executor = executors[i % len(executors)]
        request_id = f"r{i}"
        _, future = executor.submit(0, [_item(request_id, args, cond_dim, seed=i)])
        pending.append((executor, future, request_id))
    for executor, future, request_id in pending:
        _finish(executor, future, request_id, args.size, args.timeout)
    return time.perf_counter() - started


def throughput(executors: list[Executor], args, cond_dim: int) -> dict[str, float]:
    # One request per engine first: first kernels, allocator growth and page faults are startup.
    run_requests(executors, len(executors), args, cond_dim)
    elapsed = run_requests(executors, args.requests, args, cond_dim)
    return {"requests": args.requests, "elapsed_s": elapsed, "qps": args.requests / elapsed}


# ---- one mode ----------------------------------------------------------------------------------
def _drain(engines: list[dict[str, Any]]) -> None:
    """Outputs still in flight hold host buffers; idle means none left."""
    for engine in engines:
        engine["executor"].control(0, "drain").result(timeout=60)


def run_mode(mode: str, args, model_dir: Path, work_dir: Path, cond_dim: int) -> dict[str, Any]:
    cache_dir = work_dir / f"cache-{mode}"  # fresh per run; created (0700) by the cache itself
    log_dir = work_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    engines: list[dict[str, Any]] = []
    try:
        # One after the other: engine 2 of the cache mode starts once engine 1 has published.
        for index in range(1, ENGINES + 1):
            start_engine(index, mode, args, model_dir, cache_dir, log_dir, engines)
        loaded = {e["index"]: memory(e["pid"]) for e in engines}
        load = throughput([e["executor"] for e in engines], args, cond_dim)
        _drain(engines)
        idle = {e["index"]: memory(e["pid"]) for e in engines}
        print(
            f"{mode}: {load['qps']:.3f} req/s over {load['requests']} requests, "
            f"total PSS {sum(m['pss'] for m in idle.values()) / GIB:.3f} GiB",
            flush=True,
        )
        return {
            "mode": mode,
            "load": load,
            "engines": [_engine_record(e, loaded[e["index"]], idle[e["index"]]) for e in engines],
            "total_pss_loaded_bytes": sum(m["pss"] for m in loaded.values()),
            "total_pss_bytes": sum(m["pss"] for m in idle.values()),
        }
    finally:
        stop_engines(engines)
        shutil.rmtree(cache_dir, ignore_errors=True)


def _engine_record(engine: dict[str, Any], loaded: dict[str, int], idle: dict[str, int]) -> dict:
    keep = ("index", "pid", "startup_s", "outcome", "maps_cache", "host_mode", "host_bytes")
    return {
        **{k: engine.get(k) for k in keep},
        "memory_loaded": loaded,
        "memory_idle": idle,
        "peak_rss_bytes": idle["vm_hwm"],
    }


# ---- report ------------------------------------------------------------------------------------
def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    private, cache = results["private"], results["cache"]
    return {
        "pss_cache_over_private": cache["total_pss_bytes"] / private["total_pss_bytes"],
        "qps_cache_over_private": cache["load"]["qps"] / private["load"]["qps"],
    }


def report(results: dict[str, dict[str, Any]], ratio: dict[str, float]) -> None:
    rows = []
    for mode in MODES:
        r = results[mode]
        e1, e2 = r["engines"]
        rows.append(
            [
                mode,
                e1["startup_s"],
                e2["startup_s"],
                f"{e1['outcome']}/{e2['outcome']}",
                r["load"]["qps"],
                r["total_pss_bytes"] / GIB,
                e1["peak_rss_bytes"] / GIB,
                e2["peak_rss_bytes"] / GIB,
            ]
        )
    print_table(
        [
            "mode",
            "startup e1 s",
            "startup e2 s",
            "cache e1/e2",
            "QPS combined",
            "total PSS GiB",
            "peak RSS e1 GiB",
            "peak RSS e2 GiB",
        ],
        rows,
    )
    pss, qps = ratio["pss_cache_over_private"], ratio["qps_cache_over_private"]
    print_table(
        ["cache / private", "ratio", "target", "met"],
        [
            ["total PSS", pss, f"<= {PSS_TARGET}", "yes" if pss <= PSS_TARGET else "no"],
            ["throughput", qps, f">= {QPS_TARGET}", "yes" if qps >= QPS_TARGET else "no"],
        ],
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, sorted(PRESETS), "flux-sized")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=512, help="image width and height")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--requests", type=int, default=16, help="timed requests per mode")
    add_model_dir(
        parser,
        "weights, generated if absent or outdated; default: a temp dir, removed at the end "
        "(FLUX-sized takes ~75 s and 24 GB)",
    )
    parser.add_argument(
        "--tmp-dir",
        type=Path,
        default=None,
        help="where the temp model, cache and log dirs go (default: the system "
        "temp dir); the cache mode needs room for one more copy of the weights",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default: half the CPUs on cpu, torch's default on a GPU)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per start or request")
    add_output(parser, "runtime_cache")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.threads is None:
        # Two CPU engines share the cores; oversubscribing them would measure contention.
        args.threads = max(1, usable_cpus() // ENGINES) if args.device == "cpu" else 0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = PRESETS[args.preset]()
    if args.size % config.dit.pixel_multiple:
        raise SystemExit(f"--size must be a multiple of {config.dit.pixel_multiple}")
    work_dir = Path(tempfile.mkdtemp(prefix="stagemesh-runtime-cache-", dir=args.tmp_dir))
    try:
        started = time.perf_counter()
        model_dir = ensure_model_dir(Path(args.model_dir) if args.model_dir else work_dir / "model", config)
        print(
            f"model ({args.preset}, {config.dtype}) at {model_dir} ({time.perf_counter() - started:.1f} s)", flush=True
        )
        results = {mode: run_mode(mode, args, model_dir, work_dir, config.dit.cond_dim) for mode in MODES}
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    ratio = ratios(results)
    report(results, ratio)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path = write_json(
        args.output,
        "runtime_cache",
        {
            "settings": settings,
            "dtype": config.dtype,
            "modes": results,
            "ratios": ratio,
            "targets": {"pss_cache_over_private_max": PSS_TARGET, "qps_cache_over_private_min": QPS_TARGET},
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
