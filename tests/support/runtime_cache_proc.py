"""A child process for runtime-cache tests: publishes, looks up or holds a lock, and talks to the
test over stdin/stdout (one JSON line per event; a line on stdin lets it go on)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from stagemesh.stage_service.runtime_cache.lookup import RuntimeCache
from stagemesh.weight_store import locks

REPO = Path(__file__).resolve().parents[2]
_MARK = "@@ "  # marks our lines among log lines on stdout


class Child:
    """This module run as a real process; `expect(event)` blocks on its next stdout line."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.runtime_cache_proc", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def expect(self, event: str) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"child {self.pid} exited ({self.proc.wait()}) before {event!r}"
            if line.startswith(_MARK):
                message = json.loads(line[len(_MARK) :])
                if message["event"] == event:
                    return message
                # The child now waits for us; fail instead of blocking on a line that never comes.
                assert message["event"] != "outcome", f"expected {event!r}, child {self.pid} ended with {message}"

    def proceed(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        if self.proc.poll() is None:
            self.proceed()
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "blocks.0.weight": torch.randn(64, 64, generator=gen),
        "blocks.1.weight": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
        "norm.bias": torch.randn(64, generator=gen),
    }


def say(event: str, **fields) -> None:
    print(_MARK + json.dumps({"event": event, **fields}), flush=True)


def wait_for_test() -> None:
    sys.stdin.readline()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["publish", "lookup", "hold-lock"])
    parser.add_argument("root", type=Path)
    parser.add_argument("key")
    parser.add_argument("--service", default=None)
    parser.add_argument("--lock-timeout", type=float, default=30.0)
    parser.add_argument("--block-in-produce", action="store_true")
    args = parser.parse_args()

    if args.mode == "hold-lock":
        held = locks.publication_lock(args.root, args.key, args.lock_timeout)
        say("locked" if held else "not-locked")
        wait_for_test()
        return

    def produce() -> dict[str, torch.Tensor]:
        if args.block_in_produce:
            say("producing")
            wait_for_test()
        return weights()

    cache = RuntimeCache(args.root, service_address=args.service, lock_timeout_s=args.lock_timeout)
    say("started")
    outcome = cache.lookup(args.key) if args.mode == "lookup" else cache.get_or_publish(args.key, produce)
    entry = outcome.entry
    files = sorted(str(p) for p in entry.path.iterdir()) if entry is not None else []
    equal = entry is not None and all(torch.equal(entry.tensors[n], t) for n, t in weights().items())
    say("outcome", reason=outcome.reason, detail=outcome.detail, files=files, equal=equal)
    wait_for_test()  # keeps the mapping (and the consumer lock) alive until the test is done
    if entry is not None:
        entry.close()


if __name__ == "__main__":
    main()
