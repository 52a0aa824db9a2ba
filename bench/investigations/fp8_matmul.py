"""Rebuild the FP8 weight or multiply in FP8: the Linear layers of one FLUX block, weights
quantised as FP8 streaming stores them (stage_service/offload/quant.py, `quantize_rows`:
float8_e4m3fn, one bfloat16 scale per output channel), run two ways:

  rebuild    `dequantize_into` the weight into a bfloat16 buffer (the Triton kernel on a GPU),
             then `F.linear` (what the FP8 engine does today)
  scaled_mm  each token's activations quantised to float8_e4m3fn with a float32 scale
             (amax / 448, 1 for an all-zero row), then `torch._scaled_mm` with row-wise scales:
             the activation scales (tokens, 1), the weight's (1, out) widened to float32, the
             weight passed as `q.t()` (column-major), bfloat16 out, the bias passed in when
             _scaled_mm takes it (else added after); with `use_fast_accum` off and on

Per block, the median of `--repeats` timings (CUDA events) of all its layers in a row: the
rebuilds alone, the matmuls alone (F.linear on the rebuilt weights is also the resident bf16
time), the activation quantisation alone, and each path in full. Fidelity against F.linear with
the unquantised bfloat16 weight, and of scaled_mm against rebuild: cosine similarity and the
largest |difference| over the reference's largest |value| ("rel"; worst layer of the block).

Shapes: diffusers 0.42 `FluxTransformerBlock` / `FluxSingleTransformerBlock`
(models/transformers/transformer_flux.py, dim 3072, 24 heads of 128, mlp_ratio 4) at 1024²:
4096 image tokens, 512 text tokens, batch 1. The modulation Linears (AdaLayerNormZero(Single))
see one token; where _scaled_mm refuses one row its tokens are padded with zero rows to 16.
Linears that share an input in the block (q/k/v, proj_mlp) share it here; it is quantised once.
`--tokens-scale N` divides the token counts (not the modulation's 1), `--width-scale N` every
feature width (a CPU check; _scaled_mm wants widths that are multiples of 16).

Run on a GPU: python -m bench.investigations.fp8_matmul
CPU check:    python -m bench.investigations.fp8_matmul --device cpu --tokens-scale 64 --width-scale 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.common import add_output, add_repeats, print_table, write_json
from stagemesh.stage_service.offload import dequant
from stagemesh.stage_service.offload.quant import FLOAT8, FP8_MAX, quantize_rows

DIM, MLP, IMAGE, TEXT = 3072, 12288, 4096, 512
BLOCKS: dict[str, list[tuple[str, int, int, int]]] = {  # (Linear, tokens, in, out)
    "double": [
        ("norm1.linear", 1, DIM, 6 * DIM),
        ("norm1_context.linear", 1, DIM, 6 * DIM),
        *((f"attn.to_{p}", IMAGE, DIM, DIM) for p in "qkv"),
        *((f"attn.add_{p}_proj", TEXT, DIM, DIM) for p in "qkv"),
        ("attn.to_out.0", IMAGE, DIM, DIM),
        ("attn.to_add_out", TEXT, DIM, DIM),
        ("ff.net.0.proj", IMAGE, DIM, MLP),
        ("ff.net.2", IMAGE, MLP, DIM),
        ("ff_context.net.0.proj", TEXT, DIM, MLP),
        ("ff_context.net.2", TEXT, MLP, DIM),
    ],
    "single": [
        ("norm.linear", 1, DIM, 3 * DIM),
        *((f"attn.to_{p}", IMAGE + TEXT, DIM, DIM) for p in "qkv"),
        ("proj_mlp", IMAGE + TEXT, DIM, MLP),
        ("proj_out", IMAGE + TEXT, DIM + MLP, DIM),
    ],
}
# Linears fed the same tensor as the Linear before them in the block (silu(temb), the normed
# hidden states): a fused FP8 path would quantise that activation once.
SHARES_INPUT = {"norm1_context.linear", "attn.to_k", "attn.to_v", "attn.add_k_proj", "attn.add_v_proj", "proj_mlp"}
HEADERS = ["block", "path", "prep ms", "matmul ms", "total ms", "cos bf16", "rel bf16", "cos rebuild", "rel rebuild"]


@dataclass(frozen=True)
class Support:
    """What this device's _scaled_mm takes (probed with tiny calls)."""

    available: bool
    bias: bool = False
    one_row: bool = False


@dataclass
class Layer:
    name: str
    x: torch.Tensor  # (tokens, in) bf16 activations
    w: torch.Tensor  # (out, in) bf16, unquantised
    bias: torch.Tensor
    q: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (out,) bf16, as streamed
    scale_b: torch.Tensor  # (1, out) float32, for _scaled_mm
    slot: torch.Tensor  # (out, in) bf16, where the rebuild lands


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of bf16 activations, one float32 scale per row (token)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FLOAT8), scale


def quantize_inputs(layers: list[Layer]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each distinct input of the block quantised once, by id."""
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in layers:
        if id(layer.x) not in out:
            out[id(layer.x)] = quantize_tokens(layer.x)
    return out


def probe(device: torch.device) -> Support:
    def call(rows: int, bias: bool) -> bool:
        a = torch.ones(rows, 32, device=device).to(FLOAT8)
        b = torch.ones(32, 32, device=device).to(FLOAT8)
        added = torch.ones(32, device=device, dtype=torch.bfloat16) if bias else None
        ones = torch.ones(rows, 1, device=device), torch.ones(1, 32, device=device)
        try:
            torch._scaled_mm(a, b.t(), *ones, bias=added, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    if not call(16, False):
        return Support(False)
    return Support(True, bias=call(16, True), one_row=call(1, False))


def scaled_linear(layer: Layer, xq: torch.Tensor, xs: torch.Tensor, fast: bool, support: Support) -> torch.Tensor:
    """FP8 x FP8 -> bf16 with row-wise scales; pads the token rows to 16 where needed."""
    rows = xq.shape[0]
    pad = 0 if support.one_row else -rows % 16
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        xs = torch.cat([xs, xs.new_ones(pad, 1)])
    bias = layer.bias if support.bias else None
    y = torch._scaled_mm(xq, layer.q.t(), xs, layer.scale_b, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast)
    y = y[:rows] if pad else y
    return y if support.bias else y + layer.bias


def make_layers(block: str, args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> list[Layer]:
    layers = []
    for name, tokens, width_in, width_out in BLOCKS[block]:
        rows = tokens if tokens == 1 else max(1, tokens // args.tokens_scale)
        fan_in, fan_out = width_in // args.width_scale, width_out // args.width_scale
        if name not in SHARES_INPUT:
            x = torch.randn(rows, fan_in, generator=gen).to(device, torch.bfloat16)
        w = (torch.randn(fan_out, fan_in, generator=gen) * fan_in**-0.5).to(device, torch.bfloat16)
        bias = (torch.randn(fan_out, generator=gen) * 0.02).to(device, torch.bfloat16)
        q, scale = (t.to(device) for t in quantize_rows(w, device))
        scale_b = scale.float().view(1, fan_out).contiguous()
        layers.append(Layer(name, x, w, bias, q, scale, scale_b, torch.empty_like(w)))
    return layers


def clock(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, the wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fidelity(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict[str, float]:
    """Worst layer's cosine similarity and max |y - ref| / max |ref|."""
    cos, rel = [], []
    for y, ref in zip(outs, refs):
        y32, r32 = y.float().flatten(), ref.float().flatten()
        cos.append(F.cosine_similarity(y32, r32, dim=0).item())
        rel.append(((y32 - r32).abs().max() / r32.abs().max().clamp_min(1e-30)).item())
    return {"cosine": min(cos), "max_rel_err": max(rel)}


def run_block(layers: list[Layer], support: Support, device: torch.device, args: argparse.Namespace) -> dict:
    def t(fn: Callable[[], object]) -> float:
        return clock(fn, device, args.repeats, args.warmup)

    def rebuild_all() -> None:
        for layer in layers:
            dequant.dequantize_into(layer.slot, layer.q, layer.scale)

    def rebuild_linear() -> list[torch.Tensor]:
        out = []
        for layer in layers:
            dequant.dequantize_into(layer.slot, layer.q, layer.scale)
            out.append(F.linear(layer.x, layer.slot, layer.bias))
        return out

    refs = [F.linear(layer.x, layer.w, layer.bias) for layer in layers]
    rebuilt = rebuild_linear()
    report: dict = {
        "rebuild": {
            "rebuild_ms": t(rebuild_all),
            "linear_ms": t(lambda: [F.linear(layer.x, layer.slot, layer.bias) for layer in layers]),
            "total_ms": t(rebuild_linear),
            "vs_bf16": fidelity(rebuilt, refs),
        }
    }
    if not support.available:
        return report
    quantized = quantize_inputs(layers)
    quant_ms = t(lambda: quantize_inputs(layers))
    for fast in (False, True):

        def matmuls(fast: bool = fast) -> list[torch.Tensor]:
            return [scaled_linear(layer, *quantized[id(layer.x)], fast, support) for layer in layers]

        def full(fast: bool = fast) -> list[torch.Tensor]:
            fresh = quantize_inputs(layers)
            return [scaled_linear(layer, *fresh[id(layer.x)], fast, support) for layer in layers]

        outs = full()
        report[f"scaled_mm{'_fast_accum' if fast else ''}"] = {
            "act_quant_ms": quant_ms,
            "matmul_ms": t(matmuls),
            "total_ms": t(full),
            "vs_bf16": fidelity(outs, refs),
            "vs_rebuild": fidelity(outs, rebuilt),
        }
    return report


def table_rows(block: str, report: dict) -> list[list[object]]:
    rows: list[list[object]] = []
    for path in ("rebuild", "scaled_mm", "scaled_mm_fast_accum"):
        if (r := report.get(path)) is None:
            rows.append([block, path, *["n/a"] * 7])
            continue
        times = [r.get("rebuild_ms", r.get("act_quant_ms")), r.get("linear_ms", r.get("matmul_ms")), r["total_ms"]]
        vs = r.get("vs_rebuild", {"cosine": "-", "max_rel_err": "-"})
        rows.append([block, path, *times, *r["vs_bf16"].values(), *vs.values()])
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens-scale", type=int, default=1, help="divide the token counts by this")
    parser.add_argument("--width-scale", type=int, default=1, help="divide the feature widths by this")
    add_repeats(parser, None, "timed runs per figure; figures are medians (default 20; 2 on the CPU)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 5; 1 on the CPU)")
    add_output(parser, "fp8_matmul", "--json")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if DIM % (16 * args.width_scale):
        parser.error(f"--width-scale must leave {DIM} a multiple of 16")
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.repeats = args.repeats or (20 if on_gpu else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    support = probe(device)
    kernel = "triton" if on_gpu and dequant._triton_kernel() is not None else "torch"
    print(f"_scaled_mm: {support}; rebuild kernel: {kernel}")
    gen = torch.Generator().manual_seed(0)
    reports, rows = {}, []
    for block in BLOCKS:
        layers = make_layers(block, args, device, gen)
        reports[block] = run_block(layers, support, device, args)
        rows += table_rows(block, reports[block])
        del layers
    print_table(HEADERS, rows, floatfmt=".4g")
    data = {"tokens_scale": args.tokens_scale, "width_scale": args.width_scale, "support": asdict(support)}
    data |= {"rebuild_kernel": kernel, "blocks": reports}
    print(f"wrote {write_json(args.output, 'fp8_matmul', data)}")


if __name__ == "__main__":
    main()
