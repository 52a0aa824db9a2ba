"""Log lines: processes that share one log file (the children of `stagemesh up`, unbuffered) write
whole JSON lines, never interleaved inside a line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINES = 2000

CHILD = """
import sys
from stagemesh.core import logs
logs.configure(sys.argv[1])
log = logs.get_logger("test")
for i in range(int(sys.argv[2])):
    log.info("line", n=i, pad="x" * 100)
"""


def test_two_unbuffered_processes_sharing_a_log_file_write_whole_lines(tmp_path):
    path = tmp_path / "shared.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    with open(path, "ab") as log:  # one file, as the services of a mesh share the supervisor's
        children = [
            subprocess.Popen([sys.executable, "-c", CHILD, name, str(LINES)], stderr=log, env=env)
            for name in ("a", "b")
        ]
        assert [c.wait(timeout=120) for c in children] == [0, 0]
    entries = [json.loads(line) for line in path.read_text().splitlines()]  # each line whole JSON
    for name in ("a", "b"):
        assert sorted(e["n"] for e in entries if e["service"] == name) == list(range(LINES))
