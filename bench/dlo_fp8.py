"""The FP8 streaming report of bench/dlo.py (`--stream-dtype float8_e4m3fn`): for every image size
and resident-block count, DLO streaming the model's dtype against DLO streaming FP8 from the
same run, and whether FP8 meets its targets (docs/DLO.md, "FP8 weight streaming").

Floors are transfer floors: streamed bytes per step / the measured pinned H2D bandwidth. Targets,
checked with 0 resident blocks: FP8 step <= 0.55 x the bf16 transfer floor, pinned host bytes
FP8 / bf16 <= 0.55, and the cosine similarity of the step's output with the model's own (the
resident model's output, which DLO in the model's dtype equals bit for bit) >= 0.995.
"""

from __future__ import annotations

from bench.common import print_table

STEP_TARGET = 0.55  # x the bf16 transfer floor
HOST_TARGET = 0.55  # x the bf16 pinned host bytes
COSINE_TARGET = 0.995


def _pairs(rows: list[dict]) -> list[tuple[dict, dict, dict | None]]:
    """(DLO in the model's dtype, DLO in FP8, the group-offloading peer or None) per size and
    resident count."""
    dlo = {(r["size"], r["resident_blocks"], r["stream_dtype"]): r for r in rows if r["case"].startswith("stagemesh")}
    peer = {r["size"]: r for r in rows if r["case"] == "diffusers group offload"}
    return [
        (base, dlo[size, resident, "float8_e4m3fn"], peer.get(size))
        for (size, resident, dtype), base in sorted(dlo.items())
        if dtype == "" and (size, resident, "float8_e4m3fn") in dlo
    ]


def _figures(base: dict, fp8: dict, peer: dict | None, bandwidth: float) -> dict:
    bf16_floor = base["streamed_bytes"] / bandwidth
    fp8_floor = fp8["streamed_bytes"] / bandwidth
    return {
        "size": base["size"],
        "resident_blocks": base["resident_blocks"],
        "bf16_step_s": base["step_s"],
        "fp8_step_s": fp8["step_s"],
        "bf16_transfer_floor_s": bf16_floor,
        "fp8_transfer_floor_s": fp8_floor,
        "resident_step_s": base["resident_step_s"],
        "fp8_step_over_bf16_floor": fp8["step_s"] / bf16_floor,
        "fp8_step_over_fp8_floor": fp8["step_s"] / max(fp8_floor, base["resident_step_s"]),
        "host_bytes_fp8_over_bf16": fp8["host_bytes"] / base["host_bytes"],
        "cosine_vs_bf16": fp8["cosine"],
        "peer_step_s": None if peer is None else peer["step_s"],
    }


def _verdicts(f: dict) -> dict[str, bool]:
    return {
        f"step {f['fp8_step_over_bf16_floor']:.3f} x bf16 floor <= {STEP_TARGET}": f["fp8_step_over_bf16_floor"]
        <= STEP_TARGET,
        f"pinned host fp8/bf16 {f['host_bytes_fp8_over_bf16']:.3f} <= {HOST_TARGET}": f["host_bytes_fp8_over_bf16"]
        <= HOST_TARGET,
        f"cosine vs bf16 {f['cosine_vs_bf16']:.5f} >= {COSINE_TARGET}": f["cosine_vs_bf16"] >= COSINE_TARGET,
    }


def report(rows: list[dict], bandwidth: float, check: bool) -> dict:
    """Print the FP8 table and verdicts; `check`: whether timings mean anything (a GPU run).
    Returns the figures, the verdicts and `met` (None when not checked)."""
    figures = [_figures(base, fp8, peer, bandwidth) for base, fp8, peer in _pairs(rows)]
    ms = 1e3
    print_table(
        [
            "size",
            "resident",
            "bf16 step ms",
            "fp8 step ms",
            "bf16 floor ms",
            "fp8 floor ms",
            "fp8 step / bf16 floor",
            "fp8 step / its floor",
            "pinned fp8/bf16",
            "cosine vs bf16",
            "group offload ms",
        ],
        [
            [
                f["size"],
                f["resident_blocks"],
                f"{f['bf16_step_s'] * ms:.1f}",
                f"{f['fp8_step_s'] * ms:.1f}",
                f"{f['bf16_transfer_floor_s'] * ms:.1f}",
                f"{f['fp8_transfer_floor_s'] * ms:.1f}",
                f"{f['fp8_step_over_bf16_floor']:.3f}",
                f"{f['fp8_step_over_fp8_floor']:.3f}",
                f"{f['host_bytes_fp8_over_bf16']:.3f}",
                f"{f['cosine_vs_bf16']:.5f}",
                "-" if f["peer_step_s"] is None else f"{f['peer_step_s'] * ms:.1f}",
            ]
            for f in figures
        ],
    )
    checked = [f for f in figures if f["resident_blocks"] == 0]
    verdicts = {f"{f['size']}: {text}": ok for f in checked for text, ok in _verdicts(f).items()}
    if not check:
        print("fp8 targets not checked: timings off a GPU mean nothing", flush=True)
        return {"figures": figures, "verdicts": verdicts, "met": None}
    for text, ok in verdicts.items():
        print(f"fp8 target {'met' if ok else 'MISSED'}: {text}", flush=True)
    met = bool(verdicts) and all(verdicts.values())
    print(f"FP8 TARGETS {'MET' if met else 'MISSED'} (0 resident blocks, every size)", flush=True)
    return {"figures": figures, "verdicts": verdicts, "met": met}
