"""Sleep and wake of a stage holding >= 20 GB of bf16 weights, against the copy bandwidth of
pinned memory measured in the same run.

One run measures, in order:
  1. pinned copy bandwidth each way (torch pinned buffers, 4 GiB): the floor;
  2. sleep_host_buffer = "first_sleep" (lazy): the first level-1 sleep, which faults in and
     page-locks the buffer while it copies, against its floor measured just before it on the
     same machine: a fresh anonymous buffer of the weights' size faulted in, then page-locked,
     then the copy at pinned D2H bandwidth, one after the other (the issue's anchor on the H200
     was 5.6 s per 20 GB). Before the floor, one such buffer is faulted in and freed untimed:
     a virtual machine's hypervisor backs guest memory on its first touch (seconds per 20 GB
     in a fresh VM, paid once per boot by whatever touches it first), which would otherwise
     fall on whichever of the two runs first. Then --lazy-repeats level-2 wakes from a
     page-cache-hot checkpoint, each locking the checkpoint's pieces as it copies;
  3. the buffer prepared ahead ("at_start"), once per warm-up DMA variant (--warm-variants)
     with the weights left in the loader's allocations, then once as the worker prepares it:
     the default warm-up and the weights compacted into one device allocation through the
     buffer (SleepController.compact); a fresh controller each, the one before closed:
     preparation time (fault-in, locking, warm-up DMA, compaction), the host memory held, then
     the first level-1 sleep (its copy and release timed apart) and wake. The worker's variant
     is kept for the cycles;
  4. --warmup + --repeats sleep/wake cycles alternating level 2 and level 1 on it: level 2 with
     the checkpoint held mapped and locked across cycles (the first level-2 sleep starts the
     locking; the warm-up cycles include that first wake), with RSS and device memory in use
     after every wake;
  5. a level-2 wake from a cold page cache, lazy mode (caches dropped where root may, else the
     file evicted with posix_fadvise; the fraction still resident is printed). A held
     checkpoint cannot go cold: its pages are locked in the page cache;
  6. with --naive, module.to("cpu") / module.to("cuda") (about a minute for 20 GB).
Targets (CUDA): the first level-1 sleep with the buffer prepared ahead as the worker does, later
level-1 sleeps and every level-1 wake and held level-2 wake >= 0.8 x pinned bandwidth; the lazy
first sleep within its floor; RSS and device memory flat within 2 % over the cycles. The other
warm-up variants and the lazy level-2 wake are reported beside them ("info"). Prints PASS/FAIL
for each, writes JSON, exits 1 when one is missed. On the CPU (--device cpu --gib 0.05
--dim 1024) it checks the code path only.

Run on a GPU: python -m bench.sleep_wake --gib 20
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.stage_service import platform
from stagemesh.stage_service.models.contract import WeightFile
from stagemesh.stage_service.worker import host_pages
from stagemesh.stage_service.worker.sleep import SleepController
from stagemesh.weight_store.safetensors_writer import write_streamed

TARGET = 0.8  # of pinned bandwidth
FLAT = 0.02  # RSS and device memory over the cycles
LAZY_ANCHOR_S_PER_GB = 5.6 / 20  # fault-in 3.3 s + cudaHostRegister 2.0 s (+ the copy) per 20 GB, H200


def build_model(gib: float, dim: int, device: str) -> nn.Module:
    per_layer = dim * dim * 2
    layers = max(1, int(gib * 2**30 // per_layer))
    model = nn.ModuleList(nn.Linear(dim, dim, bias=True, device="meta", dtype=torch.bfloat16) for _ in range(layers))
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)  # never time on zeros
    return model


def sync(device: str) -> None:
    if platform.is_cuda(device):
        torch.cuda.synchronize(device)


def timed(device: str, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def floor_bandwidth(device: str, nbytes: int) -> tuple[float, float]:
    """Bytes/s host->device and device->host: pinned memory on a GPU, a plain memcpy on the CPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=platform.is_cuda(device))
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_()
    results = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        seconds = timed(device, lambda d=dst, s=src: [d.copy_(s, non_blocking=True) for _ in range(3)])
        results.append(3 * nbytes / seconds)
    del host, dev
    if platform.is_cuda(device):
        torch.cuda.empty_cache()
    return results[0], results[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def device_used(device: str) -> int | None:
    if not platform.is_cuda(device):
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# ---- the page cache -------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache (mincore); None where that cannot be read."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        ok = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    if not ok:
        return None
    flags = bytes(vec)
    return 1 - flags.count(0) / pages


def evict(path: Path) -> str:
    """Drop the file from the page cache as far as this process may; says how."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches + posix_fadvise(DONTNEED)"
    except OSError as exc:
        print(f"cannot drop caches ({exc.strerror}): the file was evicted with posix_fadvise(DONTNEED) only")
        return "posix_fadvise(DONTNEED)"


def read_through(path: Path) -> None:
    with open(path, "rb") as f:  # page-cache hot, as after a recent load
        while f.read(1 << 26):
            pass


# ---- the parts ------------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = args.device
        self.piece_bytes = args.piece_mib << 20
        self.cuda = platform.is_cuda(self.device)
        self.h2d, self.d2h = floor_bandwidth(self.device, min(4 << 30, int(args.gib * 2**30)))
        self.model = build_model(args.gib, args.dim, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.ckpt = Path(args.dir or tempfile.mkdtemp()) / "model.safetensors"
        state = self.model.state_dict()
        write_streamed(self.ckpt, [(k, tuple(v.shape), v.dtype) for k, v in state.items()], state.values())
        del state  # it references the weights' storage: holding it would keep them on the device
        read_through(self.ckpt)
        self.reference = self.model[0].weight[:4, :8].float().cpu().clone()
        self.report: dict = {
            "device": self.device,
            "weight_bytes": self.weight_bytes,
            "pinned_h2d_bytes_per_s": self.h2d,
            "pinned_d2h_bytes_per_s": self.d2h,
            "warm_dma_default": host_pages.WARM_DMA,
        }
        self.checks: list[tuple[str, float, str, bool | None]] = []  # None: reported, no target

    def controller(self, host_buffer: str = "first_sleep", warm_dma: str = host_pages.WARM_DMA) -> SleepController:
        files = [WeightFile(self.ckpt, {"": self.model})]
        return SleepController(files, self.device, host_buffer, piece_bytes=self.piece_bytes, warm_dma=warm_dma)

    def x_d2h(self, seconds: float) -> float:
        return self.weight_bytes / seconds / self.d2h

    def x_h2d(self, seconds: float) -> float:
        return self.weight_bytes / seconds / self.h2d

    def gbps(self, seconds: float) -> float:
        return self.weight_bytes / seconds / 1e9

    def same_weights(self) -> None:
        assert torch.equal(self.model[0].weight[:4, :8].float().cpu(), self.reference), "weights changed"

    def check(self, what: str, value: float, target: str = "", ok: bool | None = None) -> None:
        self.checks.append((what, value, target or "-", ok))

    def lazy_floor(self) -> tuple[float, list]:
        """Seconds of the lazy first sleep's floor here: fault-in, page-locking and the copy of
        a fresh buffer of the weights' size, one after the other (after an untimed first touch)."""
        first_touch_s = self._fault_fresh()[0]  # the buffer goes at once: its pages are backed now
        fault_s, buffer = self._fault_fresh()
        spans = host_pages.piece_spans(self.weight_bytes, self.piece_bytes)
        base = buffer.data_ptr()

        def lock(span: tuple[int, int]):
            return platform.lock_host_range(base + span[0], span[1] - span[0], self.device)

        with ThreadPoolExecutor(host_pages.LOCK_THREADS) as pool:
            started = time.perf_counter()
            undo = list(pool.map(lock, spans))
            lock_s = time.perf_counter() - started
        for u in undo:
            if u is not None:
                u()
        floor_s = fault_s + lock_s + self.weight_bytes / self.d2h
        self.report["lazy_floor"] = {
            "first_touch_s": first_touch_s,
            "fault_s": fault_s,
            "lock_s": lock_s,
            "floor_s": floor_s,
        }
        return floor_s, [
            ["first touch of a buffer that size (untimed in both)", first_touch_s, self.gbps(first_touch_s), ""],
            [
                f"lazy floor: fault-in {fault_s:.3f} + lock {lock_s:.3f} + copy at D2H",
                floor_s,
                self.gbps(floor_s),
                self.x_d2h(floor_s),
            ],
        ]

    def _fault_fresh(self) -> tuple[float, torch.Tensor]:
        """Seconds to fault in a fresh anonymous buffer of the weights' size on the threads the
        level-1 buffer uses, and the buffer."""
        buffer = platform.anonymous_buffer(self.weight_bytes)
        step = -(-buffer.numel() // host_pages.FAULT_THREADS)
        parts = [buffer[k : k + step] for k in range(0, buffer.numel(), step)]
        started = time.perf_counter()
        with ThreadPoolExecutor(host_pages.FAULT_THREADS) as pool:
            list(pool.map(platform.fault_in, parts))
        return time.perf_counter() - started, buffer

    def lazy(self) -> list:
        """sleep_host_buffer = "first_sleep": the first level-1 sleep, then level-2 wakes that
        lock the checkpoint per wake."""
        floor_s, rows = self.lazy_floor()
        controller = self.controller()
        sleep_s = timed(self.device, lambda: controller.sleep(1))
        stats = controller.host_stats()
        wake_s = timed(self.device, controller.wake)
        self.same_weights()
        wakes = []
        for _ in range(self.args.lazy_repeats):
            controller.sleep(2)
            wakes.append((timed(self.device, controller.wake), controller.fill_stats()))
            controller.settle()
            self.same_weights()
        controller.close()
        gb = self.weight_bytes / 1e9
        wake2 = statistics.median(s for s, _ in wakes)
        self.report["lazy"] = {
            "sleep_s": sleep_s,
            "wake_s": wake_s,
            **stats,
            "level2_wakes": [{"wake_s": s, **f} for s, f in wakes],
        }
        self.check(
            f"first level-1 sleep, lazy (s per GB; anchor {LAZY_ANCHOR_S_PER_GB:.3f})", sleep_s / gb,
            f"<= {floor_s / gb:.3f} (floor here)", sleep_s <= floor_s,
        )  # fmt: skip
        self.check(f"level-2 wake, hot, lazy: locked per wake, median of {len(wakes)} (x H2D)", self.x_h2d(wake2))
        lock = statistics.median(f["lock_s"] for _, f in wakes)
        return rows + [
            ["level 1 sleep, first, lazy buffer", sleep_s, self.gbps(sleep_s), self.x_d2h(sleep_s)],
            [f"  (fault-in {stats['fault_s']:.3f} s wall, locking {stats['lock_s']:.3f} s on threads)", "", "", ""],
            ["level 1 wake after it", wake_s, self.gbps(wake_s), self.x_h2d(wake_s)],
            ["level 2 wake, hot, lazy (median)", wake2, self.gbps(wake2), self.x_h2d(wake2)],
            [f"  (locking {lock:.3f} s summed over {host_pages.LOCK_THREADS} threads, per wake)", "", "", ""],
        ]

    def prepared(self, warm_dma: str, compact: bool) -> tuple[SleepController, list]:
        """A fresh controller that prepares (and warms) the buffer at start, and with `compact`
        moves the weights into one allocation through it; its first level-1 sleep and wake."""
        gc.collect()
        started = time.perf_counter()
        controller = self.controller("at_start", warm_dma)
        if compact:
            controller.compact()
        prepare_s = time.perf_counter() - started
        stats = controller.host_stats()
        sleep_s = timed(self.device, lambda: controller.sleep(1))
        phases = controller.last_sleep_phases
        wake_s = timed(self.device, controller.wake)
        self.same_weights()
        name = f"warm DMA {warm_dma!r}, " + ("compacted" if compact else "loader's allocations")
        self.report.setdefault("prepared", {})[name] = {
            "prepare_s": prepare_s,
            "sleep_s": sleep_s,
            "wake_s": wake_s,
            **{f"sleep_{k}": v for k, v in phases.items()},
            **stats,
        }
        what = f"first level-1 sleep, buffer prepared, {name} (x D2H)"
        if compact:  # as the worker prepares it
            self.check(what, self.x_d2h(sleep_s), f">= {TARGET}", self.x_d2h(sleep_s) >= TARGET)
            self.check("level-1 wake (x H2D)", self.x_h2d(wake_s), f">= {TARGET}", self.x_h2d(wake_s) >= TARGET)
        else:
            self.check(what, self.x_d2h(sleep_s))
        held = controller.host_bytes
        return controller, [
            [
                f"prepare at start, {name} ({held / 1e9:.2f} GB held; warm-up {stats['warm_s']:.3f} s on threads)",
                prepare_s,
                held / prepare_s / 1e9,
                "",
            ],
            [f"level 1 sleep, first, {name}", sleep_s, self.gbps(sleep_s), self.x_d2h(sleep_s)],
            [
                f"  (copy {phases.get('copy_s', 0.0):.3f} s, release {phases.get('release_s', 0.0):.3f} s)",
                "",
                "",
                "",
            ],
            [f"level 1 wake, {name}", wake_s, self.gbps(wake_s), self.x_h2d(wake_s)],
        ]

    def cycles(self, controller: SleepController) -> list:
        rows, samples = [], []
        for n in range(self.args.warmup + self.args.repeats):
            level = 2 - n % 2
            sleep_s = timed(self.device, lambda lv=level: controller.sleep(lv))
            wake_s = timed(self.device, controller.wake)
            controller.settle()
            self.same_weights()
            fill = controller.fill_stats() if level == 2 else {}
            sample = {
                "level": level,
                "sleep_s": sleep_s,
                **{f"sleep_{k}": v for k, v in controller.last_sleep_phases.items()},
                "wake_s": wake_s,
                "rss": rss_bytes(),
                "device_used": device_used(self.device),
                "checkpoint_bytes_held": controller.checkpoint_bytes,
                **{f"fill_{k}": v for k, v in fill.items()},
            }
            (samples if n >= self.args.warmup else self.report.setdefault("warmup", [])).append(sample)
            used = sample["device_used"]
            note = "warm-up" if n < self.args.warmup else ""
            if fill.get("runs") == 1:
                note = f"first held wake: waited {fill['wait_s']:.3f} s for the locking the sleep started"
            rows.append(
                [
                    n,
                    level,
                    sleep_s,
                    self.x_d2h(sleep_s) if level == 1 else "-",
                    wake_s,
                    self.x_h2d(wake_s),
                    sample["rss"] / 1e9,
                    "-" if used is None else used / 1e9,
                    note,
                ]
            )
        self.report["cycles"] = samples
        self._cycle_checks(samples)
        return rows

    def _cycle_checks(self, samples: list[dict]) -> None:
        by_level = {lv: [s for s in samples if s["level"] == lv] for lv in (1, 2)}
        later_sleep = statistics.median(self.x_d2h(s["sleep_s"]) for s in by_level[1])
        wake1 = statistics.median(self.x_h2d(s["wake_s"]) for s in by_level[1])
        wake2 = [self.x_h2d(s["wake_s"]) for s in by_level[2]]
        self.check("later level-1 sleeps, median (x D2H)", later_sleep, f">= {TARGET}", later_sleep >= TARGET)
        self.check("later level-1 wakes, median (x H2D)", wake1, f">= {TARGET}", wake1 >= TARGET)
        self.check(
            f"level-2 wake, hot, held checkpoint, median (x H2D; min {min(wake2):.3f})",
            statistics.median(wake2),
            f">= {TARGET}",
            statistics.median(wake2) >= TARGET,
        )
        for key in ("rss", "device_used"):
            series = [s[key] for s in samples if s[key] is not None]
            if series:
                spread = max(abs(v / series[0] - 1) for v in series)
                self.check(f"{key} over {len(series)} cycles (max change)", spread, f"<= {FLAT}", spread <= FLAT)

    def level_2_breakdown(self) -> str:
        held = [s for s in self.report["cycles"] if s["level"] == 2]
        if not held:
            return ""

        def med(key: str) -> float:
            return statistics.median(s.get(key, 0.0) for s in held)

        last = held[-1]
        return (
            f"level-2 hot wake, held checkpoint, median: {med('fill_locked_bytes') / 1e9:.2f} GB copied from "
            f"locked pieces, {med('fill_staged_bytes') / 1e9:.2f} GB staged, {med('fill_wait_s'):.3f} s waiting "
            f"for locks; locked once ({last.get('fill_lock_calls', 0)} ranges, {last.get('fill_lock_s', 0.0):.3f} s "
            f"+ {last.get('fill_warm_s', 0.0):.3f} s warm-up summed over {host_pages.LOCK_THREADS} threads), "
            f"served {last.get('fill_runs', 0)} wakes"
        )

    def cold_wake(self) -> list:
        controller = self.controller()  # lazy: a held checkpoint's pages are locked, they cannot go cold
        controller.sleep(2)
        how = evict(self.ckpt)
        resident = resident_fraction(self.ckpt)
        wake_s = timed(self.device, controller.wake)
        controller.settle()
        self.same_weights()
        self.report["cold"] = {
            "wake_s": wake_s,
            "evicted_by": how,
            "resident_before": resident,
            **controller.fill_stats(),
        }
        controller.close()
        shown = "unknown" if resident is None else f"{resident:.1%}"
        if resident is None or resident > 0.1:
            print(f"the cold figure is not from a cold cache: {shown} of the checkpoint stayed resident")
        self.check(f"level-2 wake, cold, lazy ({shown} resident) (x H2D)", self.x_h2d(wake_s))
        return [[f"level 2 wake, cold, lazy ({shown} resident; {how})", wake_s, self.gbps(wake_s), self.x_h2d(wake_s)]]

    def naive(self) -> list:
        to_cpu = timed(self.device, lambda: self.model.to("cpu"))
        to_dev = timed(self.device, lambda: self.model.to(self.device))
        return [
            ["naive module.to('cpu')", to_cpu, self.gbps(to_cpu), self.x_d2h(to_cpu)],
            [f"naive module.to('{self.device}')", to_dev, self.gbps(to_dev), self.x_h2d(to_dev)],
        ]


def measure(run: Run) -> tuple[list, list]:
    args = run.args
    rows = run.lazy()
    variants = [(v, False) for v in args.warm_variants] + [(host_pages.WARM_DMA, True)]
    for k, (warm_dma, compact) in enumerate(variants):  # the worker's last: kept for the cycles
        controller, prepared = run.prepared(warm_dma, compact)
        rows += prepared
        if k < len(variants) - 1:
            controller.close()
    cycle_rows = run.cycles(controller)
    run.report["host_bytes_held"] = controller.host_bytes
    run.report["checkpoint_bytes_held"] = controller.checkpoint_bytes
    controller.close()
    rows += run.cold_wake()
    if args.naive:
        rows += run.naive()
    return rows, cycle_rows


def print_results(run: Run, rows: list, cycle_rows: list) -> None:
    gb, h2d, d2h = run.weight_bytes / 1e9, run.h2d / 1e9, run.d2h / 1e9
    print(f"weights {gb:.2f} GB bf16 on {run.device}; pinned H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    print_table(["operation", "seconds", "GB/s", "x pinned bandwidth"], rows, floatfmt=".3f")
    print_table(
        ["cycle", "level", "sleep s", "x D2H", "wake s", "x H2D", "RSS GB", "device GB", ""], cycle_rows, floatfmt=".3f"
    )
    host, ckpt = run.report["host_bytes_held"] / 1e9, run.report["checkpoint_bytes_held"] / 1e9
    print(
        f"host memory held with sleep_host_buffer = at_start / background: {host:.2f} GB level-1 buffer from the "
        f"start, plus {ckpt:.2f} GB of the checkpoint's page cache locked from the first level-2 sleep on "
        f"({host + ckpt:.2f} GB page-locked, neither swappable nor reclaimable); first_sleep holds the buffer "
        "from the first level-1 sleep on and nothing of the checkpoint between wakes"
    )
    print(run.level_2_breakdown())
    print_table(
        ["target", "value", "bound", "result"],
        [[w, v, t, "info" if ok is None else "PASS" if ok else "FAIL"] for w, v, t, ok in run.checks],
        floatfmt=".3f",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=20.0, help="weights to hold, GiB of bf16")
    parser.add_argument("--dim", type=int, default=8192, help="each weight is dim x dim (8192: 128 MiB, FLUX-like)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    add_repeats(parser, 20, "measured sleep/wake cycles, levels 2 and 1 in turn (default: 20)", "--cycles")
    parser.add_argument("--warmup", type=int, default=2, help="cycles before them, not counted")
    parser.add_argument(
        "--lazy-repeats",
        "--lazy-cycles",
        dest="lazy_repeats",
        type=int,
        default=3,
        help="level-2 wakes measured in first_sleep mode",
    )
    parser.add_argument(
        "--warm-variants",
        nargs="+",
        choices=host_pages.WARM_DMAS,
        default=list(host_pages.WARM_DMAS),
        help="warm-up DMA variants whose prepared first sleep is measured (the default one always is)",
    )
    parser.add_argument("--naive", action="store_true", help="also time module.to() (about a minute for 20 GB)")
    parser.add_argument("--piece-mib", type=int, default=host_pages.PIECE_BYTES >> 20, help="unit of locking")
    parser.add_argument("--lock-threads", type=int, default=host_pages.LOCK_THREADS, help="threads locking pieces")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    add_output(parser, "sleep_wake")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    host_pages.LOCK_THREADS = args.lock_threads  # a study of the driver's concurrency, not a setting
    started = time.perf_counter()
    run = Run(args)
    try:
        rows, cycle_rows = measure(run)
    finally:
        run.ckpt.unlink(missing_ok=True)
    run.report["total_s"] = time.perf_counter() - started
    print_results(run, rows, cycle_rows)
    missed = [c for c in run.checks if c[3] is False]
    run.report["rows"] = [[str(c) for c in r] for r in rows]
    run.report["checks"] = [{"what": w, "value": v, "bound": t, "pass": ok} for w, v, t, ok in run.checks]
    print(f"wrote {write_json(args.output, 'sleep_wake', run.report)} ({run.report['total_s']:.0f} s in all)")
    if run.cuda and missed:
        print(f"{len(missed)} target(s) missed")
        sys.exit(1)
    print("all targets met" if run.cuda else "CPU run: the code path only, no targets")


if __name__ == "__main__":
    main()
