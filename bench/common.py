"""Small helpers shared by the benchmarks: percentiles, a plain-text table, a JSON result file
that records where and when the numbers were taken, and the options every script spells alike."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"


# statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default method), so p50 of an even-sized sample is the mean of the middle two."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float], quantiles: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """count, mean, min, max and the requested percentiles (keys p50, p90, ...)."""
    out: dict[str, float] = {
        "count": len(values),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
    }
    for q in quantiles:
        out[f"p{q:g}"] = percentile(values, q)
    return out


# output -------------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], floatfmt: str = ".3f") -> str:
    """A fixed-width table; floats use `floatfmt`, the first column is left-aligned, the rest right."""

    def cell(v: Any) -> str:
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line([str(h) for h in headers]), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], floatfmt: str = ".3f") -> None:
    print(format_table(headers, rows, floatfmt), flush=True)


# the command line ---------------------------------------------------------------------------
# A shared option has one spelling in every script. A spelling that an older command of record
# used is kept as an alias with the same destination, so that command still runs.

# What each model build a script can be given with --preset is.
PRESETS = {
    "tiny": "the embedded DiT, tiny (a CPU check)",
    "flux-sized": "the embedded DiT at FLUX.1-dev's size",
    "flux": "diffusers' FluxTransformer2DModel, FLUX.1-dev's config",
    "tiny-flux": "diffusers' FluxTransformer2DModel, a small config (a CPU check)",
    "published": "each family's published transformer and VAE dimensions (stagemesh synthesize --size full)",
    "tiny-folders": "each family's tiny random-weight folder (stagemesh synthesize --size tiny; a CPU check)",
}
# --model dit|flux, an old spelling: the family, as (small, full) presets
_FAMILIES = {"dit": ("tiny", "flux-sized"), "flux": ("tiny-flux", "flux")}


def add_output(parser: argparse.ArgumentParser, name: str | None, *old_spellings: str) -> None:
    """`--output PATH`: the JSON result file, bench/results/NAME.json by default (with `name`
    None the script picks it, and `args.output` is None when not given)."""
    default = None if name is None else str(RESULTS_DIR / f"{name}.json")
    where = "picked by the script, under bench/results/" if name is None else f"bench/results/{name}.json"
    parser.add_argument(
        "--output", *old_spellings, dest="output", default=default, metavar="PATH", help=f"JSON result file ({where})"
    )


def add_figure_output(parser: argparse.ArgumentParser, default: str) -> None:
    """`--output PNG`: the figure a plot script draws. A second positional argument, the older
    form, means the same."""
    parser.add_argument("--output", default=default, metavar="PNG", help=f"the figure (default: {default})")
    # the same destination: given, it wins; absent, it leaves --output's value alone
    parser.add_argument("output", nargs="?", default=argparse.SUPPRESS, metavar="PNG", help="old form of --output")


def add_repeats(parser: argparse.ArgumentParser, default: int | None, help: str, *old_spellings: str) -> None:
    """`--repeats N`: how many times the measurement is repeated; its figures are taken over them.
    Where one repeat times several passes, the script's `--iters` says how many."""
    parser.add_argument("--repeats", *old_spellings, dest="repeats", type=int, default=default, metavar="N", help=help)


def add_model_dir(parser: argparse.ArgumentParser, when_absent: str, *old_spellings: str) -> None:
    """`--model-dir PATH`: the model folder (`args.model_dir` None when not given), as
    `stagemesh stage --model-dir` names it; `when_absent` says what the script uses then."""
    parser.add_argument(
        "--model-dir",
        *old_spellings,
        dest="model_dir",
        default=None,
        metavar="PATH",
        help=f"model folder ({when_absent})",
    )


def add_preset(parser: argparse.ArgumentParser, choices: Sequence[str], default: str, *old_spellings: str) -> None:
    """`--preset NAME`: which model build (PRESETS says what each is), one of `choices`. Old
    spellings it can keep: `--tiny` and `--tiny-flux` (the small preset), `--model dit|flux` (the
    family: the preset of that family of the size already chosen)."""
    listed = "; ".join(f"{name}: {PRESETS[name]}" for name in choices)
    parser.add_argument("--preset", choices=choices, default=default, help=f"the model: {listed} (default: {default})")
    for flag in old_spellings:
        if flag == "--model":
            parser.add_argument(
                flag,
                choices=sorted(_FAMILIES),
                dest="preset",
                default=argparse.SUPPRESS,
                action=_Family,
                presets=choices,
                help="old spelling: the --preset of this family, of the size already chosen",
            )
            continue
        name = flag.removeprefix("--")
        small = name if name in choices else next(c for c in choices if c.startswith("tiny"))
        parser.add_argument(
            flag,
            dest="preset",
            action="store_const",
            const=small,
            default=argparse.SUPPRESS,
            help=f"old spelling of --preset {small}",
        )


class _Family(argparse.Action):
    """`--model dit|flux`: the preset of that family, small or full as the current one is."""

    def __init__(self, *args: Any, presets: Sequence[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.presets = presets

    def __call__(self, parser, namespace, family, option_string=None):
        small = getattr(namespace, self.dest).startswith("tiny")
        preset = _FAMILIES[family][0 if small else 1]
        if preset not in self.presets:
            parser.error(f"{option_string} {family}: not a model of this script (--preset {', '.join(self.presets)})")
        setattr(namespace, self.dest, preset)


# environment --------------------------------------------------------------------------------
def free_device(device: Any) -> None:
    """Collect garbage and give the allocator's cached blocks back (between a run's cases)."""
    import gc

    gc.collect()
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def timed_ms(run: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of `repeats` calls of `run`, after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def git_commit() -> str | None:
    # A copy of the tree without .git (e.g. on a lent GPU machine) gets the commit from the caller.
    if os.environ.get("STAGEMESH_COMMIT"):
        return os.environ["STAGEMESH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: just not recorded
        return None


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable GPU: just not recorded
        return None


def environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "grpcio": _version("grpc"),
        "gpu": _gpu_name(),
        "platform": platform.platform(),
        "machine": {"nproc": usable_cpus(), "cpu_count": os.cpu_count(), "cpu_model": cpu_model()},
        # Other work on the machine skews latencies; this says how busy it was when the file was written.
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def write_json(path: str | os.PathLike, benchmark: str, data: dict[str, Any]) -> Path:
    """Write {"benchmark", "environment", **data} to `path` (parent folders created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "environment": environment(), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot, drawing to files; imported here, on use, as matplotlib is a bench-only tool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _raise_interrupt(signum, frame):  # SIGTERM to a benchmark: unwind through the finally blocks
    raise KeyboardInterrupt(f"signal {signum}")


def prepare_mesh_run(args: Any) -> None:
    """Before a script starts its own mesh: SIGTERM unwinds like Ctrl-C (so the mesh is stopped),
    and `args.model_dir` defaults to the embedded model's cache folder (made on first use)."""
    import signal

    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.model_dir is None:
        from stagemesh.stage_service.models.weights import default_model_dir

        args.model_dir = str(default_model_dir())


def run_mesh_script(main: Callable[[], int]) -> None:
    """Exit with `main()`'s code; Ctrl-C (after `main` has stopped its mesh) exits 130 quietly."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the mesh was stopped", file=sys.stderr)
        sys.exit(130)
