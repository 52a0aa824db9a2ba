"""The 8-bit streaming report of bench/dlo.py (`--stream-dtype float8_e4m3fn int8`): for every
8-bit dtype, image size and resident-block count, DLO streaming the model's dtype against DLO
streaming that 8-bit form from the same run, and whether it meets its targets (docs/DLO.md,
"8-bit weight streaming").

Floors are transfer floors: streamed bytes per step / the measured pinned H2D bandwidth. Targets,
checked with 0 resident blocks: step <= 0.55 x the bf16 transfer floor, pinned host bytes 8-bit /
bf16 <= 0.55, and the cosine similarity of the step's output with the model's own (the resident
model's output, which DLO in the model's dtype equals bit for bit) >= 0.995.
"""

from __future__ import annotations

from bench.common import print_table

STEP_TARGET = 0.55  # x the bf16 transfer floor
HOST_TARGET = 0.55  # x the bf16 pinned host bytes
COSINE_TARGET = 0.995


def _pairs(rows: list[dict]) -> list[tuple[dict, dict, dict | None]]:
    """(DLO in the model's dtype, DLO in an 8-bit form, the group-offloading peer or None) per
    8-bit dtype, size and resident count."""
    dlo = {(r["size"], r["resident_blocks"], r["stream_dtype"]): r for r in rows if r["case"].startswith("stagemesh")}
    peer = {r["size"]: r for r in rows if r["case"] == "diffusers group offload"}
    return [
        (dlo[size, resident, ""], row, peer.get(size))
        for (size, resident, dtype), row in sorted(dlo.items())
        if dtype and (size, resident, "") in dlo
    ]


def _figures(base: dict, quantized: dict, peer: dict | None, bandwidth: float) -> dict:
    bf16_floor = base["streamed_bytes"] / bandwidth
    own_floor = quantized["streamed_bytes"] / bandwidth
    return {
        "stream_dtype": quantized["stream_dtype"],
        "size": base["size"],
        "resident_blocks": base["resident_blocks"],
        "bf16_step_s": base["step_s"],
        "step_s": quantized["step_s"],
        "bf16_transfer_floor_s": bf16_floor,
        "transfer_floor_s": own_floor,
        "resident_step_s": base["resident_step_s"],
        "step_over_bf16_floor": quantized["step_s"] / bf16_floor,
        "step_over_own_floor": quantized["step_s"] / max(own_floor, base["resident_step_s"]),
        "host_bytes_over_bf16": quantized["host_bytes"] / base["host_bytes"],
        "cosine_vs_bf16": quantized["cosine"],
        "peer_step_s": None if peer is None else peer["step_s"],
    }


def _verdicts(f: dict) -> dict[str, bool]:
    step, host, cosine = f["step_over_bf16_floor"], f["host_bytes_over_bf16"], f["cosine_vs_bf16"]
    return {
        f"step {step:.3f} x bf16 floor <= {STEP_TARGET}": step <= STEP_TARGET,
        f"pinned host 8-bit/bf16 {host:.3f} <= {HOST_TARGET}": host <= HOST_TARGET,
        f"cosine vs bf16 {cosine:.5f} >= {COSINE_TARGET}": cosine >= COSINE_TARGET,
    }


def report(rows: list[dict], bandwidth: float, check: bool) -> dict:
    """Print the 8-bit table and verdicts; `check`: whether timings mean anything (a GPU run).
    Returns the figures, the verdicts and `met` per 8-bit dtype (None when not checked)."""
    figures = [_figures(base, row, peer, bandwidth) for base, row, peer in _pairs(rows)]
    ms = 1e3
    print_table(
        [
            "stream dtype",
            "size",
            "resident",
            "bf16 step ms",
            "8-bit step ms",
            "bf16 floor ms",
            "8-bit floor ms",
            "step / bf16 floor",
            "step / its floor",
            "pinned 8-bit/bf16",
            "cosine vs bf16",
            "group offload ms",
        ],
        [
            [
                f["stream_dtype"],
                f["size"],
                f["resident_blocks"],
                f"{f['bf16_step_s'] * ms:.1f}",
                f"{f['step_s'] * ms:.1f}",
                f"{f['bf16_transfer_floor_s'] * ms:.1f}",
                f"{f['transfer_floor_s'] * ms:.1f}",
                f"{f['step_over_bf16_floor']:.3f}",
                f"{f['step_over_own_floor']:.3f}",
                f"{f['host_bytes_over_bf16']:.3f}",
                f"{f['cosine_vs_bf16']:.5f}",
                "-" if f["peer_step_s"] is None else f"{f['peer_step_s'] * ms:.1f}",
            ]
            for f in figures
        ],
    )
    dtypes = sorted({f["stream_dtype"] for f in figures})
    verdicts = {
        dtype: {
            f"{f['size']}: {text}": ok
            for f in figures
            if f["stream_dtype"] == dtype and f["resident_blocks"] == 0
            for text, ok in _verdicts(f).items()
        }
        for dtype in dtypes
    }
    if not check:
        print("8-bit targets not checked: timings off a GPU mean nothing", flush=True)
        return {"figures": figures, "verdicts": verdicts, "met": {d: None for d in dtypes}}
    met = {}
    for dtype in dtypes:
        for text, ok in verdicts[dtype].items():
            print(f"{dtype} target {'met' if ok else 'MISSED'}: {text}", flush=True)
        met[dtype] = bool(verdicts[dtype]) and all(verdicts[dtype].values())
        print(
            f"{dtype.upper()} TARGETS {'MET' if met[dtype] else 'MISSED'} (0 resident blocks, every size)", flush=True
        )
    return {"figures": figures, "verdicts": verdicts, "met": met}
