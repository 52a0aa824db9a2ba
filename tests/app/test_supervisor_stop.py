"""`up`'s stop order, on stand-in children: the gateway first, then every stage at once, the cache
last. Each stand-in notes its SIGTERM in a shared file; a stage exits only once the other stage
has noted its own, so stages stopped one after the other would be SIGKILLed at stop_timeout_s."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from stagemesh.config import SupervisionConfig
from stagemesh.supervisor import Child, Supervisor

STAND_IN = """
import signal, sys, time
name, noted, wait_for = sys.argv[1], sys.argv[2], sys.argv[3:]

def stop(*_):
    with open(noted, "a") as out:
        out.write(name + "\\n")
    deadline = time.monotonic() + 30
    while wait_for and time.monotonic() < deadline:
        if set(wait_for) <= set(open(noted).read().split()):
            sys.exit(0)
        time.sleep(0.02)
    sys.exit(0 if not wait_for else 3)

signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
while True:
    time.sleep(1)
"""


def _stand_in(name: str, noted: Path, *wait_for: str) -> Child:
    child = Child(name, lambda port: [], stop_group="stages" if name.startswith("stage-") else "")
    child.process = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, name, str(noted), *wait_for], stdout=subprocess.PIPE, text=True
    )
    assert child.process.stdout is not None and child.process.stdout.readline() == "up\n"
    return child


def test_stages_stop_at_once_between_the_gateway_and_the_cache(tmp_path):
    noted = tmp_path / "sigterms"
    noted.touch()
    supervisor = Supervisor(SupervisionConfig(stop_timeout_s=5.0))
    children = [
        _stand_in("cache", noted),
        _stand_in("stage-0", noted, "stage-1"),
        _stand_in("stage-1", noted, "stage-0"),
        _stand_in("gateway", noted),
    ]
    supervisor._children.extend(children)  # as `start` records them, in start order
    started = time.monotonic()
    supervisor.stop_all()
    assert [(c.name, c.process.returncode) for c in children if c.process] == [
        ("cache", 0),
        ("stage-0", 0),
        ("stage-1", 0),
        ("gateway", 0),
    ]
    order = noted.read_text().split()
    assert order[0] == "gateway" and sorted(order[1:3]) == ["stage-0", "stage-1"] and order[3] == "cache", order
    assert time.monotonic() - started < 5.0  # nobody waited for a SIGKILL
