"""Where a served batch's time goes, seen from the executor: a per-batch timeline.

bench/async_output.py gives rates; this gives the reasons. It serves the default (tiny) DiT
through engine -> executor -> worker process exactly as that benchmark's (b) and (c) do, and
timestamps, in the serving process, every batch submitted and every message its worker sends
back. Per batch:

  period      time between the worker's consecutive end-of-forward messages (COMPUTE_DONE in
              async mode, RESULT in step mode): one batch's share of the wall clock
  forward     the device time of its forward pass (the worker's own events)
  gap         period - forward: the device idles between forward passes
  queued      the next batch had been submitted before this one's forward ended, so the worker
              did not wait for the serving process to send it
  output lag  async only: OUTPUT_READY arrival - COMPUTE_DONE arrival (copy + pack + send)
  delivered   the request's output reached its caller's event queue after the end-of-forward
              message (async: after OUTPUT_READY; includes the unpack)

The two modes run in alternating rounds on the same two stages (the host's launch speed
drifts). Medians over all batches after the first round. Run on a GPU:
  python -m bench.investigations.async_timeline --sizes 256 --batches 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import add_output, add_repeats, print_table, write_json
from bench.serving import add_serving_args, serving_options, start_paths
from stagemesh.stage_service.models.config import PipelineConfig
from stagemesh.stage_service.models.weights import ensure_model_dir
from stagemesh.stage_service.transport import protocol


class Timeline:
    """Timestamps of one executor's batches, taken on the pump thread and the event loop."""

    def __init__(self, executor) -> None:
        self._lock = threading.Lock()
        self.batches: dict[str, dict] = {}  # rpc_id -> marks
        self._by_output: dict[str, str] = {}
        self._order: list[str] = []
        submit, dispatch = executor.submit, executor._dispatch

        def timed_submit(rank, items, on_progress=None):
            rpc_id, fut = submit(rank, items, on_progress)
            with self._lock:
                self.batches[rpc_id] = {"submitted": time.perf_counter(), "progress": 0}
                self._order.append(rpc_id)
            fut.add_done_callback(lambda _: self._mark(rpc_id, "future_done"))
            return rpc_id, fut

        def timed_dispatch(w, msg):
            now = time.perf_counter()
            self._note(msg, now)
            dispatch(w, msg)
            if isinstance(msg, protocol.OutputReady):
                self._mark_output(msg.async_output_id, "unpacked")

        executor.submit, executor._dispatch = timed_submit, timed_dispatch

    def _mark(self, rpc_id: str, key: str, when: float | None = None) -> None:
        with self._lock:
            if rpc_id in self.batches:
                self.batches[rpc_id][key] = when if when is not None else time.perf_counter()

    def _mark_output(self, output_id: str, key: str, when: float | None = None) -> None:
        with self._lock:
            rpc_id = self._by_output.get(output_id)
        if rpc_id is not None:
            self._mark(rpc_id, key, when)

    def _note(self, msg, now: float) -> None:
        if isinstance(msg, protocol.Progress):
            with self._lock:
                if msg.rpc_id in self.batches:
                    self.batches[msg.rpc_id]["progress"] += 1
        elif isinstance(msg, protocol.ComputeDone):
            with self._lock:
                self._by_output[msg.async_output_id] = msg.rpc_id
            self._mark(msg.rpc_id, "forward_done", now)
        elif isinstance(msg, protocol.Result):
            self._mark(msg.rpc_id, "forward_done", now)
            self._mark(msg.rpc_id, "output", now)
            self._mark(msg.rpc_id, "forward_s", msg.compute_seconds)
        elif isinstance(msg, protocol.OutputReady):
            self._mark_output(msg.async_output_id, "output", now)
            self._mark_output(msg.async_output_id, "forward_s", msg.compute_seconds)

    def ordered(self, since: int = 0) -> list[dict]:
        with self._lock:
            return [dict(self.batches[r]) for r in self._order[since:]]

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)


def summarize(batches: list[dict]) -> dict:
    """Medians (ms) over consecutive batch pairs that completed."""
    done = [b for b in batches if "forward_done" in b and "forward_s" in b]
    done.sort(key=lambda b: b["forward_done"])
    periods, gaps, queued, lags, unpacks = [], [], [], [], []
    for prev, cur in zip(done, done[1:]):
        period = cur["forward_done"] - prev["forward_done"]
        periods.append(period)
        gaps.append(period - cur["forward_s"])
        queued.append(cur["submitted"] < prev["forward_done"])
        lags.append(cur["output"] - cur["forward_done"])
        if "unpacked" in cur:
            unpacks.append(cur["unpacked"] - cur["output"])

    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3 if xs else float("nan")

    return {
        "batches": len(done),
        "period_ms": ms(periods),
        "forward_ms": ms([b["forward_s"] for b in done]),
        "gap_ms": ms(gaps),
        "gap_p90_ms": sorted(gaps)[int(0.9 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
        "queued_fraction": sum(queued) / len(queued) if queued else float("nan"),
        "output_lag_ms": ms(lags),
        "unpack_ms": ms(unpacks),
        "progress_per_batch": statistics.median(b["progress"] for b in done) if done else 0,
    }


async def measure_point(model_dir: Path, args, size: int, batch: int) -> list[dict]:
    async with contextlib.AsyncExitStack() as up:
        modes = [
            (path, Timeline(path.executor), [], []) for path in await start_paths(up, model_dir, args, size, batch)
        ]
        for _ in range(args.repeats):
            for path, timeline, marks, rates in modes:
                first = len(timeline)
                rates.append((await path.rate(args.requests))[0])
                marks.extend(timeline.ordered(first))
    out = []
    for (_, _, marks, rates), mode in zip(modes, ("sync", "async")):
        out.append({"size": size, "batch": batch, "mode": mode, "qps": statistics.median(rates), **summarize(marks)})
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serving_args(parser, sizes=[256], batches=[4])
    parser.add_argument(
        "--requests", type=int, default=192, help="requests per round and mode (several times the requests in flight)"
    )
    add_repeats(parser, 4, "rounds of both modes in turn (default: 4)", "--rounds")
    add_output(parser, "async_timeline")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    model_dir = ensure_model_dir(Path(tempfile.mkdtemp()) / "tiny", PipelineConfig.tiny())
    rows = []
    for size in args.sizes:
        for batch in args.batches:
            for r in asyncio.run(measure_point(model_dir, args, size, batch)):
                rows.append(r)
    print_table(
        [
            "size",
            "batch",
            "mode",
            "QPS",
            "batches",
            "period ms",
            "forward ms",
            "gap ms",
            "gap p90 ms",
            "next queued",
            "output lag ms",
            "unpack ms",
            "progress msgs",
        ],
        [
            [
                r["size"],
                r["batch"],
                r["mode"],
                r["qps"],
                r["batches"],
                r["period_ms"],
                r["forward_ms"],
                r["gap_ms"],
                r["gap_p90_ms"],
                r["queued_fraction"],
                r["output_lag_ms"],
                r["unpack_ms"],
                r["progress_per_batch"],
            ]
            for r in rows
        ],
        floatfmt=".2f",
    )
    path = write_json(args.output, "async_timeline", {**serving_options(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
