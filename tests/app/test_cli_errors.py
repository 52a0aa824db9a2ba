"""The `stagemesh` command at its edges, run as a user runs it: a refused option or config is one
line naming the key and the allowed values, exit 2, before any child starts; a child that cannot
start is named with its reason on `up`'s last line."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.meshproc import REPO

TIMEOUT_S = 120


def _stagemesh(*argv: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagemesh", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_version_prints_the_package_version():
    done = _stagemesh("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"stagemesh {metadata.version('stagemesh')}"), done.stderr


@pytest.mark.parametrize("seed", ["-1", str(2**64), "ten"])
def test_generate_refuses_a_seed_outside_uint64(seed):
    done = _stagemesh("generate", "a boat", "--address", f"127.0.0.1:{_closed_port()}", "--seed", seed)
    assert done.returncode == 2, done.stderr
    assert f"--seed: {seed!r} is not a seed; allowed: whole numbers from 0 to {2**64 - 1}" in done.stderr
    assert "Traceback" not in done.stderr


def test_generate_checks_the_output_folder_before_calling_the_gateway(tmp_path):
    missing = tmp_path / "missing" / "a.png"
    # Nothing listens there: the old order would fail UNAVAILABLE, never naming the folder.
    done = _stagemesh("generate", "a boat", "--address", f"127.0.0.1:{_closed_port()}", "-o", str(missing))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"stagemesh generate: -o {missing}: the folder {missing.parent} does not exist"


def test_up_refuses_an_unknown_log_level():
    done = _stagemesh("up", "--log-level", "verbose")
    assert done.returncode == 2, done.stderr
    assert "--log-level: invalid choice: 'verbose'" in done.stderr and "'debug', 'info'" in done.stderr
    assert "started" not in done.stderr


def _config(tmp_path: Path, mesh: str = "", first: str = 'kind = "ar"', second: str = 'kind = "diffusion"') -> Path:
    path = tmp_path / "mesh.toml"
    tables = "".join(f"[[stages]]\n{t}\n" for t in (first, second) if t)
    path.write_text(f'[mesh]\n{mesh}\n[cache]\nroot = "{tmp_path / "cache"}"\n{tables}')
    return path


REFUSED_CONFIGS = {
    "log-level": (
        {"mesh": 'log_level = "verbose"'},
        "[mesh] log_level: 'verbose' is not a log level; allowed: debug, info, warning, error",
    ),
    "kind-typo-last": (
        {"second": 'kind = "diffusoin"'},
        "[[stages]] 1: kind = 'diffusoin': not a stage kind; allowed: ar, diffusion, encoder, denoise, decode",
    ),
    "kind-typo-first": (
        {"first": 'kind = "arr"'},
        "[[stages]] 0: kind = 'arr': not a stage kind; allowed: ar, diffusion, encoder, denoise, decode",
    ),
    "batch-0": (
        {"second": 'kind = "diffusion"\nmax_batch_size = 0'},
        "[[stages]] 1: max_batch_size = 0: must be a whole number of at least 1",
    ),
    "default-above-max": (
        {"second": 'kind = "diffusion"\nmax_size = 512\ndefault_size = 768'},
        "[[stages]] 1: default_size = 768 is above max_size = 512: every request leaving it unset would be refused",
    ),
    "sleep-host-buffer-typo": (
        {"second": 'kind = "diffusion"\nsleep_host_buffer = "eager"'},
        "[[stages]] 1: sleep_host_buffer = 'eager': allowed: first_sleep, at_start, background",
    ),
    "sleep-host-buffer-without-sleep": (
        {"second": 'kind = "diffusion"\nenable_sleep = false\nsleep_host_buffer = "at_start"'},
        "[[stages]] 1: sleep_host_buffer = 'at_start' with enable_sleep = false: it would hold host memory",
    ),
    "diffusion-only": (
        {"first": 'kind = "diffusion"', "second": ""},
        "stage 0 (diffusion) draws from an encoded prompt, so the stage right before it must be of kind 'ar'",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED_CONFIGS))
def test_up_refuses_a_bad_config_in_one_line_naming_the_key(tmp_path, name):
    keys, message = REFUSED_CONFIGS[name]
    path = _config(tmp_path, **keys)
    done = _stagemesh("up", "--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stderr.startswith(f"stagemesh: invalid config {path}: "), done.stderr
    assert not (tmp_path / "cache").exists()  # refused before the cache service started


def test_up_names_the_reason_a_child_could_not_start(tmp_path, tiny_model):
    """The gateway's port is taken: `up`'s last line says so, not only "exited with code 1"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        model = f'model_dir = "{tiny_model}"\nthreads = 1'
        path = _config(tmp_path, first=f'kind = "ar"\n{model}', second=f'kind = "diffusion"\n{model}')
        path.write_text(path.read_text() + textwrap.dedent(f"[gateway]\nport = {port}\n"))
        done = _stagemesh("up", "--config", str(path), timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("stagemesh: gateway exited with code 1 before it was serving: "), last
    assert f"cannot bind 127.0.0.1:{port}" in last, last
